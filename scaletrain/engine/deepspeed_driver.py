"""The ``Driver`` (``driver.py``) of a ``deepspeed.DeepSpeedEngine``, and DeepSpeed's checkpoint files.

:class:`DeepSpeedEngine` (the native launcher) and :class:`AccelerateEngine` with the DeepSpeed
plugin both end up holding a DeepSpeed engine; the micro-step protocol, the update, the gradient
norm, ZeRO-3 parameter gathering and checkpoint I/O are written once here (the expert set-up around
``deepspeed.initialize`` is ``experts.py``). Code outside
``scaletrain/engine/`` never asks about ZeRO: it calls ``Engine.inference_module()`` and
``Engine.full_state_dict()``, and :func:`consolidated_weights` reads DeepSpeed's checkpoint files.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from scaletrain.engine.base import StepInfo, min_loss_scale_error
from scaletrain.engine.device_skip import (can_skip_on_device, clip_, grad_norm, nonfinite_flag, rewind_schedule,
                                           withheld_if)
from scaletrain.engine.model_prep import cudagraph_step_begin
from scaletrain.engine.optim import own_grad_norm
from scaletrain.errors import ScaletrainError
from scaletrain.parallel import ParallelContext
from scaletrain.parallel.grads import ExpertParallelGrads
from scaletrain.parallel.state import expert_checkpoint_load, save_expert_shard
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


def is_partitioned(module: torch.nn.Module) -> bool:
    """True if DeepSpeed ZeRO-3 partitions this module's parameters (a rank holds only a slice)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


