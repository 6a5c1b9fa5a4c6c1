"""``ByteVocab``: the byte-level vocabulary (specials, the 256 bytes, then the language tags).

    0..3            specials: pad, bos, eos, unk
    4..259          the 256 byte values (byte b -> id b + 4)
    260..260+L-1    language tags ``__xx__`` in the order of the shard manifest
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from scaletrain.errors import ScaletrainError
from scaletrain.vocab.base import (
    BYTE_OFFSET,
    EOS,
    LANG_OFFSET,
    N_BYTES,
    SPECIALS,
    DecodeResult,
    LanguageTags,
    decode_utf8_counting,
)


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
        return decode_utf8_counting(self.ids_to_bytes(ids))

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_counting(ids).text
