"""What every vocabulary shares: the special ids, the byte id range, language tags, UTF-8 decoding.

    0..3            specials: pad, bos, eos, unk
    4..259          the 256 byte values (byte b -> id b + 4; SentencePiece's byte-fallback pieces
                    sit at the same ids in a ``SubwordVocab``)

Language tags come after a vocabulary's own ids (``lang_offset``); see ``LanguageTags``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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


def decode_utf8_counting(raw: bytes) -> DecodeResult:
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
