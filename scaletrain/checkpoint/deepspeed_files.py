"""DeepSpeed's checkpoint files: what scaletrain reads of them, with or without an engine.

DeepSpeed writes its own layout (``mp_rank_00_model_states.pt``: the module from rank 0 and the engine's
counters; ``zero_pp_rank_R_mp_rank_00_optim_states.pt``: each rank's ZeRO optimizer partition, fp32 master
weights included; ZeRO-3 also ``zero_pp_rank_R_mp_rank_00_model_states.pt``), through
``DeepSpeedEngine.save_checkpoint`` (the engine's ``save_native``); which files a checkpoint holds is
``engine_state.py``'s decision. This module reads them: :func:`load_native` resumes an engine from them
(weights-only, with one line for a layout this scaletrain cannot resume), :func:`consolidated_weights` gives
the full fp32 model without an engine (``evaluate``, ``translate``, ``average``, ``export``; ZeRO shards
through DeepSpeed's public ``zero_to_fp32``), and :func:`deepspeed_checkpoint_types` registers the plain
records DeepSpeed pickles into its files with ``scaletrain.safeload``. The one module outside
``scaletrain/engine/`` that imports DeepSpeed (tested).
"""
from __future__ import annotations

from pathlib import Path

import torch

from scaletrain.errors import ScaletrainError
from scaletrain.safeload import register_safe_types, safe_torch_load, weights_only_loads


def deepspeed_checkpoint_types() -> list:
    """The DeepSpeed classes in its checkpoint files (pickle opcodes of ZeRO 0-3, fp32/bf16/fp16): plain
    records, allowed in weights-only loads (scaletrain.safeload)."""
    out = []
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

        out += [LossScaler, DynamicLossScaler]
    except ImportError:
        pass
    try:
        from deepspeed.runtime.zero.config import ZeroStageEnum

        out.append(ZeroStageEnum)
    except ImportError:
        pass
    try:
        from deepspeed.utils.tensor_fragment import fragment_address

        out.append(fragment_address)
    except ImportError:
        pass
    return out


register_safe_types(deepspeed_checkpoint_types)


def load_native(engine, ckpt: Path) -> None:
    """Resume ``engine`` from DeepSpeed's files in ``ckpt`` (DeepSpeed's own ``torch.load`` calls run
    weights-only); a ZeRO-0 16-bit checkpoint of DeepSpeed's unfused optimizer gets one line."""
    try:
        with weights_only_loads():  # DeepSpeed's own torch.load calls weights_only=False
            engine.load_native(ckpt)
    except (KeyError, ValueError, TypeError, RuntimeError):
        refuse_unfused_layout(ckpt)  # diagnosed only on failure: no second read of a good one
        raise


def model_states_file(ckpt: Path) -> Path | None:
    """The file of DeepSpeed's model states (rank 0's), None if ``ckpt`` holds none."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (Path(ckpt) / name).is_file():
            return Path(ckpt) / name
    return None


def refuse_unfused_layout(ckpt: Path) -> None:
    """One line for a ZeRO-0 16-bit checkpoint written with DeepSpeed's FP16_UnfusedOptimizer (bf16 at ZeRO-0
    before it ran as torch autocast, ``ds_config.runtime_ds_config``): its ``optimizer`` entry holds the
    wrapper's state (loss scaler, fp32 master copies, the inner optimizer's state), which today's plain
    optimizer cannot take. Returns when the file does not have that layout (the caller re-raises)."""
    f = ckpt / "mp_rank_00_model_states.pt"
    if not f.is_file():
        return
    sd = safe_torch_load(f)
    opt = sd.get("optimizer") if isinstance(sd, dict) else None
    if isinstance(opt, dict) and "fp32_groups" in opt and "optimizer_state_dict" in opt and "param_groups" not in opt:
        raise ScaletrainError(
            f"{ckpt}: its optimizer state was written by DeepSpeed's FP16_UnfusedOptimizer (bf16 at ZeRO-0 before "
            "scaletrain ran it as torch autocast over fp32 weights) and cannot be resumed; start a new "
            "train.out_dir (train.resume=false in this one would write over its checkpoints), or use its weights "
            "with evaluate, translate, average or export, which read them") from None


def has_zero_shards(ckpt: Path) -> bool:
    return any(ckpt.glob("*zero_pp_rank_*_optim_states.pt")) or any(ckpt.glob("zero_pp_rank_*_model_states.pt"))


def consolidated_weights(ckpt: Path) -> dict[str, torch.Tensor] | None:
    """The full fp32 model state dict of a DeepSpeed checkpoint directory; None if it is not one.

    Without partitioned fp32 weights: ``mp_rank_00_model_states.pt``. ZeRO-3 (parameters partitioned over
    ranks) and bf16/fp16 runs (fp32 master weights live in the optimizer shards): consolidated with
    DeepSpeed's ``zero_to_fp32``. 16-bit weights without fp32 master shards are upcast, and so are those
    of a ZeRO-1/2 bf16 run with owned MoCE experts (their ranks' partitions differ in size, which
    ``zero_to_fp32`` cannot lay out).
    """
    ms = ckpt / "mp_rank_00_model_states.pt"
    module: dict = {}
    owned = False
    if ms.is_file():
        sd = safe_torch_load(ms)
        module = sd.get("module") or {}
        tensors = [v for v in module.values() if torch.is_tensor(v) and v.is_floating_point()]
        # expert parallelism with owned experts (MoCE, moe.moce_partition): rank 0's module holds empty
        # tensors for the other ranks' experts; the expert shard files fill them (merge_expert_shards)
        owned = any(v.numel() == 0 for v in tensors) and any(ckpt.glob("expert_shard_ep*.pt"))
        complete = bool(tensors) and (owned or all(v.numel() > 0 for v in tensors))
        if complete and all(v.dtype == torch.float32 for v in tensors):
            return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}
    if has_zero_shards(ckpt) and not owned:  # (zero_to_fp32 cannot lay out ranks whose experts differ in size)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with weights_only_loads():  # zero_to_fp32 calls torch.load(..., weights_only=False)
            sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
        return {k: v.detach().float().clone() if v.is_floating_point() else v.clone() for k, v in sd.items()}
    if module:  # 16-bit weights without fp32 master shards
        return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}
    return None
