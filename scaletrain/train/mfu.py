"""Model FLOPs utilisation (MFU) of a training run: model FLOPs per target token x target tokens/s / peak.

* FLOPs per target token: the model's own count (:func:`scaletrain.models.estimate_flops_per_token`,
  forward + backward, every matmul, no padding) at the interval's mean source and target lengths
  (tokens / sentence pairs, all ranks), plus the MoE feed-forward layers (which that count treats as
  dense): each MoE layer costs ``top_k`` expert FFNs (``moe.ffn_dim``), the router and the shared
  expert instead of one dense FFN.
* Peak, per device (the run's is ``world_size`` times it): ``tracking.peak_tflops`` when set; on a
  CUDA device the dense tensor-core peak of the precision from :data:`PEAK_TFLOPS` (fp32 with TF32
  matmuls allowed counts as TF32); on CPU the GEMM throughput :mod:`scaletrain.engine.precision`
  measures with this process's threads (fp32, or bf16 for a bf16 run). An unknown GPU without
  ``tracking.peak_tflops``: no MFU (one log line says so).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from scaletrain.models import estimate_flops_per_token

log = logging.getLogger("scaletrain")

# Dense (no sparsity) peak TFLOP/s per GPU from the vendors' data sheets; first matching name wins.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H200 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM (HBM3)
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
]


def table_peak_tflops(device_name: str, precision: str, tf32: bool = False) -> float | None:
    """The table's dense peak for a GPU name (``torch.cuda.get_device_name()``) and precision."""
    key = "tf32" if precision == "fp32" and tf32 else precision
    for name, peaks in PEAK_TFLOPS:
        if name.lower() in device_name.lower():
            return peaks.get(key)
    return None


def device_peak(device: torch.device, precision: str, override_tflops: float = 0.0) -> tuple[float | None, str]:
    """(peak FLOP/s of one device or None, where it came from)."""
    if override_tflops > 0:
        return override_tflops * 1e12, f"tracking.peak_tflops={override_tflops:g}"
    if getattr(device, "type", "cpu") == "cuda":
        name = torch.cuda.get_device_name(device)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        tf = table_peak_tflops(name, precision, tf32)
        if tf is None:
            return None, f"{name} is not in the peak table (set tracking.peak_tflops)"
        return tf * 1e12, f"{name} {precision}{' (TF32)' if precision == 'fp32' and tf32 else ''} table peak"
    from scaletrain.engine.precision import cached_probe

    p = cached_probe()
    gflops = p.bf16_gflops if precision == "bf16" else p.fp32_gflops
    return gflops * 1e9, f"CPU GEMM probe {'bf16' if precision == 'bf16' else 'fp32'} {gflops:.1f} GFLOP/s"


def moe_extra_flops_per_token(model_cfg, moe, src_len: float, tgt_len: float) -> float:
    """Training FLOPs per target token that MoE layers add over the dense FFNs the model count assumes."""
    if moe is None or not moe.enabled():
        return 0.0
    d, f, fe, E = model_cfg.d_model, model_cfg.ffn_dim, moe.expert_ffn_dim(model_cfg), moe.num_experts
    per_token = moe.top_k * 2 * d * fe + d * E + (2 * d * fe if moe.shared_expert else 0) - 2 * d * f  # MACs
    n_enc = sum(moe.moe_layer(i) for i in range(model_cfg.encoder_layers))
    n_dec = sum(moe.moe_layer(i) for i in range(model_cfg.decoder_layers))
    return 6.0 * per_token * (n_enc * src_len + n_dec * tgt_len) / tgt_len


@dataclass
class MfuEstimator:
    """``metrics(tokens_per_s, src_len, tgt_len)``: ``train/mfu``, ``train/model_tflops`` (achieved, all
    ranks), ``train/flops_per_token`` and ``train/peak_tflops`` (all ranks); empty without a peak."""

    model_cfg: object
    vocab_size: int
    world_size: int
    peak_flops: float | None  # one device
    peak_source: str
    moe: object = None

    @classmethod
    def for_run(cls, cfg, vocab_size: int, engine) -> "MfuEstimator":
        """The peak is looked up (CPU: measured) on the main rank only, which is the one that logs."""
        if not engine.is_main:
            return cls(cfg.model, vocab_size, engine.world_size, None, "not the main rank", cfg.moe)
        peak, source = device_peak(engine.device, cfg.engine.precision, cfg.tracking.peak_tflops)
        log.info("MFU peak per device: %s", source if peak else f"none ({source})")
        return cls(cfg.model, vocab_size, engine.world_size, peak, source, cfg.moe)

    def __post_init__(self):
        if self.moe is not None and not self.moe.enabled():
            self.moe = None  # a dense model: no MoE FLOPs to add at each log line

    def flops_per_token(self, src_len: float, tgt_len: float) -> float:
        base = estimate_flops_per_token(self.model_cfg, src_len, tgt_len, self.vocab_size)
        return base + moe_extra_flops_per_token(self.model_cfg, self.moe, src_len, tgt_len)

    def metrics(self, tokens_per_s: float, src_len: float, tgt_len: float) -> dict[str, float]:
        if not self.peak_flops or tgt_len <= 0:
            return {}
        fpt = self.flops_per_token(src_len, tgt_len)
        achieved = tokens_per_s * fpt
        peak = self.peak_flops * self.world_size
        return {"train/mfu": achieved / peak, "train/model_tflops": achieved / 1e12, "train/flops_per_token": fpt,
                "train/peak_tflops": peak / 1e12}
