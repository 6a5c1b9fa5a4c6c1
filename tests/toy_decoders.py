"""Toy models for decoding tests whose logits depend only on the fed tokens and the step: the encoder
output keeps only the number of rows and there is no cache. Subclasses define ``decode_step``."""
from __future__ import annotations

from torch import nn


class Rows:
    """An encoder output that is only a row count (what ``generate`` selects and expands)."""

    def __init__(self, n: int):
        self.n = n

    def index_select(self, index):
        return Rows(index.numel())


class LogitsOnly(nn.Module):
    max_positions = 256

    def encode(self, src):
        return Rows(src.shape[0])

    def reorder_cache(self, cache, index):
        return None
