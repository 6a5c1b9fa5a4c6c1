"""Read a user's DeepSpeed JSON and fill in the values the trainer owns.

Token-budget batches have a variable number of sentences, so DeepSpeed's sentence counts are
nominal: train_micro_batch_size_per_gpu is 1 "batch", train_batch_size = grad_accum * world.
A value the user set that disagrees with ours is an error naming both.
"""
from __future__ import annotations

import json
from pathlib import Path

from scaletrain.errors import ScaletrainError
from scaletrain.parallel import ParallelDims


REPO_DS_CONFIGS = Path(__file__).resolve().parents[2] / "ds_configs"


def resolve_ds_config_path(name: str) -> Path:
    """A path as given, else a file of the project's ds_configs/ directory."""
    p = Path(name)
    if p.is_file():
        return p
    for cand in (REPO_DS_CONFIGS / p.name, REPO_DS_CONFIGS / name):
        if cand.is_file():
            return cand
    avail = sorted(x.name for x in REPO_DS_CONFIGS.glob("*.json")) if REPO_DS_CONFIGS.is_dir() else []
    raise ScaletrainError(
        f"DeepSpeed config {name} not found (engine.ds_config); give a path or one of: {', '.join(avail)}"
    )


def zero_stage(ds: dict) -> int:
    """The ZeRO stage a DeepSpeed config asks for (0 without a ``zero_optimization`` section)."""
    return (ds.get("zero_optimization") or {}).get("stage", 0)


def load_ds_config(cfg, world_size: int) -> dict:
    path = resolve_ds_config_path(cfg.engine.ds_config)
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ScaletrainError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if not isinstance(ds, dict):
        raise ScaletrainError(f"{path}: top level must be a JSON object")
    gas = cfg.engine.grad_accum
    owned = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "train_batch_size": gas * world_size,
        "gradient_clipping": float(cfg.optim.clip_norm),
    }
    ours_key = {
        "train_micro_batch_size_per_gpu": "data.max_tokens (batches are token budgets)",
        "gradient_accumulation_steps": "engine.grad_accum",
        "train_batch_size": "engine.grad_accum x world size",
        "gradient_clipping": "optim.clip_norm",
    }
    for k, v in owned.items():
        if k in ds and ds[k] != "auto" and ds[k] != v:
            raise ScaletrainError(
                f"{path}: '{k}' is {ds[k]!r} but scaletrain sets it to {v!r} from {ours_key[k]}; "
                f"remove it from the JSON (or set it to \"auto\") and change {ours_key[k].split(' ')[0]} instead"
            )
        ds[k] = v
    ep = ParallelDims.from_config(cfg, world_size).ep
    if ep > 1:  # expert parallelism: the engine clips with the EP-aware norm
        ds["gradient_clipping"] = 0.0
    prec = cfg.engine.precision
    for section, want in (("bf16", prec == "bf16"), ("fp16", prec == "fp16")):
        sec = ds.get(section)
        if isinstance(sec, dict) and "enabled" in sec and sec["enabled"] not in ("auto", want):
            raise ScaletrainError(
                f"{path}: '{section}.enabled' is {sec['enabled']!r} but engine.precision is {prec!r}; "
                "set precision with engine.precision only"
            )
        sec = dict(sec or {})
        sec["enabled"] = want
        ds[section] = sec
    if "optimizer" in ds or "scheduler" in ds:
        raise ScaletrainError(
            f"{path}: 'optimizer'/'scheduler' sections are owned by scaletrain (optim.* keys); remove them"
        )
    stage = zero_stage(ds)
    if stage not in (0, 1, 2, 3):
        raise ScaletrainError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    _check_expert_parallel(cfg, ep, path, stage, prec)
    offload = (ds.get("zero_optimization") or {}).get("offload_optimizer") or {}
    if str(offload.get("device", "none")).lower() in ("cpu", "nvme"):
        # ZeRO-Offload keeps the fp32 master weights and optimizer states on the CPU and runs the update
        # there. DeepSpeed then insists on its own optimizer (DeepSpeedCPUAdam, a C++ extension compiled at
        # first use, configured through the JSON 'optimizer' section) and refuses a client optimizer. The
        # optimizer is scaletrain's (optim.*: torch AdamW, the same maths and checkpoints as every other
        # config, no compiler needed), and torch's AdamW runs on CPU tensors as they are, so we tell
        # DeepSpeed to accept it. A user who sets the flag to true asks for DeepSpeed's optimizer section,
        # which scaletrain owns.
        if ds.get("zero_force_ds_cpu_optimizer") not in (None, False):
            raise ScaletrainError(
                f"{path}: 'zero_force_ds_cpu_optimizer' is {ds['zero_force_ds_cpu_optimizer']!r}; with optimizer "
                "offload scaletrain runs its own optimizer (optim.*) on the CPU; remove the key"
            )
        ds["zero_force_ds_cpu_optimizer"] = False
    ds.setdefault("steps_per_print", 10**9)  # our loop prints its own log lines
    ds.setdefault("wall_clock_breakdown", False)
    _sync_free(ds, path, stage, prec)
    return ds


