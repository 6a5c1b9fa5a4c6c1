"""``build_model``: validate a ``ModelConfig`` and run the builder registered for its arch."""
from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from scaletrain.models import convattn as _convattn  # noqa: F401  (registers msc, msha, moce)
from scaletrain.models import lobef as _lobef  # noqa: F401  (registers byte_ncf, byte_wsf)
from scaletrain.models.config import ModelConfig, MoEConfig
from scaletrain.models.embeddings import make_embeddings
from scaletrain.models.moe import moe_ffn_factory
from scaletrain.models.registry import builder, register_model
from scaletrain.models.transformer import Transformer
from scaletrain.parallel import ParallelContext


@register_model("transformer")
def build_transformer(cfg: ModelConfig, vocab_size: int, pieces: Optional[Sequence[str]] = None, ffn=None,
                      parallel=None) -> Transformer:
    return Transformer(cfg, vocab_size, embeddings=make_embeddings(cfg, vocab_size, pieces), ffn=ffn)


def build_model(cfg: ModelConfig, vocab_size: int, pieces: Optional[Sequence[str]] = None,
                moe: Optional[MoEConfig] = None, parallel: Optional[ParallelContext] = None) -> nn.Module:
    """Validate ``cfg`` and build the architecture registered under ``cfg.arch``.

    ``pieces``: the surface string of every id ('' for specials and language tags), required by
    ``embedding=charaware`` (the SentencePiece vocabulary provides it) and ignored otherwise.
    Everything the model needs comes from the arguments: ``model.kernels`` is stored on its modules,
    so models built with different configs do not affect each other.

    ``moe``: the run's ``moe`` section (sparse MoE feed-forward layers, ``scaletrain.models.moe``;
    None or ``num_experts: 0`` = the dense model); ``parallel``: this rank's ``ParallelContext``, the
    engine's ``Engine.parallel`` (which experts it holds: the expert-parallel size comes from it
    alone; None = a single process holding every expert). MoCE's conv experts are partitioned only
    with ``moe.moce_partition`` (``scaletrain.models.moce_ep``)."""
    build = builder(cfg.arch)
    cfg.validate(vocab_size)
    if moe is not None:
        moe.validate(cfg)
    # every builder takes ``parallel``; those with experts of their own (MoCE) partition them with it
    own = parallel if moe is not None and moe.moce_partition else None
    if moe is None or not moe.enabled():
        return build(cfg, vocab_size, pieces, parallel=own)
    return build(cfg, vocab_size, pieces, ffn=moe_ffn_factory(cfg, moe, parallel), parallel=own)
