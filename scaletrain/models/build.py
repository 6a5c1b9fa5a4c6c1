"""``build_model``: validate a ``ModelConfig`` and run the builder registered for its arch."""
from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from scaletrain.models import convattn as _convattn  # noqa: F401  (registers msc, msha, moce)
from scaletrain.models import lobef as _lobef  # noqa: F401  (registers byte_ncf, byte_wsf)
from scaletrain.models.config import ModelConfig
from scaletrain.models.embeddings import make_embeddings
from scaletrain.models.registry import builder, register_model
from scaletrain.models.transformer import Transformer


@register_model("transformer")
def build_transformer(cfg: ModelConfig, vocab_size: int, pieces: Optional[Sequence[str]] = None) -> Transformer:
    return Transformer(cfg, vocab_size, embeddings=make_embeddings(cfg, vocab_size, pieces))


def build_model(cfg: ModelConfig, vocab_size: int, pieces: Optional[Sequence[str]] = None) -> nn.Module:
    """Validate ``cfg`` and build the architecture registered under ``cfg.arch``.

    ``pieces``: the surface string of every id ('' for specials and language tags), required by
    ``embedding=charaware`` (the SentencePiece vocabulary provides it) and ignored otherwise.
    Everything the model needs comes from the arguments: ``model.kernels`` is stored on its modules,
    so models built with different configs do not affect each other."""
    build = builder(cfg.arch)
    cfg.validate(vocab_size)
    return build(cfg, vocab_size, pieces)
