"""``SubwordVocab``: the subword baseline's vocabulary, a SentencePiece BPE model plus language tags.

Id layout (the same interface as ``scaletrain.vocab.ByteVocab``)::

    0..3                  specials: pad, bos, eos, unk (the SentencePiece model is trained with
                          pad_id=0, bos_id=1, eos_id=2, unk_id=3, so its ids ARE ours)
    4..259                the 256 byte-fallback pieces <0x00>..<0xFF> (SentencePiece puts them
                          right after the specials: the same ids ByteVocab gives the bytes)
    260..S-1              the learned pieces (characters, then merges), S = SentencePiece size
    S..S+L-1              language tags ``__xx__`` in manifest order (``lang_offset = S``)

The shards keep raw UTF-8; the model lives next to them (``spm<N>.model``, recorded in the
manifest's ``tokenizers`` list with its sha256: ``scaletrain.data.spm_models``) and the stream
tokenizes on the fly. How the model is trained: ``scaletrain.prepare.spm_train``.
Round trip: ``decode(encode(text)) == text`` for any text, with two exceptions SentencePiece
imposes: U+2581 itself (its whitespace mark) comes back as a space, and invalid UTF-8 (only in
shards prepared with ``--keep-invalid-utf8``) is encoded as U+FFFD.
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from scaletrain.errors import ScaletrainError
from scaletrain.fileio import sha256_bytes
from scaletrain.vocab.base import BOS, EOS, PAD, SPECIALS, UNK, DecodeResult, LanguageTags, decode_utf8_counting

WORD_START = "\u2581"  # SentencePiece's word-start mark


def sentencepiece_module():
    """The ``sentencepiece`` package, imported on first use (a clear error if it is missing)."""
    try:
        import sentencepiece
    except ImportError:  # pragma: no cover - a declared dependency
        raise ScaletrainError("the subword tokenizer needs the sentencepiece package "
                              "(pip install sentencepiece)") from None
    return sentencepiece


class SubwordVocab(LanguageTags):
    """SentencePiece BPE pieces with language tags appended in manifest order (see module doc)."""

    kind = "spm"

    def __init__(self, langs: Sequence[str], model_path: str | Path | None = None, *, num_threads: int = 1,
                 model_proto: bytes | None = None):
        self._set_langs(langs)
        if model_proto is None:
            if model_path is None:
                raise ScaletrainError("SubwordVocab needs a SentencePiece model file")
            try:
                model_proto = Path(model_path).read_bytes()
            except OSError as e:
                raise ScaletrainError(f"cannot read the SentencePiece model {model_path}: {e}") from None
        self.model_path = None if model_path is None else Path(model_path)
        self.num_threads = int(num_threads)
        self.sha256 = sha256_bytes(model_proto)
        self._proto = bytes(model_proto)
        sp = sentencepiece_module().SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(self._proto)
        except (RuntimeError, OSError) as e:
            raise ScaletrainError(f"{model_path or 'model'}: not a SentencePiece model ({e})") from None
        self._sp = sp
        if (sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id()) != (PAD, BOS, EOS, UNK):
            raise ScaletrainError(
                f"{model_path or 'model'}: SentencePiece ids pad/bos/eos/unk are "
                f"{(sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id())}, scaletrain needs (0, 1, 2, 3); "
                "train it with `scaletrain data spm` (or pad_id=0 bos_id=1 eos_id=2 unk_id=3)"
            )
        n = sp.get_piece_size()
        self._spm_size = n
        self._pieces = [sp.id_to_piece(i) for i in range(n)]
        # bytes each id contributes to the decoded text (specials and <unk> contribute none)
        pb: list[bytes] = []
        surface: list[str] = []
        for i, p in enumerate(self._pieces):
            if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
                pb.append(b"")
                surface.append("")
            elif sp.is_byte(i):
                b = int(p[3:5], 16)  # <0xNN>
                pb.append(bytes([b]))
                surface.append(chr(b) if b < 0x80 else "")  # a lone byte >= 0x80 is no character
            else:
                pb.append(p.replace(WORD_START, " ").encode("utf-8"))
                surface.append(p)
        self._piece_bytes = pb
        self._surface = surface
        self.byte_fallback = any(sp.is_byte(i) for i in range(min(n, 4 + 256)))
        self._dummy_prefix = bool(pb and sp.encode("a", out_type=str)[:1] and
                                  sp.encode("a", out_type=str)[0].startswith(WORD_START))

    # ---- pickling (DataLoader workers under spawn) -----------------------------------------------
    def __getstate__(self) -> dict:
        return {"langs": self.langs, "proto": self._proto, "num_threads": self.num_threads,
                "model_path": None if self.model_path is None else str(self.model_path)}

    def __setstate__(self, st: dict) -> None:
        self.__init__(st["langs"], st["model_path"], num_threads=st["num_threads"], model_proto=st["proto"])

    # ---- sizes and ids -------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self._spm_size + len(self.langs)

    def __len__(self) -> int:
        return self.size

    @property
    def lang_offset(self) -> int:
        """Id of the first language tag (= the SentencePiece model's size)."""
        return self._spm_size

    @property
    def spm_size(self) -> int:
        return self._spm_size

    def token_str(self, i: int) -> str:
        if 0 <= i < len(SPECIALS):
            return SPECIALS[i]
        if 0 <= i < self._spm_size:
            return self._pieces[i]
        if self._spm_size <= i < self.size:
            return f"__{self.langs[i - self._spm_size]}__"
        raise ScaletrainError(f"id {i} is outside the vocabulary (size {self.size})")

    def pieces(self) -> list[str]:
        """Surface string of every id (length ``size``), for a character-aware decoder: the piece
        as SentencePiece spells it (word starts keep U+2581), the ASCII character of a byte piece
        below 0x80, and '' for specials, <unk>, byte pieces >= 0x80 (a lone byte of a multi-byte
        character is no character) and language tags."""
        return list(self._surface) + [""] * len(self.langs)

    # ---- encoding ------------------------------------------------------------------------------
    def encode(self, text: str, add_eos: bool = True) -> list[int]:
        ids = list(self._sp.encode(text))
        if add_eos:
            ids.append(EOS)
        return ids

    def encode_batch(self, texts: Sequence[bytes | str]) -> list[np.ndarray]:
        """Token ids of each text (int32 arrays, no tags, no EOS), SentencePiece's batch encoder
        with ``num_threads`` threads."""
        if not texts:
            return []
        return self._sp.encode(list(texts), return_type="numpy", num_threads=self.num_threads)

    def encode_flat(self, texts: Sequence[bytes | str]) -> tuple[np.ndarray, np.ndarray]:
        """``encode_batch`` as one concatenated int32 id array and the int64 lengths."""
        if not texts:
            return np.zeros(0, np.int32), np.zeros(0, np.int64)
        ids = self._sp.encode(list(texts), num_threads=self.num_threads)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
        return flat, lengths

    # ---- decoding ------------------------------------------------------------------------------
    def ids_to_bytes(self, ids: Iterable[int]) -> bytes:
        """UTF-8 bytes of the pieces, stopping at the first EOS; specials, <unk> and tags dropped;
        the word-start mark becomes a space and the sentence's leading (dummy-prefix) space goes."""
        out = bytearray()
        pb, n = self._piece_bytes, self._spm_size
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if 0 <= i < n:
                out += pb[i]
        if self._dummy_prefix and out[:1] == b" ":
            del out[0]
        return bytes(out)

    def decode_counting(self, ids: Iterable[int]) -> DecodeResult:
        """Text and the number of malformed UTF-8 sequences (from byte pieces) replaced by U+FFFD."""
        return decode_utf8_counting(self.ids_to_bytes(ids))

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_counting(ids).text
