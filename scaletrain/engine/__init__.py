"""The engine: one class the loop, validation and checkpoints are written against, over one backend per library.

``engine.py``: :class:`Engine` (the step API, written once; its ``parallel``, the one
``ParallelContext`` of ``scaletrain.parallel`` with the run's groups and collectives; the step logic every
library shares) and :class:`Backend` (what a library does: start, wrap, backward, optimizer step, its own
state). ``deepspeed_backend.py`` (a DeepSpeed engine, from DeepSpeed's launcher or Accelerate's plugin) and
``ddp_backend.py`` (Accelerate's DDP); ``deepspeed_internals.py``: every use of DeepSpeed beyond its public
API. ``experts.py``: expert parallelism around the wrapping; ``optim.py``: AdamW, the LR schedule keyed on
applied updates and the non-finite check on the device.

Layer: the only package that imports DeepSpeed besides ``checkpoint/deepspeed_files.py``, which reads its
files (tested); with ``parallel/`` the only one that makes process groups or reads ``moe.ep_size`` (tested).
It imports ``scaletrain.parallel``, ``errors``, ``safeload`` and ``threads``; ``preflight.py`` (the checks
before launch) also reads the config, the data manifest and the tracking store. Never ``train``, ``eval``,
``checkpoint`` or ``models``: the model is given.
"""
from __future__ import annotations

from scaletrain.engine.engine import Backend, Engine, StepInfo, WholeState


def build_engine(cfg) -> Engine:
    """The run's engine with the backend ``engine.backend`` / ``engine.accelerate`` name (starts the run)."""
    if cfg.engine.backend == "deepspeed":
        from scaletrain.engine.deepspeed_backend import DeepSpeedBackend

        return Engine(cfg, DeepSpeedBackend())
    if cfg.engine.backend == "accelerate":
        if cfg.engine.accelerate == "deepspeed":
            from scaletrain.engine.deepspeed_backend import DeepSpeedBackend

            return Engine(cfg, DeepSpeedBackend(accelerate=True))
        from scaletrain.engine.ddp_backend import DDPBackend

        return Engine(cfg, DDPBackend())
    raise ValueError(cfg.engine.backend)


__all__ = ["Backend", "Engine", "StepInfo", "WholeState", "build_engine"]
