"""Examples and batches: the contract between the data stream and the model.

Sequence layout (right padded with PAD):
    src     = [__src__] + bytes(x) + [EOS]
    tgt_in  = [__tgt__] + bytes(y)          (the target-language tag is the decoder's start token)
    tgt_out = bytes(y) + [EOS]
so the tag is always "forced" and never predicted or emitted. ``Example`` (torch-free) lives in
``scaletrain.data.example`` and is re-exported here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from scaletrain.data.example import SRC_EXTRA, TGT_EXTRA, Example
from scaletrain.vocab.base import BYTE_OFFSET, EOS, LANG_OFFSET, PAD

__all__ = ["Batch", "Example", "collate", "collate_arrays", "src_len", "tgt_len"]


def src_len(ex: Example, max_bytes: int | None = None) -> int:
    n = len(ex.src) if max_bytes is None else min(len(ex.src), max_bytes)
    return n + SRC_EXTRA  # tag + eos


def tgt_len(ex: Example, max_bytes: int | None = None) -> int:
    n = len(ex.tgt) if max_bytes is None else min(len(ex.tgt), max_bytes)
    return n + TGT_EXTRA  # tag (in) / eos (out)


@dataclass
class Batch:
    src: torch.Tensor  # [B, S] int64
    tgt_in: torch.Tensor  # [B, T] int64
    tgt_out: torch.Tensor  # [B, T] int64
    src_lang: torch.Tensor  # [B] int64, manifest language index
    tgt_lang: torch.Tensor  # [B]
    n_src_tokens: int  # non-pad source tokens
    n_tgt_tokens: int  # non-pad target tokens (loss denominators)

    @property
    def size(self) -> int:
        return int(self.src.shape[0])

    @property
    def padded_tokens(self) -> int:
        return int(self.src.numel() + self.tgt_in.numel())

    @property
    def src_padded(self) -> bool:
        """Whether any source row has PAD, from the host-side counts (no device read): pass it to the
        model's ``forward(src, tgt_in, src_padded=...)`` so a batch without padding attends without a
        mask (FlashAttention on CUDA)."""
        return self.n_src_tokens < self.src.numel()

    def to(self, device) -> "Batch":
        return Batch(
            self.src.to(device, non_blocking=True),
            self.tgt_in.to(device, non_blocking=True),
            self.tgt_out.to(device, non_blocking=True),
            self.src_lang.to(device),
            self.tgt_lang.to(device),
            self.n_src_tokens,
            self.n_tgt_tokens,
        )


def collate(examples: Sequence[Example], max_bytes: int | None = None, pad_to_multiple: int = 1) -> Batch:
    """Build a right-padded batch; sides longer than ``max_bytes`` are truncated (tags/EOS kept)."""
    if not examples:
        raise ValueError("cannot collate an empty batch")
    src_len = np.fromiter((len(e.src) for e in examples), dtype=np.int64, count=len(examples))
    tgt_len = np.fromiter((len(e.tgt) for e in examples), dtype=np.int64, count=len(examples))
    return collate_arrays(
        np.fromiter((e.src_lang for e in examples), dtype=np.int64, count=len(examples)),
        np.fromiter((e.tgt_lang for e in examples), dtype=np.int64, count=len(examples)),
        np.frombuffer(b"".join(e.src for e in examples), dtype=np.uint8),
        np.cumsum(src_len) - src_len,
        src_len,
        np.frombuffer(b"".join(e.tgt for e in examples), dtype=np.uint8),
        np.cumsum(tgt_len) - tgt_len,
        tgt_len,
        max_bytes,
        pad_to_multiple,
    )


def _scatter_bytes(out: np.ndarray, col0: int, data: np.ndarray, start: np.ndarray, length: np.ndarray) -> None:
    """out[i, col0 : col0 + length[i]] = data[start[i] : start[i] + length[i]] + BYTE_OFFSET, for all rows."""
    total = int(length.sum())
    if total == 0:
        return
    first = np.cumsum(length) - length  # position of each row's first byte in the gathered run
    vals = data[np.arange(total, dtype=np.int64) + np.repeat(start - first, length)]
    if data.dtype == np.uint8:
        vals = vals.astype(np.int64)
        vals += BYTE_OFFSET
    # a boolean mask assigns in row-major order: row 0's bytes, then row 1's, ... (the gathered order)
    out[:, col0 : col0 + int(length.max())][np.arange(int(length.max())) < length[:, None]] = vals


def collate_arrays(
    src_lang: np.ndarray,
    tgt_lang: np.ndarray,
    src_data: np.ndarray,
    src_start: np.ndarray,
    src_len: np.ndarray,
    tgt_data: np.ndarray,
    tgt_start: np.ndarray,
    tgt_len: np.ndarray,
    max_bytes: int | None = None,
    pad_to_multiple: int = 1,
    lang_offset: int = LANG_OFFSET,
) -> Batch:
    """``collate`` from arrays, vectorised over the whole batch (no Python call per example).

    Example ``i`` has language indices ``src_lang[i]`` / ``tgt_lang[i]`` and the bytes
    ``src_data[src_start[i] : src_start[i] + src_len[i]]`` (uint8 arrays; same for the target).
    ``src_data`` / ``tgt_data`` may instead hold token ids already (any integer dtype but uint8:
    byte + ``BYTE_OFFSET``, e.g. int16 precomputed once per window), which saves two passes.
    Gives exactly the batch ``collate`` gives for the same examples. With a subword vocabulary the
    data arrays hold its token ids, ``max_bytes`` caps tokens, and ``lang_offset`` is the vocabulary's
    first tag id (``SubwordVocab.lang_offset``; default the byte layout's).
    """
    B = int(len(src_len))
    if B == 0:
        raise ValueError("cannot collate an empty batch")
    ls = np.asarray(src_len, dtype=np.int64)
    lt = np.asarray(tgt_len, dtype=np.int64)
    if max_bytes:
        ls, lt = np.minimum(ls, max_bytes), np.minimum(lt, max_bytes)
    S = int(ls.max()) + 2
    T = int(lt.max()) + 1
    if pad_to_multiple > 1:
        S = -(-S // pad_to_multiple) * pad_to_multiple
        T = -(-T // pad_to_multiple) * pad_to_multiple
    rows = np.arange(B)
    sl = torch.from_numpy(np.array(src_lang, dtype=np.int64))
    tl = torch.from_numpy(np.array(tgt_lang, dtype=np.int64))
    src = np.full((B, S), PAD, dtype=np.int64)
    src[:, 0] = sl.numpy() + lang_offset
    _scatter_bytes(src, 1, src_data, np.asarray(src_start, dtype=np.int64), ls)
    src[rows, ls + 1] = EOS
    tgt_out = np.full((B, T), PAD, dtype=np.int64)
    _scatter_bytes(tgt_out, 0, tgt_data, np.asarray(tgt_start, dtype=np.int64), lt)
    tgt_out[rows, lt] = EOS
    tgt_in = np.empty((B, T), dtype=np.int64)  # tag, then tgt_out shifted right by one (EOS -> PAD)
    tgt_in[:, 0] = tl.numpy() + lang_offset
    tgt_in[:, 1:] = tgt_out[:, :-1]
    tgt_in[rows[lt + 1 < T], (lt + 1)[lt + 1 < T]] = PAD
    return Batch(
        torch.from_numpy(src),
        torch.from_numpy(tgt_in),
        torch.from_numpy(tgt_out),
        sl,
        tl,
        int((ls + 2).sum()),
        int((lt + 1).sum()),
    )
