"""Models: pure ``nn.Module``s built from a ``ModelConfig`` by a small registry.

    model = build_model(cfg, vocab_size)     # cfg.arch selects the builder
    model = build_model(cfg, vocab_size, pieces)   # embedding=charaware: the subword pieces
    logits = model(src, tgt_in)              # [B,S],[B,T] int64 -> [B,T,V]

Architectures: transformer (+ embedding=onehot for Embeddingless, embedding=charaware for the
character-aware gated decoder), byte_ncf, byte_wsf, msc, msha, moce.
"""
from __future__ import annotations

from contextvars import ContextVar
from typing import Optional, Sequence

from torch import nn

from scaletrain.errors import ScaletrainError
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
from scaletrain.models.charaware import CharAwareEmbeddings
from scaletrain.models.counting import count_parameters, estimate_flops_per_token


# the pieces handed to build_model, visible to make_embeddings inside the architecture builders
# (builders keep their (cfg, vocab_size) signature)
_BUILD_PIECES: ContextVar[Optional[list]] = ContextVar("scaletrain_build_pieces", default=None)


def make_embeddings(cfg: ModelConfig, vocab_size: int, pieces: Optional[Sequence[str]] = None) -> nn.Module:
    """The token representation chosen by ``cfg.embedding`` / ``cfg.share_embeddings``.

    ``pieces`` (embedding=charaware only): the surface string of every id; defaults to the pieces
    given to the enclosing ``build_model`` call."""
    if cfg.embedding == "charaware":
        pieces = _check_pieces(vocab_size, _BUILD_PIECES.get() if pieces is None else pieces)
        return CharAwareEmbeddings(pieces, cfg)
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


def _check_pieces(vocab_size: int, pieces: Optional[Sequence[str]]) -> list:
    if pieces is None:
        raise ScaletrainError(
            "model.embedding=charaware needs the target vocabulary's pieces (the surface string of every "
            "id) to spell the types; the subword vocabulary (SentencePiece, data.tokenizer: spm) provides "
            "them. A byte vocabulary has none: use model.embedding=learned with it"
        )
    pieces = list(pieces)
    if len(pieces) != vocab_size:
        raise ScaletrainError(
            f"model.embedding=charaware: got {len(pieces)} pieces for a vocabulary of {vocab_size} ids; "
            "pass one string per id ('' for specials and language tags)"
        )
    return pieces


def build_model(cfg: ModelConfig, vocab_size: int, pieces: Optional[Sequence[str]] = None) -> nn.Module:
    """Validate ``cfg`` and build the architecture registered under ``cfg.arch``.

    ``pieces``: the surface string of every id ('' for specials and language tags), required by
    ``embedding=charaware`` (the SentencePiece vocabulary provides it) and ignored otherwise."""
    from scaletrain.models import registry

    check_config(cfg, vocab_size)
    if cfg.embedding == "charaware":
        pieces = _check_pieces(vocab_size, pieces)
    else:
        pieces = None
    kernels.configure(cfg.kernels)
    token = _BUILD_PIECES.set(pieces)
    try:
        return registry._REGISTRY[cfg.arch](cfg, vocab_size)
    finally:
        _BUILD_PIECES.reset(token)


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
    "CharAwareEmbeddings",
]
