"""Every place scaletrain reaches past DeepSpeed's public API, in one module (checked against DeepSpeed 0.19.8).

The DeepSpeed backend (``deepspeed_backend.py``) drives a ``deepspeed.DeepSpeedEngine`` through its public
methods (``initialize``, ``backward``, ``step``, ``is_gradient_accumulation_boundary``,
``get_global_grad_norm``, ``fp16_enabled``/``bfloat16_enabled``/``zero_optimization_stage``,
``zero.GatheredParameters``, ``save_checkpoint``/``load_checkpoint``). What the public API cannot do is
here, each with the internal it relies on; ``tests/unit/test_deepspeed_internals.py`` fails when one of
them changes (and when the installed DeepSpeed is not :data:`CHECKED_VERSION`, so an upgrade re-checks
this list):

1. Expert parallelism on ZeRO-1/2 (:func:`moe_path`): DeepSpeed's MoE path switches on only for its own
   ``deepspeed.moe.layer.MoE`` modules, found by ``isinstance(module, MoE)`` against the global ``MoE`` of
   ``deepspeed.runtime.engine``; for the duration of ``initialize`` that global is swapped for a class
   whose ``isinstance`` also accepts our MoE blocks. Our expert groups are written into
   ``deepspeed.utils.groups._EXPERT_PARALLEL_GROUP`` / ``_EXPERT_DATA_PARALLEL_GROUP`` under DeepSpeed's
   name for them (``ep_size_P``), and the expert parameters carry DeepSpeed's ``allreduce`` /
   ``group_name`` marks. Checkpoints flip ``DeepSpeedEngine.has_moe_layers`` off around
   ``save_checkpoint``/``load_checkpoint`` (:func:`plain_moe_checkpoint`): DeepSpeed's MoE file layout
   expects its own MoE modules.
2. The non-finite skip on the device under ZeRO 1-3 (:class:`ZeroNormHook`): the ZeRO optimizers leave
   the global gradient norm of the update in ``_global_grad_norm`` before stepping our AdamW; a pre-step
   hook on our AdamW turns it into the fused kernel's ``found_inf`` flag. In bf16 at ZeRO-1/2 our configs
   switch DeepSpeed's per-gradient overflow check off (``bf16.check_grad_overflow: false``, a host read
   per update), and the skip then rests on DeepSpeed turning its ``-1`` "invalid norm" marker (a NaN/inf
   group norm masked by ``mask_nan_or_inf_with_val_inplace``) into ``inf`` when it combines the group
   norms (``combine_grad_norm_groups`` in ``deepspeed/runtime/utils.py``, called by
   ``DeepSpeedZeroOptimizer.scaled_global_norm``): a finite combination would apply a NaN update. The
   ZeRO-1/2 clipping is moved into the hook too (``DeepSpeedZeroOptimizer.clip_grad`` set to 0): theirs
   asks the host whether the norm is valid first.
3. Withholding one update (:func:`step_without_update`; ``train.on_oom=skip``, a host-side non-finite
   norm): ``DeepSpeedEngine.step`` runs with the optimizer's ``step`` shadowed by a no-op and its
   ``overflow`` attribute set, which ``DeepSpeedEngine._take_model_step`` counts as a skipped update
   (``skipped_steps``) while it zeroes the gradients and advances its counters.
4. fp16's current loss scale (:func:`loss_scale`): ``FP16_Optimizer.loss_scale_config.cur_scale`` or the
   ZeRO optimizers' ``cur_scale``; ``backward_allreduce_off`` sets ``enable_backward_allreduce`` (expert
   parallelism at ZeRO-0: the engine reduces the gradients itself, ``scaletrain.parallel.grads``).
5. Start-up without compiling (:func:`skip_unused_deepspeed_ops`): DeepSpeed's communication backend
   JIT-builds its shared-memory all-reduce op (``ShareMemCommBuilder``, gcc) whenever
   ``deepspeed.ops.__compatible_ops__`` says it is compatible, and reading that table probes every op
   (more gcc runs). The op serves only ``inference_all_reduce`` (tensor-parallel inference), which we never
   call. A table is put in its place that answers False for that op and probes any other op only when
   asked (``probe_is_compatible``). The build cost 85 s on an idle 2-core CPU and 2.5-4 min on a busy
   one, at every start with an empty extensions cache. :func:`init_distributed` also removes the
   shared-memory segments DeepSpeed's CPU backend names ``/dev/shm/deepspeed_allreduce_buffer_<uid>_
   <MASTER_ADDR>_<MASTER_PORT>_<rank>`` and never unlinks (each run left 66 MB per rank in RAM).
6. A state loaded at another layout (:func:`link_optimizer_state`; ``scaletrain.checkpoint.reshard``): the
   public ``deepspeed.utils.safe_set_full_optimizer_state`` writes through each parameter's ``_hp_mapping``,
   whose links to the optimizer's state DeepSpeed ZeRO-1/2 makes only after its first update
   (``DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state``); a load before any update calls it once
   the state exists. ZeRO-3 steps our AdamW on its flat fp32 partitions (``fp32_partitioned_groups_flat``),
   swapped into the groups only for the step (:func:`optimizer_partitions`).
7. DeepSpeed's checkpoint files and parameters, read past its public API by ``scaletrain.checkpoint.reshard``
   (a ZeRO checkpoint joined at another layout; ``zero_to_fp32`` reads the same keys) and the backend:
   each ZeRO-1/2 ``*_optim_states.pt`` partition's ``optimizer_state_dict`` holds ``param_slice_mappings``
   (per group: parameter name -> the fragment's ``start``/``numel`` in the flat partition) and
   ``single_partition_of_fp32_groups`` (the flat fp32 partitions) (:func:`zero12_partition`); ZeRO-3's
   hold ``fp32_flat_groups`` and its model states ``param_shapes`` (:func:`zero3_flat_groups`,
   :func:`zero3_param_shapes`); ZeRO-3 marks its partitioned parameters with ``ds_id`` and keeps their whole
   shape in ``ds_shape`` (:func:`zero3_partitioned`, :func:`whole_shape`).
"""
from __future__ import annotations

