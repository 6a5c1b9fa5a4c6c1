"""The one place that knows the id layout: the byte vocabulary and the subword baseline's.

    0..3            specials: pad, bos, eos, unk
    4..259          the 256 byte values (byte b -> id b + 4)
    260..260+L-1    language tags ``__xx__`` in the order of the shard manifest

Nothing else in the project hard-codes an id. The subword baseline's vocabulary
(``SubwordVocab``: specials, SentencePiece pieces, then the tags) has the same interface;
``load_vocab`` builds either from the ``data.tokenizer`` setting.

Modules: ``base`` (the shared ids, ``LanguageTags``, UTF-8 decoding), ``byte`` (``ByteVocab``),
``subword`` (``SubwordVocab``). Training a SentencePiece model is the data package's job
(``scaletrain.prepare.spm_train``); the manifest's record of the models is ``scaletrain.data.spm_models``.
"""
from __future__ import annotations

from typing import Sequence

from scaletrain.data.spm_models import find_spm_model
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


def load_vocab(langs: Sequence[str], tokenizer: str = "byte", shard_dir=None, model_path=None, *,
               vocab_size: int = 0, num_threads: int = 1):
    """The vocabulary of a run: ``ByteVocab(langs)`` for ``tokenizer="byte"``; for ``"spm"`` a
    ``SubwordVocab`` with the SentencePiece model ``model_path``, or else the one recorded in
    ``shard_dir``'s manifest (``vocab_size`` picks one when several exist; 0 = the only one; its
    sha256 is checked against the manifest)."""
    if tokenizer == "byte":
        return ByteVocab(langs)
    if tokenizer != "spm":
        raise ScaletrainError(f"unknown tokenizer {tokenizer!r} (data.tokenizer): choose one of "
                              f"{', '.join(TOKENIZERS)}")
    if model_path is None:
        if shard_dir is None:
            raise ScaletrainError("tokenizer spm needs the SentencePiece model: give model_path or the shard directory "
                                  "whose manifest records it")
        model_path = find_spm_model(shard_dir, vocab_size)
    return SubwordVocab(langs, model_path, num_threads=num_threads)
