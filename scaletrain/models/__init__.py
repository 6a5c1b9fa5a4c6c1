"""Models: pure ``nn.Module``s built from a ``ModelConfig`` by a small registry.

    model = build_model(cfg, vocab_size)     # cfg.arch selects the builder
    logits = model(src, tgt_in)              # [B,S],[B,T] int64 -> [B,T,V]

Architectures: transformer (+ embedding=onehot for Embeddingless), byte_ncf, byte_wsf, msc, msha, moce.
"""
from __future__ import annotations

from torch import nn

from scaletrain.models import kernels
from scaletrain.models.config import ModelConfig
from scaletrain.models.registry import available_models, check_config, register_model
from scaletrain.models.transformer import (
    DecoderCache,
    EncoderContext,
    EncoderOut,
    SeparateEmbeddings,
    SharedEmbeddings,
    Transformer,
)
from scaletrain.models.onehot import OneHotEmbeddings
from scaletrain.models.stats import count_parameters, estimate_flops_per_token


def make_embeddings(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    """The token representation chosen by ``cfg.embedding`` / ``cfg.share_embeddings``."""
    if cfg.embedding == "onehot":
        return OneHotEmbeddings(
            vocab_size,
            cfg.d_model,
            share_output=cfg.share_embeddings,
            learnable_scales=cfg.onehot_learnable_scales,
            scale=cfg.scale_embeddings,
        )
    cls = SharedEmbeddings if cfg.share_embeddings else SeparateEmbeddings
    return cls(vocab_size, cfg.d_model, cfg.scale_embeddings)


@register_model("transformer")
def _build_transformer(cfg: ModelConfig, vocab_size: int) -> Transformer:
    return Transformer(cfg, vocab_size, embeddings=make_embeddings(cfg, vocab_size))


def build_model(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    """Validate ``cfg`` and build the architecture registered under ``cfg.arch``."""
    from scaletrain.models import registry

    check_config(cfg, vocab_size)
    kernels.configure(cfg.kernels)
    return registry._REGISTRY[cfg.arch](cfg, vocab_size)


# variant modules register their architectures on import
from scaletrain.models import convattn as _convattn  # noqa: E402,F401  (msc, msha, moce)
from scaletrain.models import lobef as _lobef  # noqa: E402,F401  (byte_ncf, byte_wsf)

__all__ = [
    "ModelConfig",
    "Transformer",
    "EncoderOut",
    "EncoderContext",
    "DecoderCache",
    "build_model",
    "register_model",
    "available_models",
    "count_parameters",
    "estimate_flops_per_token",
    "make_embeddings",
]