import contextlib
import os

import torch

from scaletrain.engine.optim import can_skip_on_device, clip_, nonfinite_flag

CHECKED_VERSION = "0.19.8"  # the DeepSpeed every internal below was read in and tested against


# ---- 1. expert parallelism on DeepSpeed's MoE path ---------------------------------------------------
def moe_group_name(ep_size: int) -> str:
    """DeepSpeed's name for the expert-parallel and expert-data-parallel groups of size ``ep_size``."""
    return f"ep_size_{ep_size}"


@contextlib.contextmanager
def moe_path(ep, is_moe_block):
    """Around ``deepspeed.initialize`` at ZeRO-1/2 under expert parallelism (``ep``: an
    ``ExpertParallelGrads``): our groups registered under DeepSpeed's name, the expert parameters marked
    for DeepSpeed's expert reduction, and ``isinstance(module, deepspeed.runtime.engine.MoE)`` true for our
    MoE blocks (``is_moe_block(module)``)."""
    import deepspeed.runtime.engine as ds_engine
    from deepspeed.utils import groups

    name = moe_group_name(ep.ctx.ep_size)
    groups._EXPERT_PARALLEL_GROUP[name] = ep.ctx.ep_group
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = ep.ctx.edp_group
    for p in ep.experts:
        p.allreduce, p.group_name = False, name
    original = ds_engine.MoE

    class _Meta(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, original) or is_moe_block(obj)

    ds_engine.MoE = _Meta("MoE", (), {})
    try:
        yield
    finally:
        ds_engine.MoE = original


@contextlib.contextmanager
def plain_moe_checkpoint(ds_engine):
    """DeepSpeed's MoE checkpoint layout expects its own MoE modules: with ours, checkpoints take the
    plain path (module from rank 0, each rank's ZeRO optimizer partition) plus our expert shard files."""
    moe, ds_engine.has_moe_layers = getattr(ds_engine, "has_moe_layers", False), False
    try:
        yield
    finally:
        ds_engine.has_moe_layers = moe


def takes_moe_path(ds_engine) -> bool:
    """DeepSpeed found MoE layers in the model (it reduces and partitions the experts over their groups)."""
    return bool(getattr(ds_engine, "has_moe_layers", False))


def backward_allreduce_off(ds_engine) -> None:
    """DeepSpeed no longer averages the gradients in backward (the engine reduces them itself)."""
    ds_engine.enable_backward_allreduce = False


