"""The one place that knows the id layout.

    0..3            specials: pad, bos, eos, unk
    4..259          the 256 byte values (byte b -> id b + 4)
    260..260+L-1    language tags ``__xx__`` in the order of the shard manifest

Nothing else in the project hard-codes an id. The subword baseline's vocabulary
(``scaletrain.subword.SubwordVocab``: specials, SentencePiece pieces, then the tags) has the same
interface; ``load_vocab`` builds either from the ``data.tokenizer`` setting.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from scaletrain.errors import ScaletrainError

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
BYTE_OFFSET = len(SPECIALS)
N_BYTES = 256
LANG_OFFSET = BYTE_OFFSET + N_BYTES


@dataclass(frozen=True)
class DecodeResult:
    text: str
    invalid: int  # number of malformed UTF-8 sequences replaced by U+FFFD


def _decode_counting(raw: bytes) -> DecodeResult:
    """UTF-8 decode that replaces each malformed sequence with U+FFFD and counts them.

    Same output as ``raw.decode('utf-8', 'replace')``; the count is what that call hides.
    """
    parts: list[str] = []
    invalid = 0
    pos = 0
    while True:
        try:
            parts.append(raw[pos:].decode("utf-8"))
            break
        except UnicodeDecodeError as e:
            parts.append(raw[pos : pos + e.start].decode("utf-8"))
            parts.append("\ufffd")
            invalid += 1
            pos += e.end
    return DecodeResult("".join(parts), invalid)


class LanguageTags:
    """The language-tag ids every vocabulary shares: one tag per language, in manifest order, from
    ``lang_offset`` (a property of each vocabulary) up to ``size``."""

    pad = PAD
    bos = BOS
    eos = EOS
    unk = UNK
    lang_offset: int

    def _set_langs(self, langs: Sequence[str]) -> None:
        langs = list(langs)
        if len(set(langs)) != len(langs):
            raise ScaletrainError(f"duplicate language codes in vocabulary: {langs}")
        self.langs = langs
        self._lang_index = {code: i for i, code in enumerate(langs)}

    def lang_index(self, code: str) -> int:
        try:
            return self._lang_index[code]
        except KeyError:
            raise ScaletrainError(
                f"unknown language code {code!r}; this vocabulary has: {', '.join(self.langs)}"
            ) from None

    def lang_id(self, code: str) -> int:
        return self.lang_offset + self.lang_index(code)

    def lang_ids(self) -> np.ndarray:
        return np.arange(self.lang_offset, self.lang_offset + len(self.langs), dtype=np.int64)

    def is_lang_id(self, i: int) -> bool:
        return self.lang_offset <= i < self.lang_offset + len(self.langs)

    def lang_of_id(self, i: int) -> str:
        if not self.is_lang_id(i):
            raise ScaletrainError(f"id {i} is not a language tag")
        return self.langs[i - self.lang_offset]


class ByteVocab(LanguageTags):
    """Byte vocabulary with language tags appended in manifest order."""

    kind = "byte"

    def __init__(self, langs: Sequence[str]):
        self._set_langs(langs)

    # ---- sizes and ids -------------------------------------------------------------
    @property
    def size(self) -> int:
        return LANG_OFFSET + len(self.langs)

    def __len__(self) -> int:
        return self.size

    @property
    def lang_offset(self) -> int:
        """Id of the first language tag (tags are ``lang_offset + manifest index``)."""
        return LANG_OFFSET

    def pieces(self) -> list[str]:
        """Surface string of every id (length ``size``): the byte's latin-1 character for byte ids,
        '' for specials and language tags (same interface as ``SubwordVocab.pieces``)."""
        return [""] * BYTE_OFFSET + [chr(b) for b in range(N_BYTES)] + [""] * len(self.langs)


    def token_str(self, i: int) -> str:
        if i < BYTE_OFFSET:
            return SPECIALS[i]
        if i < LANG_OFFSET:
            return f"<0x{i - BYTE_OFFSET:02X}>"
        if i < self.size:
            return f"__{self.langs[i - LANG_OFFSET]}__"
        raise ScaletrainError(f"id {i} is outside the vocabulary (size {self.size})")

    # ---- encoding ------------------------------------------------------------------
    @staticmethod
    def bytes_to_ids(raw: bytes | np.ndarray) -> np.ndarray:
        arr = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, (bytes, bytearray, memoryview)) else raw
        return arr.astype(np.int64) + BYTE_OFFSET

    def encode(self, text: str, add_eos: bool = True) -> list[int]:
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        if add_eos:
            ids.append(EOS)
        return ids

    # ---- decoding ------------------------------------------------------------------
    @staticmethod
    def ids_to_bytes(ids: Iterable[int]) -> bytes:
        """Keep byte ids only, stopping at the first EOS; specials and tags are dropped."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if BYTE_OFFSET <= i < LANG_OFFSET:
                out.append(i - BYTE_OFFSET)
        return bytes(out)

    def decode_counting(self, ids: Iterable[int]) -> DecodeResult:
        return _decode_counting(self.ids_to_bytes(ids))

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_counting(ids).text


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
    from scaletrain.subword import SubwordVocab, find_spm_model

    if model_path is None:
        if shard_dir is None:
            raise ScaletrainError("tokenizer spm needs the SentencePiece model: give model_path or the shard directory "
                                  "whose manifest records it")
        model_path = find_spm_model(shard_dir, vocab_size)
    return SubwordVocab(langs, model_path, num_threads=num_threads)
