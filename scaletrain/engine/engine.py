"""The engine: the one class the training loop, validation and checkpoints are written against.

:class:`Engine` owns the run: its :class:`~scaletrain.parallel.ParallelContext` (the process groups and the
collectives on host values), the step API (``forward``, ``backward``, ``step``, ``abandon_step``, ``lr``,
``loss_scale``), whole-model access (``partitioned``, ``full_state_dict``, ``inference_module``) and the
state the checkpoint package writes and reads back (``state_dict``/``load_state_dict``, the library's own
files where it has them, ``layout``; ``scaletrain.checkpoint.engine_state`` decides what goes on disk). The
step logic every library shares is written here once:

* the reduced gradient's norm, clipping and the non-finite check, on the device where the fused AdamW can
  withhold the update itself (``optim.py``: no host read), else on the host;
* expert parallelism: expert gradients reduced over their group and the norm counting each expert once
  (``scaletrain.parallel.grads``; one ``ExpertParallelGrads``, built in :meth:`Engine.setup`);
* the LR schedule, keyed on the updates applied (``optim.UpdateSchedule``): a withheld update is counted
  where it is decided (on the device, from its flag), so nothing is rewound when the host reads the flag;
* an abandoned step (``train.on_oom=skip``): counters realigned, the coming update withheld;
* whole-model access: expert shards gathered (``scaletrain.parallel.state``), ZeRO-3 partitions gathered.

Under it one :class:`Backend` per library holds only what differs: starting the distributed run, wrapping
the model, backward, the optimizer step, the library's own state (``deepspeed_backend.py``: a DeepSpeed
engine, built by DeepSpeed's launcher or by Accelerate's plugin; ``ddp_backend.py``: Accelerate's DDP).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from scaletrain.engine.model_prep import prepare_model, uses_cudagraphs
from scaletrain.engine.optim import (UpdateSchedule, can_skip_on_device, clip_, grad_norm, nonfinite_flag,
                                     param_groups, withheld_if)
from scaletrain.errors import ScaletrainError
from scaletrain.parallel import ParallelContext, ParallelDims
from scaletrain.parallel.grads import ExpertParallelGrads
from scaletrain.parallel.lockstep import LockstepDecoder
from scaletrain.parallel.state import consolidate_state_dict, expert_params, gather_expert, shard_state_dict


class StepInfo:
    """What an update reports: the gradient norm, the learning rate after it, whether it was withheld.

    The values may still be on the device (a *pending* update: ``grad_norm`` and ``lr`` tensors, ``flag`` a
    device tensor that is 1 where the update was withheld for a non-finite gradient). Reading ``grad_norm``,
    ``lr``, ``skipped`` or ``nonfinite`` reads them to the host once (``resolve``); the training loop does
    that on log, validation and save steps only, for all pending updates in one read (``resolve_all``),
    so the steps in between never wait for the device. Reading changes nothing else: the LR schedule already
    counted the withheld update on the device (``optim.UpdateSchedule``).

    ``skipped``: the update was not applied (an fp16 overflow, a non-finite gradient, an abandoned step);
    ``nonfinite``: skipped because the gradient was NaN/inf outside fp16 loss scaling (``train.nonfinite``).
    Given as None, ``nonfinite`` is ``skipped and the norm is not finite``.
    """

    __slots__ = ("_norm", "_lr", "_skipped", "_nonfinite", "_flag")

    def __init__(self, grad_norm, lr, skipped: bool = False, nonfinite: bool | None = False, *,
                 flag: torch.Tensor | None = None):
        self._norm, self._lr, self._skipped, self._nonfinite, self._flag = grad_norm, lr, skipped, nonfinite, flag

    @property
    def pending(self) -> bool:
        """Values still on the device (reading any of them costs one host read)."""
        return any(torch.is_tensor(v) for v in (self._norm, self._lr, self._flag))

    def _device_values(self) -> list[torch.Tensor]:
        return [v.detach().reshape(-1)[:1].double() for v in (self._norm, self._lr, self._flag) if torch.is_tensor(v)]

    def _settle(self, values: list[float]) -> None:
        it = iter(values)
        if torch.is_tensor(self._norm):
            self._norm = next(it)
        if torch.is_tensor(self._lr):
            self._lr = next(it)
        if self._flag is not None:
            flag, self._flag = next(it), None
            if flag:
                self._skipped = self._nonfinite = True
        if self._nonfinite is None:
            self._nonfinite = bool(self._skipped) and not math.isfinite(self._norm)

    def resolve(self) -> "StepInfo":
        StepInfo.resolve_all([self])
        return self

    @staticmethod
    def resolve_all(infos) -> None:
        """Read the device values of every pending ``info`` in one host read."""
        pending = [i for i in infos if i.pending]
        parts = [i._device_values() for i in pending]
        tensors = [t for p in parts for t in p]
        flat = torch.cat([t.to(tensors[0].device) for t in tensors]).tolist() if tensors else []
        pos = 0
        for info, p in zip(pending, parts):
            info._settle(flat[pos:pos + len(p)])
            pos += len(p)
        for info in infos:
            if info._nonfinite is None:
                info._settle([])

    @property
    def grad_norm(self) -> float:
        if torch.is_tensor(self._norm):
            self.resolve()
        return float(self._norm)

    @property
    def lr(self) -> float:
        if self.pending:
            self.resolve()
        return float(self._lr)

    @property
    def skipped(self) -> bool:
        if self.pending or self._nonfinite is None:
            self.resolve()
        return bool(self._skipped)

    @property
    def nonfinite(self) -> bool:
        if self.pending or self._nonfinite is None:
            self.resolve()
        return bool(self._nonfinite)

    def __repr__(self) -> str:
        if self.pending:
            return "StepInfo(pending)"
        return f"StepInfo(grad_norm={self._norm}, lr={self._lr}, skipped={self._skipped}, nonfinite={self._nonfinite})"


def min_loss_scale_error(scale: float) -> ScaletrainError:
    """The one line every backend stops with when fp16's dynamic loss scale cannot go lower."""
    return ScaletrainError(
        f"fp16 loss scale reached its minimum ({scale:g}): the gradients overflow at every scale, so no update "
        "can be applied; use engine.precision=bf16 or fp32 (or a lower optim.lr) and re-run to resume from the "
        "last checkpoint")


MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state per parameter, besides its step count


@dataclass
class WholeState:
    """An optimizer's state with every tensor whole, by parameter name: what a checkpoint written at one
    layout hands an engine at another (``scaletrain.checkpoint.reshard``). ``masters``: fp32 master weights
    where the optimizer keeps its own copy (DeepSpeed's ZeRO-1/2/3; empty where the module's weights are the
    masters); ``moments``: name -> {"exp_avg": t, "exp_avg_sq": t}; ``step``: AdamW's update count (its
    bias correction), None before the first update."""

    masters: dict
    moments: dict
    step: int | None


def step_like(old, step: int | None, p: torch.Tensor, group: dict):
    """AdamW's ``step`` entry for ``step`` updates: the kind ``old`` is (tensor, dtype, device), else the kind
    torch's AdamW makes for ``p`` in ``group`` (on the parameter's device where fused or capturable)."""
    n = float(step or 0)
    if torch.is_tensor(old):
        return torch.full_like(old, n)
    on_device = group.get("fused") or group.get("capturable")
    return torch.tensor(n, dtype=torch.float32, device=p.device if on_device else "cpu")


def init_adam_state(optimizer: torch.optim.Optimizer, step: int | None, params: list | None = None) -> None:
    """AdamW's state present for every parameter it steps (``params``: those, where a library swaps them into
    the groups only for the step: ZeRO-3's flat partitions), zero moments where none exist yet (before the
    first update), with ``step`` as the update count."""
    pairs = ([(p, g) for g in optimizer.param_groups for p in g["params"]] if params is None
             else [(p, optimizer.param_groups[0]) for p in params])
    for p, g in pairs:
        st = optimizer.state[p]
        for k in MOMENTS:
            if k not in st:
                st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["step"] = step_like(st.get("step"), step, p, g)