# ---- 2. the ZeRO optimizers' global norm as the fused AdamW's found_inf ---------------------------------
class ZeroNormHook:
    """ZeRO 1-3 (fp32/bf16) step our fused AdamW on their fp32 partitions after computing the global norm
    (every rank agrees on it): a pre-step hook on that AdamW turns the norm into the ``found_inf`` flag, so a
    non-finite update is withheld on the device; ZeRO-1/2 (``DeepSpeedZeroOptimizer``) also leave the
    clipping to the hook. ``flag`` holds the last update's flag (None where the hook did not run: DeepSpeed
    skipped the update itself). :meth:`install` returns None where DeepSpeed's optimizer has no such norm
    or the inner optimizer cannot take the flag."""

    def __init__(self, zero_optimizer, inner, clip: float):
        self.flag: torch.Tensor | None = None
        self._clip, self._zopt = clip, zero_optimizer
        self._handles = (inner.register_step_pre_hook(self._pre), inner.register_step_post_hook(self._post))

    @classmethod
    def install(cls, ds_engine) -> "ZeroNormHook | None":
        zopt = ds_engine.optimizer
        inner = getattr(zopt, "optimizer", None)
        if inner is None or not can_skip_on_device(inner) or not hasattr(zopt, "_global_grad_norm"):
            return None
        clip = 0.0
        if type(zopt).__name__ == "DeepSpeedZeroOptimizer" and getattr(zopt, "clip_grad", 0.0) > 0:
            clip, zopt.clip_grad = float(zopt.clip_grad), 0.0
        return cls(zopt, inner, clip)

    def _pre(self, opt, args, kwargs):
        norm = getattr(self._zopt, "_global_grad_norm", None)
        if not torch.is_tensor(norm):
            return None
        params = [p for g in opt.param_groups for p in g["params"]]
        clip_(params, self._clip, norm.to(params[0].device) if params else norm)
        self.flag = nonfinite_flag(norm)
        opt.found_inf = self.flag.to(params[0].device) if params else self.flag
        return None

    def _post(self, opt, args, kwargs):
        opt.__dict__.pop("found_inf", None)


# ---- 3. one update withheld; the count of skipped updates ----------------------------------------------
def skipped_steps(ds_engine) -> int:
    """Updates DeepSpeed skipped so far (fp16 overflows, its own overflow checks, withheld ones)."""
    return int(getattr(ds_engine, "skipped_steps", 0) or 0)


def step_without_update(ds_engine) -> None:
    """``ds_engine.step()`` without the optimizer's update: DeepSpeed still zeroes the gradients, advances its
    micro-step counters and counts the update as skipped, as for an fp16 overflow."""
    opt = ds_engine.optimizer
    saved = {k: vars(opt)[k] for k in ("step", "overflow") if k in vars(opt)}  # e.g. the LR scheduler's wrapper
    opt.step = lambda *a, **k: None  # instance attribute: shadows the optimizer's step for this call
    opt.overflow = True
    try:
        ds_engine.step()
    finally:
        for k in ("step", "overflow"):
            if k in saved:
                setattr(opt, k, saved[k])
            else:
                delattr(opt, k)


# ---- 4. fp16's loss scale --------------------------------------------------------------------------------
def loss_scale(ds_engine) -> float | None:
    """fp16: the optimizer's current scale (FP16_Optimizer: ``loss_scale_config.cur_scale``; ZeRO:
    ``cur_scale``); None otherwise."""
    if not ds_engine.fp16_enabled():
        return None
    opt = ds_engine.optimizer
    holder = getattr(opt, "loss_scale_config", None) or opt
    scale = getattr(holder, "cur_scale", None)
    return float(scale) if scale is not None else None


# ---- 5. start-up -------------------------------------------------------------------------------------------
UNUSED_DEEPSPEED_OPS = ("deepspeed_shm_comm",)  # ShareMemCommBuilder.NAME: inference_all_reduce only


def import_deepspeed(module: str = "deepspeed"):
    """``import deepspeed`` (or one of its modules) without MLflow: DeepSpeed's autotuner (``deepspeed.autotuning``,
    imported by ``import deepspeed``) takes MLflow when it is installed, 1.4 of the 3.3 CPU-s that importing
    DeepSpeed costs on a 2-core CPU, in every rank and launcher process, and nothing here runs the autotuner.
    A later ``import mlflow`` (the tracker's) works as usual; where MLflow is already imported, nothing changes."""
    import importlib
    import sys

    blocked = "mlflow" not in sys.modules
    if blocked:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # makes `import mlflow` raise ImportError
    try:
        return importlib.import_module(module)
    finally:
        if blocked and sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]


