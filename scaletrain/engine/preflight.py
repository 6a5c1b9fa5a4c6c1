"""Checks that must pass before any process is launched: one clear message, nothing started.

    python -m scaletrain.engine.preflight --config small engine.precision=fp16 ...
    python -m scaletrain.engine.preflight --config small --print-precision   # what auto resolves to here

runs the same checks the engines run at start-up (``launch.sh`` calls it before the launcher).
"""
from __future__ import annotations

import argparse
import sys

import torch

from scaletrain.errors import ScaletrainError


def uses_deepspeed(cfg) -> bool:
    return cfg.engine.backend == "deepspeed" or (cfg.engine.backend == "accelerate" and cfg.engine.accelerate == "deepspeed")


def preflight(cfg, world_size: int = 1, cuda_available: bool | None = None, precision_hw: dict | None = None) -> dict | None:
    """Raise ScaletrainError for a configuration that cannot run here; return the resolved DeepSpeed
    config (or None for plain DDP).

    Resolves ``engine.precision: auto`` in ``cfg`` first (:mod:`scaletrain.engine.precision`;
    ``precision_hw`` injects the hardware facts in tests), so the DeepSpeed config and Accelerate's
    mixed precision get the resolved value."""
    from scaletrain.engine.ds_config import load_ds_config
    from scaletrain.engine.precision import apply_precision

    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    apply_precision(cfg, cuda=cuda, **(precision_hw or {}))
    if cfg.engine.precision == "fp16" and not cuda:
        raise ScaletrainError(
            "config key 'engine.precision': fp16 needs a GPU (dynamic loss scaling runs on CUDA) and none is visible; "
            "use engine.precision=bf16 (CPU and recent GPUs) or fp32"
        )
    if world_size < 1:
        raise ScaletrainError(f"world size must be >= 1, got {world_size}")
    if uses_deepspeed(cfg):
        return load_ds_config(cfg, world_size)
    return None


def main(argv: list[str] | None = None) -> int:
    from scaletrain.config import load_config

    ap = argparse.ArgumentParser(prog="python -m scaletrain.engine.preflight")
    ap.add_argument("--config", default="small")
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--print-precision", action="store_true",
                    help="print the resolved engine.precision on stdout (launch.sh exports it to every rank)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        preflight(cfg, args.world_size)
    except ScaletrainError as e:
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return 2
    if args.print_precision:
        print(cfg.engine.precision)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
