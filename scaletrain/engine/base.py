"""The Engine interface the training loop, validation and checkpoints are written against.

Nothing outside ``scaletrain/engine/`` knows whether parameters are partitioned (ZeRO-3) or who
steps the optimizer: the loop calls ``forward``/``backward``/``step``, validation asks for
``inference_module()``, checkpoints call ``save``/``load``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from scaletrain.errors import ScaletrainError
from scaletrain.parallel import ParallelContext, build_parallel_context, model_parallel_context
from scaletrain.parallel.lockstep import LockstepDecoder


@dataclass
class StepInfo:
    grad_norm: float
    lr: float
    skipped: bool = False  # the update was skipped (fp16 overflow, or a non-finite gradient)
    nonfinite: bool = False  # skipped because the gradient was NaN/inf outside fp16 loss scaling (train.nonfinite)


def min_loss_scale_error(scale: float) -> ScaletrainError:
    """The one line both engines stop with when fp16's dynamic loss scale cannot go lower."""
    return ScaletrainError(
        f"fp16 loss scale reached its minimum ({scale:g}): the gradients overflow at every scale, so no update "
        "can be applied; use engine.precision=bf16 or fp32 (or a lower optim.lr) and re-run to resume from the "
        "last checkpoint")


class Engine(ABC):
    """What the loop needs: distributed info, forward/backward/step, collectives, checkpoints."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def parallel_context(self, ep_size: int = 1) -> ParallelContext:
        """This rank's expert-parallel context for the model builder (``moe.ep_size``), built once per
        ep_size; creating the groups is collective when ep_size > 1 (call it on every rank)."""
        cache = self.__dict__.setdefault("_parallel_contexts", {})
        if ep_size not in cache:
            cache[ep_size] = build_parallel_context(ep_size, self.world_size, self.rank)
        return cache[ep_size]

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
    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch; the loss is already scaled for the global normalisation."""

    @abstractmethod
    def step(self) -> StepInfo:
        """Clip, update, advance the LR schedule (after grad_accum micro-batches)."""

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
        ctx = model_parallel_context(self.module)
        if ctx.ep_size > 1:  # experts stay where they are; ranks decode in lock-step (finish() after)
            return LockstepDecoder(self.module, ctx)
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
        t = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            t = t.to(self.comm_device)
            dist.all_reduce(t)
        return [float(x) for x in t.cpu()]

    def broadcast_object(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    @property
    def comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")
