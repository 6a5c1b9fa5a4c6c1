"""Examples and batches: the contract between the data stream and the model.

Sequence layout (right padded with PAD):
    src     = [__src__] + bytes(x) + [EOS]
    tgt_in  = [__tgt__] + bytes(y)          (the target-language tag is the decoder's start token)
    tgt_out = bytes(y) + [EOS]
so the tag is always "forced" and never predicted or emitted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from scaletrain.vocab import BYTE_OFFSET, EOS, LANG_OFFSET, PAD


@dataclass(frozen=True)
class Example:
    src_lang: int  # index into the manifest's language list
    tgt_lang: int
    src: bytes  # raw UTF-8 bytes, no tags, no EOS
    tgt: bytes


def src_len(ex: Example, max_bytes: int | None = None) -> int:
    n = len(ex.src) if max_bytes is None else min(len(ex.src), max_bytes)
    return n + 2  # tag + eos


def tgt_len(ex: Example, max_bytes: int | None = None) -> int:
    n = len(ex.tgt) if max_bytes is None else min(len(ex.tgt), max_bytes)
    return n + 1  # tag (in) / eos (out)


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
    B = len(examples)
    S = max(src_len(e, max_bytes) for e in examples)
    T = max(tgt_len(e, max_bytes) for e in examples)
    if pad_to_multiple > 1:
        S = -(-S // pad_to_multiple) * pad_to_multiple
        T = -(-T // pad_to_multiple) * pad_to_multiple
    src = np.full((B, S), PAD, dtype=np.int64)
    tgt_in = np.full((B, T), PAD, dtype=np.int64)
    tgt_out = np.full((B, T), PAD, dtype=np.int64)
    ns = nt = 0
    for i, e in enumerate(examples):
        s = np.frombuffer(e.src[:max_bytes] if max_bytes else e.src, dtype=np.uint8)
        t = np.frombuffer(e.tgt[:max_bytes] if max_bytes else e.tgt, dtype=np.uint8)
        src[i, 0] = LANG_OFFSET + e.src_lang
        src[i, 1 : 1 + len(s)] = s.astype(np.int64) + BYTE_OFFSET
        src[i, 1 + len(s)] = EOS
        tgt_in[i, 0] = LANG_OFFSET + e.tgt_lang
        tgt_in[i, 1 : 1 + len(t)] = t.astype(np.int64) + BYTE_OFFSET
        tgt_out[i, : len(t)] = t.astype(np.int64) + BYTE_OFFSET
        tgt_out[i, len(t)] = EOS
        ns += len(s) + 2
        nt += len(t) + 1
    return Batch(
        torch.from_numpy(src),
        torch.from_numpy(tgt_in),
        torch.from_numpy(tgt_out),
        torch.tensor([e.src_lang for e in examples], dtype=torch.int64),
        torch.tensor([e.tgt_lang for e in examples], dtype=torch.int64),
        ns,
        nt,
    )
