"""Scale knobs applied to a model before an engine wraps it (activation checkpointing, compile)."""
from __future__ import annotations

import logging
import os

import torch

from scaletrain.errors import ScaletrainError


def _checkpointed(layer: torch.nn.Module):
    from torch.utils.checkpoint import checkpoint

    inner = layer.forward

    def forward(*args, **kwargs):
        if layer.training and torch.is_grad_enabled():
            # non-reentrant: works with keyword arguments and ZeRO-3; dropout RNG is replayed
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)

    return forward


def prepare_model(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """Scale knobs applied before an engine wraps the model (same parameter names either way).

    engine.activation_checkpointing: each encoder and decoder layer keeps only its input and
    recomputes its activations in backward. engine.compile: ``Module.compile()`` in place, so
    state-dict keys (and checkpoints) are unchanged (:func:`compile_on`: auto = on CUDA only), with
    ``engine.compile_mode`` (reduce-overhead: CUDA graphs).
    """
    if cfg.engine.activation_checkpointing:
        n = 0
        for name in ("encoder_layers", "decoder_layers"):
            for layer in getattr(model, name, []) or []:
                layer.forward = _checkpointed(layer)
                n += 1
        if n == 0:
            raise ScaletrainError(
                f"engine.activation_checkpointing: model {type(model).__name__} has no encoder_layers/decoder_layers"
            )
    if compile_on(cfg):
        e = cfg.engine
        if os.environ.get("RANK", "0") == "0":
            logging.getLogger("scaletrain").info("engine.compile %s: torch.compile, backend %s, mode %s", e.compile,
                                                 e.compile_backend, e.compile_mode)
        if e.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
            raise ScaletrainError(f"config key 'engine.compile_backend': unknown torch.compile backend "
                                  f"{e.compile_backend!r}; one of {', '.join(torch._dynamo.list_backends())}")
        if e.compile_backend == "inductor":
            model.compile(mode=None if e.compile_mode == "default" else e.compile_mode)
        else:  # the modes are inductor's
            model.compile(backend=e.compile_backend)
    return model


def compile_on(cfg, cuda: bool | None = None) -> bool:
    """``engine.compile``: true, false, or auto = on where training runs on CUDA (a compiled step there is
    ~2.5x faster, docs/gpu_step.md), off on CPU (compiling a model takes minutes of CPU; the step gains
    little)."""
    c = cfg.engine.compile
    if c == "auto":
        c = torch.cuda.is_available() if cuda is None else cuda
    return bool(c)


def uses_cudagraphs(cfg) -> bool:
    """``engine.compile_mode=reduce-overhead`` on CUDA: inductor replays CUDA graphs."""
    return compile_on(cfg) and cfg.engine.compile_mode == "reduce-overhead" and torch.cuda.is_available()

