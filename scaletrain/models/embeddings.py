"""The token representation of a model, chosen by ``model.embedding`` (every architecture uses it)."""
from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from scaletrain.errors import ScaletrainError
from scaletrain.models.charaware import CharAwareEmbeddings
from scaletrain.models.config import ModelConfig
from scaletrain.models.onehot import OneHotEmbeddings
from scaletrain.models.transformer import SeparateEmbeddings, SharedEmbeddings


def make_embeddings(cfg: ModelConfig, vocab_size: int, pieces: Optional[Sequence[str]] = None) -> nn.Module:
    """The embeddings chosen by ``cfg.embedding`` / ``cfg.share_embeddings``.

    ``pieces``: the surface string of every id, required by ``embedding=charaware`` and ignored
    otherwise."""
    if cfg.embedding == "charaware":
        return CharAwareEmbeddings(check_pieces(vocab_size, pieces), cfg)
    if cfg.embedding == "onehot":
        return OneHotEmbeddings(
            vocab_size,
            cfg.d_model,
            share_output=cfg.share_embeddings,
            learnable_scales=cfg.onehot.learnable_scales,
            scale=cfg.scale_embeddings,
        )
    cls = SharedEmbeddings if cfg.share_embeddings else SeparateEmbeddings
    return cls(vocab_size, cfg.d_model, cfg.scale_embeddings)


def check_pieces(vocab_size: int, pieces: Optional[Sequence[str]]) -> list:
    """The pieces as a list of one entry per id, or ScaletrainError saying what is missing."""
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
