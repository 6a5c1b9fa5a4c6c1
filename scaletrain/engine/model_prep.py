"""Scale knobs applied to a model before an engine wraps it (activation checkpointing, compile)."""
from __future__ import annotations

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
    state-dict keys (and checkpoints) are unchanged.
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
    if cfg.engine.compile:
        model.compile()
    return model
