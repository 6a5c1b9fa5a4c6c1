"""Models: pure ``nn.Module``s built from a ``ModelConfig`` by a small registry.

    model = build_model(cfg, vocab_size)     # cfg.arch selects the builder
    model = build_model(cfg, vocab_size, pieces)   # embedding=charaware: the subword pieces
    logits = model(src, tgt_in)              # [B,S],[B,T] int64 -> [B,T,V]

Architectures: transformer (+ embedding=onehot for Embeddingless, embedding=charaware for the
character-aware gated decoder), byte_ncf, byte_wsf, msc, msha, moce. The variants' options are
sections of the model config (``model.lobef``, ``model.conv``, ``model.moce``, ``model.onehot``,
``model.charaware``; see ``scaletrain.models.config``).
"""
from __future__ import annotations

from scaletrain.models.build import build_model
from scaletrain.models.charaware import CharAwareEmbeddings
from scaletrain.models.config import ModelConfig
from scaletrain.models.embeddings import make_embeddings
from scaletrain.models.registry import available_models, register_model
from scaletrain.models.counting import count_parameters, estimate_flops_per_token
from scaletrain.models.transformer import DecoderCache, EncoderContext, EncoderOut, Transformer

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
