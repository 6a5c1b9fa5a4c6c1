"""Token-budget batching: which examples go into one batch, for training and for decoding.

Both batchers order the examples by length and cut the order greedily (``greedy_cut``): a batch grows while
``rows * (longest source + longest target)`` stays within the budget and ``rows`` within the row cap (a lone
example always makes a batch).

* Training (``plan_batches``): shuffle, then sort along a Hilbert curve over (source length, target length)
  (stable, so ties stay shuffled: consecutive examples are close in *both* lengths, which a sort by one key
  cannot give when a window mixes scripts and both directions), cut with ``B * (S + T) <= max_tokens`` where S
  and T are the padded source/target lengths (``Batch.padded_tokens``), then shuffle the batch order.
  ``equalise`` splits the largest batches until a slot has the batch count every slot of a window must reach
  (``equalise_tagged``: the same over batches tagged with their slot, when the stream regroups a window's
  batches for another number of slots).
* Decoding (``decode_batches``): longest source first, cut with ``rows * beam * longest source <= budget``
  (the beam-expanded source tokens), at most ``max_sentences`` rows.

Fixed shapes (``pad_to_multiple``, ``max_rows``; config ``data.pad_to_multiple``, ``data.max_rows``): training
batches are padded to lengths that are multiples of ``pad_to_multiple`` (the budget counts the rounded lengths)
and hold at most ``max_rows`` rows, so a compiled or graph-captured step sees at most
``ceil((max_bytes + 2) / m) * ceil((max_bytes + 1) / m)`` (source, target) lengths and ``max_rows`` batch sizes
instead of every length; m = 8 also keeps the GEMM sizes multiples of 8 (tensor cores). The defaults (1, 0) plan
exactly as before.

Written here rather than taken from a library: the plan must be a pure function of the lengths and an RNG
seeded by (seed, epoch, window, slot), so that every rank computes every slot's plan alike without
communication (the stream's equal batch counts and exact resume rest on it), and it runs once per window on
arrays (no Python step per example). numpy only: no torch.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def hilbert_index(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Position of each integer point (x, y) >= 0 along a Hilbert curve (vectorised)."""
    x = np.asarray(x, dtype=np.int64).copy()
    y = np.asarray(y, dtype=np.int64).copy()
    if x.size == 0:
        return np.zeros(0, np.int64)
    n = 1 << max(1, int(max(int(x.max()), int(y.max()))).bit_length())
    d = np.zeros_like(x)
    s = n >> 1
    while s > 0:
        rx = (x & s) > 0
        ry = (y & s) > 0
        d += s * s * ((3 * rx.astype(np.int64)) ^ ry.astype(np.int64))
        low = ~ry
        flip = low & rx
        x = np.where(flip, n - 1 - x, x)
        y = np.where(flip, n - 1 - y, y)
        x, y = np.where(low, y, x), np.where(low, x, y)
        s >>= 1
    return d


def greedy_cut(s: np.ndarray, t: np.ndarray, max_tokens: int, max_rows: int = 0) -> list[int]:
    """Batch boundaries [0, ..., n] of the greedy cut: a batch grows while ``rows * (max s + max t)``
    stays within ``max_tokens`` and ``rows <= max_rows`` (0: no row cap; a lone example always makes
    a batch). Vectorised per batch with running maxima over a doubling look-ahead, instead of a Python
    step per example."""
    n = int(len(s))
    bounds = [0]
    a, k = 0, 64
    while a < n:
        while True:
            e = min(n, a + k)
            rows = np.arange(1, e - a + 1)
            cost = rows * (np.maximum.accumulate(s[a:e]) + np.maximum.accumulate(t[a:e]))
            over = (cost > max_tokens) | (rows > max_rows if max_rows > 0 else False)
            over[0] = False
            j = int(np.argmax(over))
            if j > 0:
                b = a + j
                break
            if e == n:
                b = n
                break
            k *= 2
        bounds.append(b)
        k = max(64, 2 * (b - a))
        a = b
    return bounds


def round_up(n, multiple: int):
    """``n`` (an int or an int array) rounded up to a multiple of ``multiple`` (1: unchanged)."""
    return n if multiple <= 1 else -(-n // multiple) * multiple


def plan_batches(
    src_len: np.ndarray, tgt_len: np.ndarray, max_tokens: int, rng: np.random.Generator | None,
    pad_to_multiple: int = 1, max_rows: int = 0,
) -> list[np.ndarray]:
    """Bucket by length and cut token-budget batches; returns arrays of example indices.

    ``src_len`` / ``tgt_len`` are padded lengths (with tag/EOS). ``rng=None``: no shuffling.
    Examples are ordered along a Hilbert curve over (src, tgt) length, then cut greedily; the budget
    counts the lengths rounded up to ``pad_to_multiple`` (what ``collate`` pads to) and a batch has at
    most ``max_rows`` rows (0: no cap).
    """
    n = int(src_len.shape[0])
    if n == 0:
        return []
    order = rng.permutation(n) if rng is not None else np.arange(n)
    s = src_len[order].astype(np.int64)
    t = tgt_len[order].astype(np.int64)
    key = np.argsort(hilbert_index(s, t), kind="stable")  # stable: ties keep the shuffled order
    order = order[key]
    bounds = greedy_cut(round_up(s[key], pad_to_multiple), round_up(t[key], pad_to_multiple), max_tokens, max_rows)
    batches = [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    if rng is not None:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def equalise(batches: list[np.ndarray], target: int) -> list[np.ndarray]:
    """Split the largest batches (first one on ties) until there are ``target`` batches, if possible."""
    return [b for _, b in equalise_tagged([(None, b) for b in batches], target)]


def equalise_tagged(items: list[tuple], target: int) -> list[tuple]:
    """``equalise`` over ``(tag, batch)`` pairs: both halves of a split batch keep its tag (the stream's tag is
    the batch slot whose examples the batch indexes)."""
    items = list(items)
    while len(items) < target:
        sizes = [len(b) for _, b in items]
        if not sizes or max(sizes) < 2:
            break
        i = int(np.argmax(sizes))
        tag, b = items[i]
        k = len(b) // 2
        items[i : i + 1] = [(tag, b[:k]), (tag, b[k:])]
    return items


def decode_batches(lengths: Sequence[int], batch_tokens: int, beam: int, max_sentences: int | None = None
                   ) -> list[list[int]]:
    """Batches of example indices for beam search: longest source first (ties in index order), each batch's
    padded, beam-expanded source tokens ``rows * beam * longest`` within ``batch_tokens`` and at most
    ``max_sentences`` rows (None: no cap; 0 or less: one row each); a batch always has one row."""
    order = np.array(sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)), dtype=np.int64)
    if order.size == 0:
        return []
    cost = np.asarray(lengths, dtype=np.int64)[order] * beam
    rows = 0 if max_sentences is None else max(1, int(max_sentences))
    bounds = greedy_cut(cost, np.zeros_like(cost), batch_tokens, rows)
    return [order[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
