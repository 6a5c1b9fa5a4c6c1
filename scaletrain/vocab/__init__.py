"""The one place that knows the id layout: the byte vocabulary and the subword baseline's.

    0..3            specials: pad, bos, eos, unk
    4..259          the 256 byte values (byte b -> id b + 4)
    260..260+L-1    language tags ``__xx__`` in the order of the shard manifest

Nothing else in the project hard-codes an id. The subword baseline's vocabulary
(``SubwordVocab``: specials, SentencePiece pieces, then the tags) has the same interface;
``load_vocab`` builds either from the ``data.tokenizer`` setting and a model file.

Modules: ``base`` (the shared ids, ``LanguageTags``, UTF-8 decoding), ``byte`` (``ByteVocab``),
``subword`` (``SubwordVocab``).

Layer: the bottom of the data side. It imports no other scaletrain package but ``errors`` and ``fileio``
(``tests/unit/test_data_layers.py``) and never torch. Which model belongs to a shard directory is the
manifest's business (``scaletrain.data.spm_models``: ``find_spm_model``, ``load_shard_vocab``); training one is
``scaletrain.prepare.spm_train``.
"""
from __future__ import annotations

from typing import Sequence

from scaletrain.errors import ScaletrainError
from scaletrain.vocab.base import (
    BOS,
    BYTE_OFFSET,
    EOS,
    LANG_OFFSET,
    N_BYTES,
    PAD,
    SPECIALS,
    UNK,
    DecodeResult,
    LanguageTags,
    decode_utf8_counting,
)
from scaletrain.vocab.byte import ByteVocab
from scaletrain.vocab.subword import SubwordVocab

__all__ = [
    "BOS", "BYTE_OFFSET", "EOS", "LANG_OFFSET", "N_BYTES", "PAD", "SPECIALS", "UNK", "TOKENIZERS",
    "ByteVocab", "DecodeResult", "LanguageTags", "SubwordVocab", "decode_utf8_counting", "load_vocab",
]

TOKENIZERS = ("byte", "spm")


def load_vocab(langs: Sequence[str], tokenizer: str = "byte", model_path=None, *, num_threads: int = 1):
    """The vocabulary of a run: ``ByteVocab(langs)`` for ``tokenizer="byte"``; for ``"spm"`` a
    ``SubwordVocab`` with the SentencePiece model file ``model_path`` (the model recorded with a shard
    directory, sha256 checked: ``scaletrain.data.spm_models.load_shard_vocab``)."""
    if tokenizer == "byte":
        return ByteVocab(langs)
    if tokenizer != "spm":
        raise ScaletrainError(f"unknown tokenizer {tokenizer!r} (data.tokenizer): choose one of "
                              f"{', '.join(TOKENIZERS)}")
    if model_path is None:
        raise ScaletrainError("tokenizer spm needs the SentencePiece model: give model_path, or load the one recorded "
                              "with the shards (scaletrain.data.spm_models.load_shard_vocab)")
    return SubwordVocab(langs, model_path, num_threads=num_threads)
