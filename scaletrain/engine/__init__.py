"""Engines: one interface, a DeepSpeed and an Accelerate implementation, driven by one loop."""
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
