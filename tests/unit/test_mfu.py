"""MFU estimate: peak table, CPU peak from the GEMM probe, MoE FLOPs, the metric formula; fp16 loss scale
accessors of the engines."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scaletrain.models import ModelConfig, estimate_flops_per_token
from scaletrain.models.config import MoEConfig
from scaletrain.train.mfu import MfuEstimator, device_peak, moe_extra_flops_per_token, table_peak_tflops


@pytest.mark.parametrize("name,precision,tf32,expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", False, 989.4),
    ("NVIDIA H100 80GB HBM3", "fp32", False, 66.9),
    ("NVIDIA H100 80GB HBM3", "fp32", True, 494.7),
    ("NVIDIA H100 PCIe", "fp16", False, 756.0),
    ("NVIDIA H200", "bf16", False, 989.4),
    ("NVIDIA H200 NVL", "bf16", False, 835.5),
    ("NVIDIA A100-SXM4-80GB", "bf16", False, 312.0),
    ("NVIDIA A100 80GB PCIe", "fp32", False, 19.5),
    ("NVIDIA GeForce GTX 1080", "bf16", False, None),
])
def test_peak_table(name, precision, tf32, expected):
    assert table_peak_tflops(name, precision, tf32) == expected


def test_cpu_peak_is_the_measured_gemm_probe_and_the_override_wins():
    from scaletrain.engine.precision import cached_probe

    peak, source = device_peak(torch.device("cpu"), "fp32")
    assert peak == cached_probe().fp32_gflops * 1e9 and "GEMM probe" in source
    assert device_peak(torch.device("cpu"), "bf16")[0] == cached_probe().bf16_gflops * 1e9
    assert device_peak(torch.device("cpu"), "fp32", override_tflops=2.5) == (2.5e12, "tracking.peak_tflops=2.5")


def test_mfu_metric_is_tokens_times_model_flops_over_world_peak():
    cfg = ModelConfig(d_model=64, n_heads=4, encoder_layers=2, decoder_layers=2, ffn_dim=128)
    est = MfuEstimator(cfg, 300, world_size=4, peak_flops=1e12, peak_source="test")
    m = est.metrics(tokens_per_s=5000.0, src_len=30.0, tgt_len=20.0)
    fpt = estimate_flops_per_token(cfg, 30.0, 20.0, 300)
    assert m["train/flops_per_token"] == fpt
    assert m["train/mfu"] == pytest.approx(5000.0 * fpt / 4e12, rel=1e-12)
    assert 0 < m["train/mfu"] <= 1
    assert m["train/model_tflops"] == pytest.approx(5000.0 * fpt / 1e12) and m["train/peak_tflops"] == 4.0
    assert MfuEstimator(cfg, 300, 4, None, "unknown GPU").metrics(5000.0, 30.0, 20.0) == {}


def test_moe_layers_cost_top_k_expert_ffns_and_the_router():
    cfg = ModelConfig(d_model=8, n_heads=2, encoder_layers=2, decoder_layers=4, ffn_dim=16)
    moe = MoEConfig(num_experts=4, top_k=2, every=2, ffn_dim=32)  # MoE: encoder layer 1, decoder layers 1 and 3
    # per routed token: 2 experts x 2*8*32 MACs + router 8*4 - dense 2*8*16 = 1024 + 32 - 256 = 800 MACs
    # encoder: 1 layer x 10 source tokens, decoder: 2 layers x 5 target tokens; per target token, x6 (fwd+bwd)
    assert moe_extra_flops_per_token(cfg, moe, 10.0, 5.0) == 6.0 * 800 * (1 * 10 + 2 * 5) / 5
    assert moe_extra_flops_per_token(cfg, MoEConfig(), 10.0, 5.0) == 0.0
    est = MfuEstimator(cfg, 100, 1, 1e12, "t", moe)
    assert est.flops_per_token(10.0, 5.0) == estimate_flops_per_token(cfg, 10.0, 5.0, 100) + 6.0 * 800 * 20 / 5


def test_deepspeed_loss_scale_reads_the_optimizers_current_scale():
    """Both places DeepSpeed keeps it: FP16_Optimizer's ``loss_scale_config.cur_scale`` and the ZeRO
    optimizers' ``cur_scale``; None when fp16 is off."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaleConfig

    from scaletrain.engine.deepspeed_backend import DeepSpeedBackend

    def backend(fp16, optimizer):
        b = DeepSpeedBackend()
        b.e = SimpleNamespace(fp16_enabled=lambda: fp16, optimizer=optimizer)
        return b

    scaler = LossScaleConfig(torch.float16, dynamic_loss_scale=True, static_loss_scale=1.0, dynamic_loss_args=None,
                             initial_dynamic_scale=2.0**12)
    assert backend(True, SimpleNamespace(loss_scale_config=scaler)).loss_scale() == 4096.0
    assert backend(True, SimpleNamespace(cur_scale=256.0)).loss_scale() == 256.0
    assert backend(False, SimpleNamespace(cur_scale=256.0)).loss_scale() is None


def test_accelerate_loss_scale_is_the_grad_scalers():
    from scaletrain.engine.ddp_backend import DDPBackend

    def backend(scaler):
        b = DDPBackend()
        b.acc = SimpleNamespace(scaler=scaler)
        return b

    assert backend(torch.amp.GradScaler("cpu", init_scale=1024.0)).loss_scale() == 1024.0
    assert backend(None).loss_scale() is None
