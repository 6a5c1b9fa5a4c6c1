"""The engine seam: the step API every engine hands to a driver (``Driver``).

An engine (``deepspeed_engine.py``, ``accelerate_engine.py``) starts the distributed run, wraps the
model and chooses a driver; everything the loop does with the wrapped model afterwards goes through
that driver, forwarded once, by :class:`DrivenEngine`. Two drivers:

* ``DeepSpeedDriver`` (``deepspeed_driver.py``): one ``deepspeed.DeepSpeedEngine``, whoever built it
  (the native launcher, or Accelerate's DeepSpeed plugin): micro-steps, update, ZeRO-3 gathers,
  DeepSpeed's checkpoint files.
* ``DDPDriver`` (``ddp_driver.py``): Accelerate's DDP wrapper: ``accumulate``/``no_sync``, the
  update with torch's AdamW and GradScaler, Accelerate's ``save_state`` checkpoints.

Both drive expert parallelism with the engine's ``ParallelContext`` (``scaletrain.parallel.grads``).
``Driver`` is a ``typing.Protocol``: the drivers share no code, only this shape (checked in
tests/unit/test_engine_drivers.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from scaletrain.engine.base import Engine, StepInfo


@runtime_checkable
class Driver(Protocol):
    """What an engine forwards to: the step API of one wrapped model."""

    @property
    def module(self) -> torch.nn.Module:
        """The unwrapped model."""

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage (0 where nothing is partitioned by DeepSpeed)."""

    def train(self, mode: bool) -> None:
        """Training (dropout on) or evaluation mode of the wrapped model."""

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, src_padded: bool = True) -> torch.Tensor:
        """One micro-batch's forward through the wrapped model (``Engine.forward``)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch (``Engine.backward``)."""

    def step(self) -> StepInfo:
        """The update at the accumulation boundary (``Engine.step``)."""

    def abandon_step(self, failed: int) -> None:
        """Micro-batch ``failed`` raised: withhold the coming update (``Engine.abandon_step``)."""

    @property
    def lr(self) -> float:
        """The learning rate of the next update."""

    def loss_scale(self) -> float | None:
        """fp16's current loss scale; None without loss scaling."""

    def partitioned(self) -> bool:
        """This rank holds only a slice of the parameters (ZeRO-3, expert parallelism)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters on every rank, fp32 on CPU (collective where partitioned)."""

    def save(self, ckpt_dir: Path, tag: str) -> None:
        """Write model, optimizer and LR schedule state under ckpt_dir/tag (collective)."""

    def load(self, ckpt_dir: Path, tag: str) -> None:
        """Read back what ``save`` wrote (collective)."""


class DrivenEngine(Engine):
    """An ``Engine`` whose step API is its ``driver``'s: a subclass starts the distributed run in its
    constructor and, in ``setup``, wraps the model and sets ``driver``."""

    driver: Driver | None = None

    @property
    def module(self) -> torch.nn.Module:
        return self.driver.module

    @property
    def zero_stage(self) -> int:
        return self.driver.zero_stage if self.driver is not None else 0

    def train(self, mode: bool = True) -> None:
        self.driver.train(mode)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, src_padded: bool = True) -> torch.Tensor:
        return self.driver.forward(src, tgt_in, src_padded)

    def backward(self, loss: torch.Tensor) -> None:
        self.driver.backward(loss)

    def step(self) -> StepInfo:
        return self.driver.step()

    def abandon_step(self, failed: int) -> None:
        self.driver.abandon_step(failed)

    @property
    def lr(self) -> float:
        return self.driver.lr

    def loss_scale(self) -> float | None:
        return self.driver.loss_scale()

    def partitioned(self) -> bool:
        return self.driver.partitioned()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.driver.full_state_dict()

    def save(self, ckpt_dir: Path, tag: str) -> None:
        self.driver.save(ckpt_dir, tag)

    def load(self, ckpt_dir: Path, tag: str) -> None:
        self.driver.load(ckpt_dir, tag)