class Backend(ABC):
    """What one library does for the :class:`Engine`; everything else is the engine's.

    :meth:`start` (before the model exists) sets ``rank``, ``world_size``, ``local_rank``, ``device`` and the
    library's settings (``ds_config``, ``zero_stage``); :meth:`wrap` builds the optimizer inside the expert
    set-up and wraps the model: ``model`` (what is called), ``module`` (the unwrapped model). Flags the
    engine's step reads: ``norm_is_ours`` (the engine measures, clips and checks the reduced gradient; False
    where the library's optimizer does: DeepSpeed's fp16/bf16/ZeRO optimizers), ``loss_scaled`` (fp16 loss
    scaling: the engine unscales first and the library skips overflows), ``reduces_dense`` (the library
    averages the dense gradients; False under expert parallelism at DeepSpeed ZeRO-0, where the engine does),
    ``native_checkpoint`` (the library writes its own checkpoint files: DeepSpeed's ZeRO partitions),
    ``withholds_on_device`` (the library's optimizer withholds a non-finite update on the device and reports
    its flag: DeepSpeed's ZeRO optimizers through ``deepspeed_internals.ZeroNormHook``)."""

    name = ""
    rank, world_size, local_rank = 0, 1, 0
    device = torch.device("cpu")
    ds_config: dict | None = None
    zero_stage = 0
    norm_is_ours, loss_scaled, reduces_dense, native_checkpoint = True, False, True, False
    withholds_on_device = False  # the library's own optimizer withholds a non-finite update on the device
    model: torch.nn.Module
    module: torch.nn.Module

    @abstractmethod
    def start(self, cfg) -> None:
        """Start (or join) the distributed run: the rank's CPU threads first (``env.configure_threads``: the
        precision probe of ``preflight`` runs on them), the process group, this rank's device."""

    @abstractmethod
    def wrap(self, model: torch.nn.Module, ep: ExpertParallelGrads, cfg) -> torch.optim.Optimizer:
        """Build the optimizer (``optim.build_optimizer``) and wrap the model; returns the optimizer."""

    def forward(self, src, tgt_in, src_padded: bool = True):
        return self.model(src, tgt_in, src_padded=src_padded)

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch (the library averages over ranks and accumulation steps)."""

    @abstractmethod
    def at_boundary(self) -> bool:
        """The next ``step`` is an update (grad_accum micro-batches ran)."""

    @abstractmethod
    def skip_microsteps(self, n: int) -> None:
        """A micro-batch raised: leave its accumulation context; count ``n`` more micro-batches as run."""

    def unscale(self) -> None:
        """fp16: the gradients divided by the loss scale (before the engine reduces, measures and clips)."""

    @abstractmethod
    def update(self) -> tuple[bool, torch.Tensor | None]:
        """The optimizer step at the boundary, gradients zeroed after; (the library skipped it: an fp16
        overflow, the device flag of an update withheld inside the library's optimizer or None)."""

    @abstractmethod
    def skip_update(self) -> None:
        """The boundary without an update: gradients dropped, the library's counters advanced."""

    def reported_norm(self):
        """The library's global gradient norm of the last update (where ``norm_is_ours`` is False)."""
        return float("nan")

    def loss_scale(self) -> float | None:
        return None

    def partitioned(self) -> bool:
        """The library partitions the parameters (ZeRO-3)."""
        return False

    def gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model where the library partitions it (collective)."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """The library's own state besides model and optimizer (fp16's loss scaler)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def whole_state(self, optimizer, named: dict[str, torch.nn.Parameter]) -> WholeState:
        """This rank's optimizer state made whole, by parameter name (``named``: the module's trainable
        parameters in the optimizer's order). Plain torch optimizers (Accelerate DDP, DeepSpeed ZeRO-0) hold
        whole parameters already; the ZeRO optimizers override (collective there)."""
        state, masters, moments, step = optimizer.state, {}, {}, None
        for name, p in named.items():
            st = state.get(p, {})
            moments[name] = {k: v.detach().float().cpu().clone() for k, v in st.items() if k in MOMENTS}
            if "step" in st:
                step = int(st["step"])
        return WholeState(masters, moments, step)

    def load_whole(self, optimizer, named: dict[str, torch.nn.Parameter], whole: WholeState) -> None:
        """Put ``whole`` (every tensor whole, by name) into this layout's optimizer; the module's weights are
        already loaded. The default: torch's optimizer state on whole parameters."""
        init_adam_state(optimizer, whole.step)
        for name, p in named.items():
            st = optimizer.state[p]
            for k, v in (whole.moments.get(name) or {}).items():
                st[k].copy_(v.reshape(p.shape))

    def save_native(self, path: Path) -> None:
        raise NotImplementedError(f"{type(self).__name__} writes no checkpoint files of its own")

    def load_native(self, path: Path) -> None:
        raise NotImplementedError(f"{type(self).__name__} reads no checkpoint files of its own")

    def load_module(self, module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
        """Whole weights into the module (every rank; copied into its own dtype and device)."""
        with torch.no_grad():
            module.load_state_dict(weights, strict=True)


class Engine:
    """The run's engine (see the module docstring). Built by ``scaletrain.engine.build_engine(cfg)``; the
    constructor starts the distributed run through ``backend`` and makes ``parallel`` (collective: every
    rank builds its engine at the same point); :meth:`setup` wraps the model."""

    def __init__(self, cfg, backend: Backend):
        self.cfg, self.backend = cfg, backend
        backend.start(cfg)
        self.local_rank, self.device = backend.local_rank, backend.device
        self.parallel: ParallelContext = ParallelDims.from_config(cfg, backend.world_size).build(backend.rank)
        self.clip_norm = float(cfg.optim.clip_norm)
        self.grad_accum = int(cfg.engine.grad_accum)
        self.ep: ExpertParallelGrads | None = None
        self.optimizer: torch.optim.Optimizer | None = None  # ours (AdamW), whoever wraps it
        self.schedule: UpdateSchedule | None = None
        self._device_skip = False
        self._expert_parallel = False
        self._cudagraphs = False
        self._abandoned = False

    # ---- who and where -------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.parallel.rank

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def is_main(self) -> bool:
        return self.parallel.rank == 0

    @property
    def ds_config(self) -> dict | None:
        """The DeepSpeed config the library is given (None without DeepSpeed)."""
        return self.backend.ds_config

    @property
    def zero_stage(self) -> int:
        """DeepSpeed's ZeRO stage (0 where nothing is partitioned by DeepSpeed)."""
        return self.backend.zero_stage

    @property
    def module(self) -> torch.nn.Module:
        """The unwrapped model."""
        return self.backend.module

    def layout(self) -> dict:
        """How this run lays the model out (recorded with each checkpoint: ``engine.json``)."""
        return {"backend": self.backend.name, "zero_stage": self.zero_stage, "world_size": self.world_size,
                "ep_size": self.parallel.ep_size, "precision": self.cfg.engine.precision}

    # ---- set-up -------------------------------------------------------------------------------------------
    def setup(self, model: torch.nn.Module) -> None:
        """Apply the scale knobs (``model_prep``), build the optimizer and the LR schedule, wrap the model."""
        model = prepare_model(model, self.cfg)
        self.ep = ExpertParallelGrads(model, self.parallel)
        b = self.backend
        self.optimizer = b.wrap(model, self.ep, self.cfg)
        self.device = b.device
        self._cudagraphs = uses_cudagraphs(self.cfg)
        # the reduced gradient's norm, clipping and non-finite check on the device, the fused AdamW withholding
        # a non-finite update itself: wherever the norm is ours, no loss scaler decides and no expert reduction
        # (it reads the norm on the host) comes first
        self._expert_parallel = self.ep.active  # fixed for the run: the step reads it without asking again
        self._device_skip = (b.norm_is_ours and not b.loss_scaled and not self._expert_parallel
                             and can_skip_on_device(self.optimizer))
        o = self.cfg.optim
        self.schedule = UpdateSchedule(self.optimizer, o.lr, o.warmup_steps, o.warmup_init_lr)
        if self._device_skip or b.withholds_on_device:
            self.schedule.on_device(self.device)

    # ---- the step API --------------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> None:
        """Training (dropout on) or evaluation mode of the wrapped model."""
        self.backend.model.train(mode)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, src_padded: bool = True) -> torch.Tensor:
        """The wrapped model's logits. ``src_padded=False`` promises that ``src`` holds no PAD (the batch's
        host-side count, ``Batch.src_padded``): the model then attends without a key-padding mask
        (``Transformer.encode``; FlashAttention on CUDA). Under ``engine.compile`` each value is a graph of
        its own (two at most)."""
        if self._cudagraphs and self.module.training and torch.is_grad_enabled():
            # CUDA graphs: a new iteration starts, so the previous one's graph outputs (consumed by then: loss
            # sums are copied, backward has run) may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        return self.backend.forward(src, tgt_in, src_padded)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch; the loss is already scaled for the global normalisation."""
        self.backend.backward(loss)

    def abandon_step(self, failed: int) -> None:
        """Micro-batch ``failed`` (0-based) of this step raised (out of memory, ``train.on_oom=skip``) and the
        step's later micro-batches will not run: realign the accumulation counters so that the next
        ``step()`` is the update, and make that update change nothing (parameters, optimizer state, LR
        schedule); the gradients are dropped."""
        self.backend.skip_microsteps(self.grad_accum - 1 - failed)
        self._abandoned = True

    def step(self) -> StepInfo:
        """The update, after ``grad_accum`` micro-batches. A non-finite gradient is never applied: where the
        norm is ours and no loss scaler decides, the fused AdamW withholds it on the device (the flag is read
        with the step's other values on the next log step) or, with another optimizer or under expert
        parallelism, the norm is read here; fp16's scalers and DeepSpeed's ZeRO optimizers decide
        themselves (the ZeRO ones on the device too, ``deepspeed_internals.ZeroNormHook``)."""
        b = self.backend
        if not b.at_boundary():
            raise RuntimeError(f"step() before the accumulation boundary: call forward/backward engine.grad_accum="
                               f"{self.grad_accum} times per step")
        if self._abandoned:
            self._abandoned = False
            b.skip_update()
            return self._counted(float("nan"), True, nonfinite=False)
        if not b.norm_is_ours:  # DeepSpeed's fp16/bf16/ZeRO optimizers measure, clip and check it
            skipped, flag = b.update()
            norm = b.reported_norm()
            if flag is not None and not skipped:
                return self._counted(norm, flag)
            return self._counted(norm, skipped, nonfinite=False if b.loss_scaled else None)
        norm = self._reduced_norm()
        if self._device_skip:
            flag = nonfinite_flag(norm)
            with withheld_if(self.optimizer, flag):
                b.update()
            return self._counted(norm, flag)
        if not b.loss_scaled:
            norm = float(norm)  # a host read: the reduced gradient's norm, the same on every rank
            if not math.isfinite(norm):
                b.skip_update()
                return self._counted(norm, True, nonfinite=True)
        skipped, _ = b.update()  # fp16: the scaler skips an overflow and lowers its scale
        return self._counted(norm, skipped, nonfinite=False)

    def _reduced_norm(self):
        """The norm of the whole (reduced) gradient, clipped to ``optim.clip_norm``: a device tensor, or a
        number under expert parallelism (the norm counting each expert once is a host value)."""
        self.backend.unscale()
        if self._expert_parallel:
            self.ep.reduce(dense=not self.backend.reduces_dense)
            return self.ep.clip(self.clip_norm)
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = grad_norm(params)
        clip_(params, self.clip_norm, norm)
        return norm

    def _counted(self, norm, withheld, nonfinite: bool | None = False) -> StepInfo:
        """The schedule counts the update unless ``withheld`` (a bool, or the device flag); its report."""
        self.schedule.advance(withheld)
        lr = self.schedule.next_lr()  # a device tensor where the count is on the device: read with the rest
        if torch.is_tensor(withheld):
            return StepInfo(norm, lr, flag=withheld)
        return StepInfo(norm, lr, skipped=bool(withheld), nonfinite=nonfinite if withheld else False)

    @property
    def lr(self) -> float:
        """The learning rate of the next update (one host read where the schedule counts on the device)."""
        return self.schedule.value()

    def loss_scale(self) -> float | None:
        """The current fp16 loss scale; None when no loss scaling is used (fp32, bf16)."""
        return self.backend.loss_scale()

    # ---- the whole model ---------------------------------------------------------------------------------
    def partitioned(self) -> bool:
        """True if this rank holds only a slice of the parameters (ZeRO-3; expert parallelism: its experts),
        so that forward passes are collectives."""
        return self.ep.active or self.backend.partitioned()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters on every rank, fp32 on CPU. Collective where partitioned."""
        if self.ep.active:  # every expert of every layer, gathered over the EP group
            return {k: v.float().cpu().clone() for k, v in consolidate_state_dict(self.module, self.parallel).items()}
        if self.backend.partitioned():
            return self.backend.gathered_state_dict()
        return {k: v.detach().float().cpu().clone() for k, v in self.module.state_dict().items()}

    def inference_module(self, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """The module to decode with on this rank, in eval mode. Collective: call it on every rank.

        Ranks decode different numbers of lines into outputs of different lengths, so they run
        different numbers of forward passes. While every rank holds the full parameters that needs no
        collective: this is ``module`` itself. Under expert parallelism (a rank holds only its
        experts) it is ``module`` wrapped in a ``scaletrain.parallel.lockstep.LockstepDecoder``: the
        experts stay where they are and the ranks join each other's exchanges (with no rows where they
        have nothing to decode); every rank calls its ``finish()`` after its last batch. Under ZeRO-3
        every rank gathers the full weights once into a plain copy made by ``build()`` (one model's
        memory per rank, until the caller drops it). Building the copy does not move the RNG stream.
        """
        self.train(False)
        if not self.partitioned():
            return self.module
        if self.parallel.ep_size > 1:  # experts stay where they are; ranks decode in lock-step (finish() after)
            return LockstepDecoder(self.module, self.parallel)
        sd = self.full_state_dict()
        with torch.random.fork_rng(devices=[]):
            copy = build()
        missing, unexpected = copy.load_state_dict(sd, strict=False)
        missing = [m for m in missing if not m.endswith("_float_tensor")]
        if missing or unexpected:
            raise ScaletrainError(
                f"gathered weights do not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})"
            )
        return copy.to(self.device).eval()

    # ---- state for checkpoints (scaletrain.checkpoint.engine_state writes and reads it) --------------------
    @property
    def native_checkpoint(self) -> bool:
        """The library writes its own checkpoint files (DeepSpeed: ZeRO partitions, its own layout)."""
        return self.backend.native_checkpoint

    def state_dict(self) -> dict:
        """This rank's model (``module``: rank 0's experts and theirs under expert parallelism), optimizer and
        the library's own state (fp16's loss scaler), where the library has no files of its own."""
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                **self.backend.state_dict()}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """What :meth:`state_dict` gave (``strict=False``: keys may be missing from the model's)."""
        self.module.load_state_dict(state["model"], strict=strict)
        self.optimizer.load_state_dict(state["optimizer"])
        self.backend.load_state_dict(state)
        self.schedule.install()  # the optimizer's groups were replaced

    def trainable(self) -> dict[str, torch.nn.Parameter]:
        """The module's trainable parameters by name, in the optimizer's order (``optim.param_groups``)."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return {names[id(p)]: p for g in param_groups(self.module) for p in g["params"]}

    def whole_state(self) -> WholeState:
        """The optimizer's state made whole, by parameter name, on every rank (collective under ZeRO-3 and under
        expert parallelism: every expert gathered over the EP group)."""
        whole = self.backend.whole_state(self.optimizer, self.trainable())
        if self.parallel.ep_size > 1:
            for name, p in sorted(expert_params(self.module).items()):
                if name in whole.masters:
                    whole.masters[name] = gather_expert(p, whole.masters[name], self.parallel)
                m = whole.moments.get(name, {})
                for k in MOMENTS:
                    if k in m:
                        m[k] = gather_expert(p, m[k], self.parallel)
        return whole

    def load_whole(self, model: dict[str, torch.Tensor], whole: WholeState) -> None:
        """Load a checkpoint written at another layout: ``model`` the whole module state dict (fp32), ``whole``
        the optimizer's state by parameter name (``scaletrain.checkpoint.reshard`` reads both from any
        layout's files). Every rank calls it with the same values; each keeps its part."""
        masters = whole.masters or {}
        weights = {k: masters.get(k, v) for k, v in model.items()}  # fp32 masters over 16-bit module weights
        moments = whole.moments
        if self.parallel.ep_size > 1:  # this rank's experts
            weights = shard_state_dict(weights, self.module)
            cut = {k: shard_state_dict({n: m[k] for n, m in moments.items() if k in m}, self.module) for k in MOMENTS}
            moments = {n: {k: cut[k][n] for k in MOMENTS if n in cut[k]} for n in moments}
        self.backend.load_module(self.module, weights)
        self.backend.load_whole(self.optimizer, self.trainable(), WholeState(
            {k: weights[k] for k in self.trainable() if k in weights}, moments, whole.step))
        self.schedule.install()

    def save_native(self, path: Path) -> None:
        """The library's own checkpoint files under ``path`` (collective)."""
        self.backend.save_native(Path(path))

    def load_native(self, path: Path) -> None:
        self.backend.load_native(Path(path))
        self.schedule.install()