class DeepSpeedDriver:
    """Drives one DeepSpeed engine: micro-steps, update, grad norm, ZeRO-3 gathers, checkpoints.

    ``parallel``: the engine's ``ParallelContext`` (expert groups; rank 0 writes the files of all).
    ``scheduler``: an LR scheduler DeepSpeed does not own (Accelerate hands DeepSpeed only its own
    scheduler types); it is stepped here once per update that was not skipped, and saved beside
    DeepSpeed's files (``scheduler.pt``).

    Expert parallelism (a model built with moe.ep_size > 1; ``ds_config`` says which precisions). ZeRO-0: DeepSpeed
    would average every gradient over the whole world, expert gradients included; its backward
    all-reduce is switched off, and at the update the driver averages the dense gradients over the
    world, sums expert gradients over the expert-data-parallel group / W and clips with the norm that
    counts each expert once (``scaletrain.parallel.grads``; the JSON's gradient_clipping is 0 then).
    ZeRO-1/2: DeepSpeed's own MoE path (``expert_setup``; no clipping: its norm averages expert norms
    over the EDP group instead of summing them over the EP group).
    """

    def __init__(self, ds_engine, parallel: ParallelContext, scheduler=None, clip_norm: float = 0.0,
                 cudagraphs: bool = False):
        self.e = ds_engine
        self.cudagraphs = cudagraphs  # engine.compile_mode=reduce-overhead on CUDA (model_prep.uses_cudagraphs)
        self.scheduler = scheduler
        self.ep = ExpertParallelGrads(ds_engine.module, parallel)
        self.clip_norm = clip_norm
        # ZeRO-0: our reduction (DeepSpeed's off); ZeRO-1/2: DeepSpeed's MoE path (``expert_setup``)
        self.own_ep = self.ep.active and ds_engine.zero_optimization_stage() == 0
        if self.ep.active:
            if ds_engine.zero_optimization_stage() not in (0, 1, 2) or ds_engine.fp16_enabled() \
                    or (self.own_ep and ds_engine.bfloat16_enabled()):
                # ZeRO-0 with DeepSpeed's own bf16/fp16 optimizer (FP16_UnfusedOptimizer) would copy rank 0's
                # experts into its fp32 master weights (ds_config._expert_parallel_refusal); bf16 at ZeRO-0
                # reaches DeepSpeed as torch autocast (ds_config.runtime_ds_config) and passes here
                raise ScaletrainError("moe.ep_size > 1 under DeepSpeed needs ZeRO-0/1/2 in fp32 or bf16, with bf16 at "
                                      "ZeRO-0 as torch autocast (docs/EXPERT_PARALLEL.md); use "
                                      "engine.ds_config=zero0.json engine.precision=bf16 or fp32")
            if not self.own_ep and not getattr(ds_engine, "has_moe_layers", False):
                raise ScaletrainError("DeepSpeed did not take the expert parameters (build the engine inside "
                                      "scaletrain.engine.experts.expert_setup)")
        if self.own_ep:
            ds_engine.enable_backward_allreduce = False
        # DeepSpeed reports the global grad norm from its fp16/bf16/ZeRO optimizers only; on the plain path
        # (fp32, or bf16 by torch autocast: ZeRO-0) we measure, clip and withhold a non-finite update on the
        # device ourselves (``device_skip``; DeepSpeed's own clipping there is per tensor and is switched off).
        e = ds_engine
        self.own_norm = not (e.fp16_enabled() or e.bfloat16_enabled() or e.zero_optimization())
        self.device_skip = self.own_norm and not self.own_ep and can_skip_on_device(e.optimizer)
        if self.device_skip:
            e._config.gradient_clipping = 0.0
        self._zero_hook = None
        self._zero_flag: torch.Tensor | None = None
        if e.zero_optimization() and not e.fp16_enabled():
            self._install_zero_hook()
        self._force_skip = False

    @property
    def module(self) -> torch.nn.Module:
        return self.e.module

    @property
    def device(self) -> torch.device:
        d = self.e.device
        return d if isinstance(d, torch.device) else torch.device(d)

    @property
    def zero_stage(self) -> int:
        return self.e.zero_optimization_stage()

    def train(self, mode: bool) -> None:
        self.e.train(mode)

    def forward(self, src, tgt_in, src_padded: bool = True):
        cudagraph_step_begin(self.cudagraphs and self.e.module.training)
        return self.e(src, tgt_in, src_padded=src_padded)

    def backward(self, loss) -> None:
        self.e.backward(loss)
        if not self.e.is_gradient_accumulation_boundary():
            self.e.step()  # DeepSpeed counts micro-steps; it only updates at the boundary

    def _skipped(self) -> int:
        return int(getattr(self.e, "skipped_steps", 0) or 0)

    def _install_zero_hook(self) -> None:
        """ZeRO 1-3 (fp32/bf16) step our AdamW on their fp32 partitions after computing the global norm
        (all ranks agree on it). A pre-step hook on that optimizer turns the norm into the ``found_inf`` flag,
        so a non-finite update is withheld on the device; ZeRO-1/2 (``DeepSpeedZeroOptimizer``) also leave
        the clipping to the hook (theirs asks the host whether the norm is valid first). DeepSpeed's own
        overflow check stays where DeepSpeed runs it (ZeRO-3, fp32 ZeRO-1/2: one host read per update);
        the bf16 one of ZeRO-1/2 is off in the configs we generate (``ds_config``)."""
        zopt, inner = self.e.optimizer, getattr(self.e.optimizer, "optimizer", None)
        if inner is None or not can_skip_on_device(inner) or not hasattr(zopt, "_global_grad_norm"):
            return
        clip = 0.0
        if type(zopt).__name__ == "DeepSpeedZeroOptimizer" and getattr(zopt, "clip_grad", 0.0) > 0:
            clip, zopt.clip_grad = float(zopt.clip_grad), 0.0

        def pre_step(opt, args, kwargs):
            norm = getattr(zopt, "_global_grad_norm", None)
            if not torch.is_tensor(norm):
                return None
            params = [p for g in opt.param_groups for p in g["params"]]
            clip_(params, clip, norm.to(params[0].device) if params else norm)
            self._zero_flag = nonfinite_flag(norm)
            opt.found_inf = self._zero_flag.to(params[0].device) if params else self._zero_flag
            return None

        def post_step(opt, args, kwargs):
            opt.__dict__.pop("found_inf", None)

        self._zero_hook = (inner.register_step_pre_hook(pre_step), inner.register_step_post_hook(post_step))

    def abandon_step(self, failed: int) -> None:
        """Micro-batch ``failed`` raised (``Engine.abandon_step``): DeepSpeed counts micro-steps in ``step()``
        (``backward`` above), so the missing ones are counted, and the update at the boundary is withheld."""
        for _ in range(self.e.gradient_accumulation_steps() - 1 - failed):
            self.e.step()  # before the boundary: counters only
        self._force_skip = True

    def step(self) -> StepInfo:
        """The update. A non-finite gradient is never applied: on the plain path (fp32, bf16 by autocast;
        ZeRO-0) and in ZeRO 1-3 the fused AdamW withholds it on the device (``device_skip``: the flag is
        read with the step's other values on the next log step); fp16 and ZeRO-3 (and fp32 ZeRO-1/2) skip
        it themselves (their global norm check, a host read); without a fused optimizer our own norm of
        the all-reduced gradient, identical on every rank, is read here and the optimizer's step withheld."""
        before = self._skipped()
        forced, self._force_skip = self._force_skip, False
        self._zero_flag = None
        if self.device_skip and not forced:
            return self._device_step()
        if self.own_ep:
            self.ep.reduce(dense=True)
            own = self.ep.clip(self.clip_norm)
        else:
            own = own_grad_norm(self.e.module.parameters()) if self.own_norm else None
        try:
            if forced or own is not None and not math.isfinite(own):
                self._skip_update()
            else:
                self.e.step()
        except Exception as e:  # DeepSpeed's own stop at fp16's minimum loss scale (a bare Exception)
            if "loss scale already at minimum" in str(e):
                raise min_loss_scale_error(float(getattr(self.e.optimizer, "cur_scale", 0.0) or 0.0)) from None
            raise
        norm = own if own is not None else self.e.get_global_grad_norm()
        if norm is None:
            norm = float("nan")
        skipped = self._skipped() > before
        if self.scheduler is not None and not skipped:
            self.scheduler.step()
        flag = self._zero_flag if not skipped else None  # ZeRO: withheld on the device (read later)
        fp16 = self.e.fp16_enabled()
        return StepInfo(grad_norm=norm, lr=self.lr, skipped=skipped, nonfinite=False if fp16 or forced else None,
                        flag=flag, on_skip=self._rewind if flag is not None else None)

    def _device_step(self) -> StepInfo:
        """fp32/autocast ZeRO-0: norm, clip and the non-finite flag stay on the device; DeepSpeed steps (and
        advances the LR schedule) as usual, the fused AdamW withholding the update where the flag is 1."""
        params = [p for p in self.e.module.parameters() if p.grad is not None]
        norm = grad_norm(params)
        clip_(params, self.clip_norm, norm)
        flag = nonfinite_flag(norm)
        with withheld_if(self.e.optimizer, flag):
            self.e.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return StepInfo(grad_norm=norm, lr=self.lr, flag=flag, on_skip=self._rewind)

    def _rewind(self) -> float:
        """A withheld update read on the host: the LR schedule goes back by the step it took."""
        return rewind_schedule(self.scheduler if self.scheduler is not None else self.e.lr_scheduler)

    def _skip_update(self) -> None:
        """``e.step()`` without the optimizer's update: DeepSpeed still zeroes the gradients and advances its
        micro-step counters, and counts the update as skipped (no LR step), as for an fp16 overflow."""
        opt = self.e.optimizer
        saved = {k: vars(opt)[k] for k in ("step", "overflow") if k in vars(opt)}  # e.g. the LR scheduler's wrapper
        opt.step = lambda *a, **k: None  # instance attribute: shadows the optimizer's step for this call
        opt.overflow = True
        try:
            self.e.step()
        finally:
            for k in ("step", "overflow"):
                if k in saved:
                    setattr(opt, k, saved[k])
                else:
                    delattr(opt, k)

    @property
    def lr(self) -> float:
        return float(self.e.get_lr()[0])

    def loss_scale(self) -> float | None:
        """fp16: the optimizer's current scale (FP16_Optimizer: ``loss_scale_config.cur_scale``; ZeRO:
        ``cur_scale``); None otherwise."""
        if not self.e.fp16_enabled():
            return None
        opt = self.e.optimizer
        holder = getattr(opt, "loss_scale_config", None) or opt
        scale = getattr(holder, "cur_scale", None)
        return float(scale) if scale is not None else None

    def partitioned(self) -> bool:
        """ZeRO-3, or expert parallelism (this rank holds only its experts; every forward exchanges)."""
        return self.ep.active or is_partitioned(self.e.module)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters on every rank (ZeRO-3 partitions gathered), fp32 on CPU. Collective."""
        import deepspeed

        mod = self.e.module
        if self.ep.active:  # every expert of every layer, gathered over the EP group
            from scaletrain.parallel.state import consolidate_state_dict

            return {k: v.float().cpu().clone() for k, v in consolidate_state_dict(mod, self.ep.ctx).items()}
        if not is_partitioned(mod):
            return {k: v.detach().float().cpu().clone() for k, v in mod.state_dict().items()}
        with deepspeed.zero.GatheredParameters(list(mod.parameters()), modifier_rank=None):
            keys = set(mod.state_dict(keep_vars=True))
            named = dict(mod.named_parameters()) | dict(mod.named_buffers())
            return {k: v.detach().float().cpu().clone() for k, v in named.items() if k in keys}

    @contextlib.contextmanager
    def _plain_checkpoint(self):
        """DeepSpeed's MoE checkpoint layout expects its own MoE modules: with ours, checkpoints take
        the plain path (module from rank 0, each rank's ZeRO optimizer partition) plus our expert shards."""
        moe, self.e.has_moe_layers = getattr(self.e, "has_moe_layers", False), False
        try:
            yield
        finally:
            self.e.has_moe_layers = moe

    def save(self, ckpt_dir: Path, tag: str) -> None:
        with self._plain_checkpoint():
            self.e.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False)
        save_expert_shard(Path(ckpt_dir) / tag, self.e.module, self.e.optimizer, self.ep.ctx)
        if self.scheduler is not None and self.ep.ctx.rank == 0:  # the LR schedule is ours, not DeepSpeed's
            torch.save(self.scheduler.state_dict(), Path(ckpt_dir) / tag / "scheduler.pt")

    def load(self, ckpt_dir: Path, tag: str) -> None:
        """DeepSpeed's checkpoint, this rank's experts, and (``scheduler`` given) the LR schedule from
        ``scheduler.pt``."""
        sched_state = None
        if self.scheduler is not None:
            sched = Path(ckpt_dir) / tag / "scheduler.pt"
            if not sched.is_file():
                raise ScaletrainError(f"{sched} missing: this checkpoint was not written by the Accelerate DeepSpeed engine")
            sched_state = safe_torch_load(sched)
        self._load_engine(ckpt_dir, tag)
        if sched_state is not None:
            self.scheduler.load_state_dict(sched_state)

    def _load_engine(self, ckpt_dir: Path, tag: str) -> None:
        # The module's experts come from rank 0's file: this rank's are put back from its expert shard
        # (ZeRO-1/2 restore each rank's fp32 partitions, its experts' Adam state, from its own file).
        # Another ep_size: resharded under ZeRO-0 (ZeRO-1/2 keep parameters in flat partitions: refused).
        with expert_checkpoint_load(Path(ckpt_dir) / tag, self.e.module, self.e.optimizer, self.ep.ctx,
                                    reshard=self.zero_stage == 0):
            with self._plain_checkpoint():
                self._load(ckpt_dir, tag)

    def _load(self, ckpt_dir: Path, tag: str) -> None:
        try:
            with weights_only_loads():  # DeepSpeed's own torch.load calls weights_only=False
                path, _ = self.e.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=True,
                                                 load_lr_scheduler_states=True)
        except (KeyError, ValueError, TypeError, RuntimeError):
            refuse_unfused_layout(Path(ckpt_dir) / tag)  # diagnosed only on failure: no second read of a good one
            raise
        if path is None:
            raise ScaletrainError(f"DeepSpeed could not load checkpoint {ckpt_dir}/{tag}")


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


# ------------------------------------------------------------------------------------------------
# DeepSpeed checkpoint files, read without an engine (evaluate, translate, average, export)

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