class _LazyCompatibleOps(dict):
    """``deepspeed.ops.__compatible_ops__``, probed one op at a time on first look-up (DeepSpeed probes
    every op, compiling test programs, on first access); the ops in ``skip`` are never probed or built."""

    def __init__(self, skip, known=None):
        super().__init__(known or {})
        self.update({name: False for name in skip})

    def __missing__(self, name):
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
        from deepspeed.ops.op_builder.builder import probe_is_compatible

        builder = ALL_OPS.get(name)
        ok = bool(builder is not None and probe_is_compatible(builder))
        self[name] = ok
        return ok

    def get(self, name, default=None):
        try:
            return self[name]
        except (KeyError, ImportError):
            return default


def skip_unused_deepspeed_ops(skip=UNUSED_DEEPSPEED_OPS) -> None:
    """Before DeepSpeed's communication backend starts: mark the ops we never use as incompatible, so it
    does not JIT-build them (gcc) at start-up. Safe to call more than once."""
    ops = import_deepspeed("deepspeed.ops")

    table = vars(ops).get("__compatible_ops__")  # DeepSpeed < 0.19 computes it at import
    if isinstance(table, _LazyCompatibleOps):
        return
    ops.__compatible_ops__ = _LazyCompatibleOps(skip, known=table)


def init_distributed(backend: str, timeout=None) -> None:
    """``deepspeed.init_distributed`` without the op builds, then remove DeepSpeed's shared-memory allreduce
    segments: with every rank on one host, its CPU backend maps one per rank and never unlinks it; every rank
    maps every peer's segment inside ``init_distributed``, so after a barrier the names can go (the mappings
    live on until exit)."""
    import torch.distributed as dist

    deepspeed = import_deepspeed()

    skip_unused_deepspeed_ops()
    kw = {"timeout": timeout} if timeout is not None else {}
    deepspeed.init_distributed(dist_backend=backend, verbose=False, **kw)
    if torch.cuda.is_available() or not dist.is_initialized():
        return
    dist.barrier()
    name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), dist.get_rank()
    )
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:  # not all ranks local, or another DeepSpeed build
        pass


# ---- 6. a state loaded at another layout ------------------------------------------------------------------
def link_optimizer_state(ds_engine) -> None:
    """ZeRO-1/2: link each parameter's fragment to the optimizer's (now present) state, as DeepSpeed does after
    its first update, so that ``safe_set_full_optimizer_state`` can write it. ZeRO-3 reads the state directly."""
    opt = ds_engine.optimizer
    link = getattr(opt, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None and ds_engine.zero_optimization_stage() in (1, 2):
        opt._hp_optimizer_states_linked = False
        link()


def optimizer_partitions(ds_engine) -> list:
    """The flat fp32 tensors our AdamW steps under ZeRO 1-3 (its state is keyed on them)."""
    opt = ds_engine.optimizer
    if ds_engine.zero_optimization_stage() == 3:
        return list(opt.fp32_partitioned_groups_flat)
    return [p for g in opt.optimizer.param_groups for p in g["params"]]


# ---- 7. DeepSpeed's checkpoint files and partitioned parameters ------------------------------------------------
def zero12_partition(part: dict) -> tuple[list, list]:
    """A ZeRO-1/2 partition file's ``(param_slice_mappings, single_partition_of_fp32_groups)``: per group, the
    fragments ``name -> (start, numel)`` in the flat partition, and the flat fp32 partition itself."""
    return part["param_slice_mappings"], part["single_partition_of_fp32_groups"]


def zero3_flat_groups(part: dict) -> list:
    """A ZeRO-3 partition file's flat fp32 groups (``fp32_flat_groups``)."""
    return part["fp32_flat_groups"]


def zero3_param_shapes(model_states: dict) -> list[dict]:
    """ZeRO-3's model states' ``param_shapes``: per group, parameter name -> whole shape, in partition order."""
    return model_states["param_shapes"]


def zero3_partitioned(module) -> bool:
    """The module's parameters are ZeRO-3 partitioned (DeepSpeed marks each with ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def whole_shape(p) -> torch.Size:
    """A parameter's whole shape; ZeRO-3 keeps it in ``ds_shape`` (the tensor itself is empty there)."""
    shape = getattr(p, "ds_shape", None)
    return torch.Size(shape) if shape is not None else p.shape