def _expert_parallel_refusal(stage: int, prec: str) -> str:
    """Why DeepSpeed cannot train expert parallelism with this stage and precision (checked against
    DeepSpeed 0.19.8's engine)."""
    if stage == 3:
        return "DeepSpeed refuses MoE under ZeRO-3, 'Native DeepSpeed MoE is not supported with ZeRO Stage 3'"
    if stage == 0:
        # DeepSpeedEngine._do_optimizer_sanity_check: no ZeRO, model dtype == gradient-accumulation dtype
        # (fp16) -> FP16 -> _configure_fp16_optimizer, and a client optimizer that is not FusedAdam ->
        # FP16_UnfusedOptimizer, which clones fp32 master weights inside deepspeed.initialize. (bf16 at
        # ZeRO-0 runs as torch autocast over fp32 weights, runtime_ds_config: no such copy.) Measured in
        # bf16 with that optimizer (ep 2 vs 1, 8 updates): rank 1's experts end equal to rank 0's within 5%
        # and the loss parts by 1.6e-2.
        return (f"ZeRO-0 in {prec} makes DeepSpeed wrap the optimizer in its FP16_UnfusedOptimizer, whose fp32 "
                "master weights are copied while every rank still holds rank 0's broadcast experts, so the first "
                "update would overwrite each rank's experts with rank 0's")
    return "fp16's loss-scaled ZeRO-1/2 optimizers are untested with experts here"


def _sync_free(ds: dict, path: Path, stage: int, prec: str) -> None:
    """Settings that keep DeepSpeed from waiting for the device in every step (docs/gpu_step.md); a value the
    user set is kept.

    * ``timers.throughput.enabled: false``: DeepSpeed's throughput timer synchronises the device at every
      forward and step (``synchronized: true``); our step logger measures throughput itself.
    * bf16 at ZeRO-1/2: ``bf16.check_grad_overflow: false``: the engine withholds a non-finite update on the
      device from the global norm DeepSpeed computes anyway (``deepspeed_internals.ZeroNormHook``), instead of
      DeepSpeed's per-gradient host check.
    * bf16 at ZeRO-0 runs by torch autocast (:func:`runtime_ds_config`); a ``torch_autocast`` section is
      scaletrain's then.
    """
    timers = ds.setdefault("timers", {})
    if not isinstance(timers, dict) or not isinstance(timers.setdefault("throughput", {}), dict):
        raise ScaletrainError(f"{path}: 'timers' must be an object like {{\"throughput\": {{\"enabled\": false}}}}")
    timers["throughput"].setdefault("enabled", False)
    autocast = ds.get("torch_autocast")
    if autocast is not None and not isinstance(autocast, dict):
        raise ScaletrainError(f"{path}: 'torch_autocast' must be an object")
    if autocast and autocast.get("enabled") not in (None, "auto", prec == "bf16" and stage == 0):
        raise ScaletrainError(
            f"{path}: 'torch_autocast.enabled' is {autocast['enabled']!r}; scaletrain turns it on for "
            "engine.precision=bf16 at ZeRO-0 (fp32 weights, bf16 autocast) and off otherwise; remove the key")
    if prec == "bf16" and stage in (1, 2):
        ds["bf16"].setdefault("check_grad_overflow", False)


def runtime_ds_config(ds: dict) -> dict:
    """The config handed to DeepSpeed: ``ds`` (``load_ds_config``), with bf16 at ZeRO-0 as torch autocast.

    DeepSpeed's bf16 at ZeRO-0 wraps our AdamW in its unfused fp16/bf16 optimizer: a host read per parameter
    tensor per step for its inf/nan check, a per-parameter weight norm, fp32 copies of every gradient and
    weight. With ``torch_autocast`` instead the weights stay fp32, the forward runs under
    ``torch.autocast(bfloat16)`` (matmuls in bf16, reductions in fp32), our fused AdamW updates the weights
    and the non-finite check is on the device (``optim.withheld_if``). Measured in docs/gpu_step.md.

    At ZeRO-0 without fp16 the engine measures and clips the reduced gradient itself (``Engine.step``: on the
    device, to ``optim.clip_norm``), so DeepSpeed is given ``gradient_clipping: 0`` there.
    """
    stage = int(zero_stage(ds))
    out = json.loads(json.dumps(ds))
    if stage == 0 and (out.get("bf16") or {}).get("enabled") is True:
        out["bf16"]["enabled"] = False
        out["torch_autocast"] = {**(out.get("torch_autocast") or {}), "enabled": True, "dtype": "bfloat16"}
    elif out.get("torch_autocast"):
        out["torch_autocast"]["enabled"] = False
    if stage == 0 and not (out.get("fp16") or {}).get("enabled"):
        out["gradient_clipping"] = 0.0
    return out


def _check_expert_parallel(cfg, ep: int, path: Path, stage: int, prec: str) -> None:
    """One-line errors for moe.ep_size = ``ep`` > 1 where this DeepSpeed config cannot train it."""
    if ep > 1 and (stage == 3 or prec == "fp16"):
        raise ScaletrainError(
            f"moe.ep_size={ep} under DeepSpeed needs ZeRO-0/1/2 in fp32 or bf16 ({path} has stage "
            f"{stage}, engine.precision is {prec}: {_expert_parallel_refusal(stage, prec)}): use "
            "engine.ds_config=zero0.json engine.precision=bf16, engine.ds_config=zero2.json optim.clip_norm=0, or "
            "engine.backend=accelerate engine.accelerate=ddp (any precision)")
    if ep > 1 and stage in (1, 2) and float(cfg.optim.clip_norm) > 0:
        # DeepSpeed's ZeRO-1/2 gradient norm averages each rank's expert norm over the expert-data-parallel
        # group instead of summing the squares over the expert-parallel group: ranks would clip differently.
        raise ScaletrainError(
            f"moe.ep_size={ep} with ZeRO-{stage} ({path}) needs optim.clip_norm=0: DeepSpeed's ZeRO-1/2 norm of "
            "expert gradients differs between ranks; clip with ZeRO-0 (exact EP-aware norm) or set optim.clip_norm=0")
