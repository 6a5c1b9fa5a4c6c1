"""The Accelerate DDP backend (``engine.backend=accelerate``, ``engine.accelerate=ddp``): what only
Accelerate's DDP does for the :class:`~scaletrain.engine.engine.Engine`.

Start: Accelerate's ``Accelerator`` (``env.start_accelerator``: ``accelerate launch``, the ``deepspeed``
launcher or a plain process). Wrap: ``Accelerator.prepare`` of the model and our AdamW (the LR schedule is the
engine's), inside the expert set-up (``experts.py``: DDP ignores the expert parameters, which the engine
reduces over their own group). Gradient accumulation uses ``Accelerator.accumulate`` (DDP's ``no_sync`` on
the micro-batches before the boundary, the loss divided by the accumulation steps), entered at forward time
(DDP reads ``no_sync`` there) and left after backward. fp16 runs with Accelerate's GradScaler, which skips an
overflowing update and lowers its scale; the minimum is ours (``engine.fp16_min_loss_scale``). The state a
checkpoint holds (model, optimizer, the scaler) is handed to ``scaletrain.checkpoint`` as state dicts.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os

import torch

from scaletrain.engine.engine import Backend, min_loss_scale_error
from scaletrain.engine.netif import choose_socket_ifname
from scaletrain.engine.rendezvous import bounded_start
from scaletrain.engine.env import check_accelerate_launch, configure_threads, start_accelerator
from scaletrain.engine.experts import expert_setup
from scaletrain.engine.optim import build_optimizer
from scaletrain.engine.preflight import preflight


class DDPBackend(Backend):
    """A model and our AdamW prepared by an ``accelerate.Accelerator`` without DeepSpeed."""

    name = "accelerate/ddp"

    def __init__(self):
        self.acc = None
        self.wrapped_optimizer = None  # Accelerate's AcceleratedOptimizer around ours (it runs the GradScaler)
        self.fp16_min_loss_scale = 0.0
        self._ctx: contextlib.ExitStack | None = None  # the accumulation context of the running micro-batch

    def start(self, cfg) -> None:
        check_accelerate_launch(cfg)
        configure_threads(cfg)
        expected = int(os.environ.get("WORLD_SIZE", "1"))
        preflight(cfg, expected)
        for noisy in ("accelerate", "accelerate.checkpointing", "accelerate.accelerator"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        with bounded_start(cfg):  # every peer connected within engine.rendezvous_timeout_s, or one line
            choose_socket_ifname()  # before the process group: the interface that reaches the rendezvous
            self.acc = start_accelerator(cfg, expected)
        self.rank, self.world_size = self.acc.process_index, self.acc.num_processes
        self.local_rank, self.device = self.acc.local_process_index, self.acc.device
        self.fp16_min_loss_scale = float(cfg.engine.fp16_min_loss_scale)

    def wrap(self, model, ep, cfg):
        with expert_setup(model, ep, ddp=True):
            optimizer = build_optimizer(model, cfg)
            self.model, self.wrapped_optimizer = self.acc.prepare(model, optimizer)
        if importlib.util.find_spec("deepspeed") is not None:
            # Accelerate's unwrap_model imports DeepSpeed where it is installed: import it first without the
            # MLflow its autotuner takes (1.4 CPU-s per rank)
            from scaletrain.engine.deepspeed_internals import import_deepspeed

            import_deepspeed()
        self.module = self.acc.unwrap_model(self.model)
        self.loss_scaled = self.acc.scaler is not None
        return optimizer

    def forward(self, src, tgt_in, src_padded: bool = True):
        if self.model.training and torch.is_grad_enabled():
            # DDP reads no_sync at forward time: enter the accumulation context here, leave after backward.
            if self._ctx is not None:
                raise RuntimeError("Engine.forward called twice without backward")
            self._ctx = contextlib.ExitStack()
            self._ctx.enter_context(self.acc.accumulate(self.model))
        return self.model(src, tgt_in, src_padded=src_padded)

    def backward(self, loss) -> None:
        try:
            self.acc.backward(loss)  # divides by gradient_accumulation_steps
        finally:
            self._leave()

    def _leave(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.close()

    def at_boundary(self) -> bool:
        return self.acc.sync_gradients

    def skip_microsteps(self, n: int) -> None:
        self._leave()  # the failed micro-batch's forward entered it
        for _ in range(n):
            with self.acc.accumulate(self.model):
                pass

    def unscale(self) -> None:
        self.acc.unscale_gradients()  # fp16 (GradScaler): the reduction and the norm see true gradients

    def update(self):
        self.wrapped_optimizer.step()
        skipped = bool(self.wrapped_optimizer.step_was_skipped)
        self.wrapped_optimizer.zero_grad(set_to_none=True)
        scaler = self.acc.scaler
        if scaler is not None and skipped and scaler.get_scale() < self.fp16_min_loss_scale:
            raise min_loss_scale_error(scaler.get_scale())  # GradScaler itself has no minimum
        return skipped, None

    def skip_update(self) -> None:
        self.wrapped_optimizer.zero_grad(set_to_none=True)

    def loss_scale(self) -> float | None:
        """fp16: the GradScaler's scale (``get_scale()``, one host sync); else None."""
        scaler = self.acc.scaler
        return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None

    def state_dict(self) -> dict:
        return {"scaler": self.acc.scaler.state_dict()} if self.acc.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.acc.scaler is not None and state.get("scaler") is not None:
            self.acc.scaler.load_state_dict(state["scaler"])
