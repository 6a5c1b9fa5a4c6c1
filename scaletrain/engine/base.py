"""The Engine interface the training loop, validation and checkpoints are written against.

Nothing outside ``scaletrain/engine/`` knows whether parameters are partitioned (ZeRO-3) or who
steps the optimizer: the loop calls ``forward``/``backward``/``step``, validation asks for
``inference_module()``, checkpoints call ``save``/``load``.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from scaletrain.errors import ScaletrainError
from scaletrain.parallel import ParallelContext, ParallelDims
from scaletrain.parallel.lockstep import LockstepDecoder


class StepInfo:
    """What an update reports: the gradient norm, the learning rate after it, whether it was skipped.

    The values may still be on the device (a *pending* update: ``grad_norm`` a tensor, ``flag`` a device
    tensor that is 1 where the update was withheld for a non-finite gradient). Reading ``grad_norm``,
    ``lr``, ``skipped`` or ``nonfinite`` reads them to the host once (``resolve``); the training loop does
    that on log, validation and save steps only, for all pending updates in one read (``resolve_all``),
    so the steps in between never wait for the device. ``on_skip`` (a pending update whose flag turns out
    1) is called once at that read: the engine puts its LR schedule back by one update and returns the
    learning rate now.

    ``skipped``: the update was not applied (an fp16 overflow, or a non-finite gradient); ``nonfinite``:
    skipped because the gradient was NaN/inf outside fp16 loss scaling (``train.nonfinite``). Given as
    None, ``nonfinite`` is ``skipped and the norm is not finite``.
    """

    __slots__ = ("_norm", "_lr", "_skipped", "_nonfinite", "_flag", "_on_skip")

    def __init__(self, grad_norm, lr: float, skipped: bool = False, nonfinite: bool | None = False, *,
                 flag: torch.Tensor | None = None, on_skip: Callable[[], float] | None = None):
        self._norm, self._lr, self._skipped, self._nonfinite = grad_norm, lr, skipped, nonfinite
        self._flag, self._on_skip = flag, on_skip

    @property
    def pending(self) -> bool:
        """Values still on the device (reading any of them costs one host read)."""
        return torch.is_tensor(self._norm) or self._flag is not None

    def _device_values(self) -> list[torch.Tensor]:
        out = []
        if torch.is_tensor(self._norm):
            out.append(self._norm.detach().reshape(-1)[:1].double())
        if self._flag is not None:
            out.append(self._flag.detach().reshape(-1)[:1].double())
        return out

    def _settle(self, values: list[float]) -> None:
        it = iter(values)
        if torch.is_tensor(self._norm):
            self._norm = next(it)
        if self._flag is not None:
            flag, self._flag = next(it), None
            if flag:
                self._skipped = self._nonfinite = True
                if self._on_skip is not None:
                    self._lr = self._on_skip()
        self._on_skip = None
        if self._nonfinite is None:
            self._nonfinite = bool(self._skipped) and not math.isfinite(self._norm)

    def resolve(self) -> "StepInfo":
        StepInfo.resolve_all([self])
        return self

    @staticmethod
    def resolve_all(infos) -> None:
        """Read the device values of every pending ``info`` in one host read, in order (each skipped one
        puts the LR schedule back once)."""
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
        if self._flag is not None:  # a skip puts the schedule back: the value depends on the flag
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
            return f"StepInfo(pending, lr={self._lr})"
        return f"StepInfo(grad_norm={self._norm}, lr={self._lr}, skipped={self._skipped}, nonfinite={self._nonfinite})"


def min_loss_scale_error(scale: float) -> ScaletrainError:
    """The one line both engines stop with when fp16's dynamic loss scale cannot go lower."""
    return ScaletrainError(
        f"fp16 loss scale reached its minimum ({scale:g}): the gradients overflow at every scale, so no update "
        "can be applied; use engine.precision=bf16 or fp32 (or a lower optim.lr) and re-run to resume from the "
        "last checkpoint")


class Engine(ABC):
    """What the loop needs: distributed info, forward/backward/step, collectives, checkpoints.

    ``parallel``: this rank's :class:`~scaletrain.parallel.ParallelContext` (data-parallel,
    expert-parallel and expert-data-parallel groups), built once in the constructor from the config
    (:meth:`build_parallel`) and handed to the model builder, the gradient reduction, the expert
    set-up and decoding."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    parallel: ParallelContext = ParallelContext.single()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def build_parallel(self, cfg) -> ParallelContext:
        """Make ``self.parallel`` for ``cfg`` once the default process group is up and ``rank`` /
        ``world_size`` are set (collective: every rank calls it once)."""
        self.parallel = ParallelDims.from_config(cfg, self.world_size).build(self.rank)
        return self.parallel

    @abstractmethod
    def setup(self, model: torch.nn.Module) -> None:
        """Wrap the model and build optimizer + LR scheduler."""

    @property
    @abstractmethod
    def module(self) -> torch.nn.Module:
        """The unwrapped model."""

    @abstractmethod
    def train(self, mode: bool = True) -> None:
        """Training (dropout on) or evaluation mode of the wrapped model."""

    @abstractmethod
    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, src_padded: bool = True) -> torch.Tensor:
        """The wrapped model's logits. ``src_padded=False`` promises that ``src`` holds no PAD (the batch's
        host-side count, ``Batch.src_padded``): the model then attends without a key-padding mask
        (``Transformer.encode``; FlashAttention on CUDA). Under ``engine.compile`` each value is a graph of
        its own (two at most)."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch; the loss is already scaled for the global normalisation."""

    @abstractmethod
    def step(self) -> StepInfo:
        """Clip, update, advance the LR schedule (after grad_accum micro-batches)."""

    def abandon_step(self, failed: int) -> None:
        """Micro-batch ``failed`` (0-based) of this step raised (out of memory, ``train.on_oom=skip``) and the
        step's later micro-batches will not run: realign the accumulation counters so that the next
        ``step()`` is the update, and make that update change nothing (parameters, optimizer state, LR
        schedule); the gradients are dropped."""
        raise NotImplementedError(f"{type(self).__name__} cannot abandon a step")

    @property
    @abstractmethod
    def lr(self) -> float: ...

    def loss_scale(self) -> float | None:
        """The current fp16 loss scale; None when no loss scaling is used (fp32, bf16)."""
        return None

    @abstractmethod
    def save(self, ckpt_dir: Path, tag: str) -> None:
        """Write model/optimizer/scheduler state under ckpt_dir/tag (collective)."""

    @abstractmethod
    def load(self, ckpt_dir: Path, tag: str) -> None: ...

    # ---- whole-model access (ZeRO-3 engines override partitioned/full_state_dict) --------------
    def partitioned(self) -> bool:
        """True if this rank holds only a slice of the parameters (forward passes are collectives)."""
        return False

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters on every rank, fp32 on CPU. Collective where partitioned."""
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

    # ---- collectives (gloo on CPU, nccl on GPU) -----------------------------------
    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sums over the ranks of a few host numbers (collective). Host tensors on a gloo group: under NCCL a
        side group of gloo (:meth:`host_group`), so the training step's token count and votes never wait
        for the GPU."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(t, group=self.host_group())
        return t.numpy().tolist()  # a host tensor (numpy() refuses a device one)

    def host_group(self):
        """A process group for host (CPU) tensors: the default group where it is gloo, else a gloo group of
        every rank, made on first use (collective: every rank calls this at the same point)."""
        group = self.__dict__.get("_host_group", False)
        if group is False:
            group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            self.__dict__["_host_group"] = group
        return group

    def broadcast_object(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()
