"""Model registry: ``cfg.arch`` -> builder ``(cfg, vocab_size, pieces) -> nn.Module``."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from torch import nn

from scaletrain.errors import ScaletrainError
from scaletrain.models.config import ModelConfig

# (config, vocabulary size, the surface string of every id or None) -> model; the config is
# validated before the builder runs (ModelConfig.validate); builders also take ``ffn=`` (the
# feed-forward factory of ``Transformer``, given only when MoE layers are on) and ``parallel=`` (the
# engine's ParallelContext when experts of the architecture's own are to be partitioned,
# ``moe.moce_partition``; None otherwise; architectures without such experts ignore it)
Builder = Callable[[ModelConfig, int, Optional[Sequence[str]]], nn.Module]
_REGISTRY: dict[str, Builder] = {}


def register_model(name: str) -> Callable[[Builder], Builder]:
    """Decorator: ``@register_model("moce") def build(cfg, vocab_size, pieces): ...``"""

    def deco(fn: Builder) -> Builder:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ScaletrainError(f"model architecture {name!r} is registered twice")
        _REGISTRY[name] = fn
        return fn

    return deco


def available_models() -> list[str]:
    return sorted(_REGISTRY)


def builder(arch: str) -> Builder:
    """The builder registered under ``arch``; ScaletrainError naming ``model.arch`` otherwise."""
    if arch not in _REGISTRY:
        raise ScaletrainError(
            f"model.arch: unknown architecture {arch!r}; choose one of: {', '.join(available_models())}"
        )
    return _REGISTRY[arch]
