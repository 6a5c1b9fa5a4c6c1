"""Engines: one interface, a DeepSpeed and an Accelerate implementation, driven by one loop.

``base.py``: the ``Engine`` interface the loop, validation and checkpoints are written against.
An engine starts the distributed run (process group, this rank's device, ``Engine.parallel``: the one
``ParallelContext`` of ``scaletrain.parallel``), wraps the model and chooses a driver
(``driver.py``: the ``Driver`` protocol of the step API and ``DrivenEngine``, which forwards it):
``deepspeed_driver.py`` (a DeepSpeed engine, and DeepSpeed's checkpoint files) or ``ddp_driver.py``
(Accelerate's DDP). ``experts.py``: expert parallelism around the wrapping, for both engines.

Layer: the only package that imports DeepSpeed (tested); with ``parallel/`` the only one that makes
process groups or reads ``moe.ep_size`` (tested). It imports ``scaletrain.parallel``, ``errors``,
``safeload`` and ``threads``; ``preflight.py`` (the checks before launch) also reads the config, the
data manifest and the tracking store. Never ``train``, ``eval`` or ``models``: the model is given.
"""
from __future__ import annotations

from scaletrain.engine.base import Engine, StepInfo


def build_engine(cfg) -> Engine:
    if cfg.engine.backend == "deepspeed":
        from scaletrain.engine.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(cfg)
    if cfg.engine.backend == "accelerate":
        from scaletrain.engine.accelerate_engine import AccelerateEngine

        return AccelerateEngine(cfg)
    raise ValueError(cfg.engine.backend)


__all__ = ["Engine", "StepInfo", "build_engine"]
