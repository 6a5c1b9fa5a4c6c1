"""The training stream: shards -> token-budget batches, split across ranks, exactly resumable.

How an epoch is laid out (every rank computes the same plan, no communication needed):

1. The split's blocks (all shards, manifest order) are permuted with an RNG seeded by
   ``(seed, epoch)``. Ranks split the data at *block* granularity, whatever the number of shards.
2. The permuted list is cut into ``ceil(n_blocks / (buffer_size * world_size))`` *windows* of
   (nearly) equal numbers of blocks (so no small tail window); inside a window the blocks are
   dealt to ranks biggest first, each to the rank with the fewest examples so far (equal-size
   blocks go round robin), so example counts stay balanced.
3. Each rank reads its own blocks fully, and only the length arrays (first ``12 + 12 n`` bytes) of
   the other ranks' blocks. For every rank of the window it computes the same batch plan:
   shuffle the examples (RNG seeded by ``(seed, epoch, window, rank)``), sort them along a Hilbert
   curve over (source length, target length) (stable, so ties stay shuffled: consecutive examples
   are close in *both* lengths, which a sort by one key cannot give when a window mixes scripts
   and both directions), cut greedy batches with ``B * (S + T) <= max_tokens`` where S and T are
   the padded source/target lengths (``Batch.padded_tokens``), then shuffle the batch order.
4. Equal batch counts: every rank of a window ends with ``max`` of the counts. A rank with fewer
   batches splits its largest batches in two (halves still fit the budget, no example is lost or
   repeated). Only when a rank has fewer examples than the target count (a split with fewer
   blocks than ranks, or ``buffer_size=1``) are batches repeated (its own, else those of the first
   rank with data); those repeats are the only duplicates an epoch can contain. With ``drop_last=True`` every rank
   instead keeps ``min`` of the counts and drops its surplus batches.
5. State is ``(epoch, window, batch index within the window)``; resume re-plans one window.

Language-pair temperature (``temperature=T``): direction d with n_d examples is drawn with
probability p_d ∝ n_d^(1/T). Each example of d is repeated ``w_d = p_d N / n_d`` times in
expectation (stochastic rounding, RNG seeded by ``(seed, epoch, window, rank)``), so an epoch still
holds about N examples: low-resource directions are upsampled, high-resource ones subsampled
(different examples each epoch). T=1 (default) reads every example exactly once per epoch.

DataLoader workers (``ShardLoader``): each (rank, worker) is one slot of a stream with
``world_size * num_workers`` slots; the state records every worker's position, so resume is exact.

Examples longer than ``max_bytes`` are truncated by ``collate`` (never dropped); ``max_tokens``
must fit one such example: ``max_tokens >= 2 * max_bytes + 3`` (``data.example.token_budget_problem``).

Fixed shapes (``pad_to_multiple``, ``max_rows``; config ``data.pad_to_multiple``, ``data.max_rows``): batches
are padded to lengths that are multiples of ``pad_to_multiple`` (the budget counts the rounded lengths) and
hold at most ``max_rows`` rows, so a compiled or graph-captured step sees at most
``ceil((max_bytes + 2) / m) * ceil((max_bytes + 1) / m)`` (source, target) lengths and ``max_rows`` batch
sizes instead of every length; m = 8 also keeps the GEMM sizes multiples of 8 (tensor cores). The defaults
(1, 0) plan exactly as before, and the stream state records the two only when they are set.

Subword baseline (``vocab=SubwordVocab``): the shards keep raw UTF-8 and each slot's examples are
tokenized once per window (SentencePiece batch encoding); everything above then runs on TOKEN
lengths: buckets, the budget (padded subword tokens of source and target) and truncation
(``max_bytes`` caps tokens per side). The plan of every slot needs the token lengths of every
slot's examples: they come from the lengths files written with the model (``spm<N>.<split>.lengths.npy``,
see ``scaletrain.prepare.spm_train``), so a rank tokenizes only its own blocks (and checks them against those
files); without the files every slot's blocks are tokenized (correct, slower for many slots).
Memory stays one window: the ids of the rank's own examples.

Corrupt blocks (``on_corrupt``): every whole block read is checked against its manifest CRC-32 and its
language ids against the manifest's language table (``read_block``). ``stop`` (default) raises one line
naming shard and member. ``skip`` keeps the plan and drops the bad block's examples from the batches:
the plan of every slot is made from the blocks' length headers, which every rank reads alike (a header
that does not decode counts as an empty block on every rank), so all ranks still agree on the batch
counts; on the rank that owns the block its examples are removed from its batches, and a batch left
empty repeats another batch of that rank in the window (a rank whose whole window is corrupt stops).
Skipped blocks are logged and counted (``skipped_blocks``; in the state, so resumes keep the count).
Shards may live behind a URL or a ``pipe:`` command (``scaletrain.data.sources``, ``fetch`` options).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from scaletrain.data.batch import Batch, collate_arrays
from scaletrain.data.example import Example, token_budget_problem
from scaletrain.data.shards import CorruptShardError, load_manifest, read_block
from scaletrain.data.sources import FetchOptions, is_remote, open_source
from scaletrain.data.spm_models import load_token_lengths
from scaletrain.errors import ScaletrainError
from scaletrain.vocab.base import BYTE_OFFSET, LANG_OFFSET

STATE_VERSION = 1
ON_CORRUPT = ("stop", "skip")
log = logging.getLogger(__name__)
_UNCHECKED_WARNED: set = set()


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
    batches = list(batches)
    while len(batches) < target:
        sizes = [len(b) for b in batches]
        if not sizes or max(sizes) < 2:
            break
        i = int(np.argmax(sizes))
        b = batches[i]
        k = len(b) // 2
        batches[i : i + 1] = [b[:k], b[k:]]
    return batches


class _TokBlock:
    """A block with token ids instead of bytes (subword stream): languages, token lengths, ids.

    ``keep=False`` keeps only the lengths (another slot's block, needed for its batch plan)."""

    def __init__(self, blk, vocab, keep: bool = True):
        n = len(blk)
        self.src_lang, self.tgt_lang = blk.src_lang, blk.tgt_lang
        so, to = blk.src_off.tolist(), blk.tgt_off.tolist()
        sd, td = blk.src_data, blk.tgt_data
        texts = [sd[so[i]:so[i + 1]] for i in range(n)] + [td[to[i]:to[i + 1]] for i in range(n)]
        flat, lens = vocab.encode_flat(texts)
        self.src_len, self.tgt_len = lens[:n], lens[n:]
        k = int(self.src_len.sum())
        self.src_ids = flat[:k] if keep else None
        self.tgt_ids = flat[k:] if keep else None
        self._blk = blk if keep else None

    def __len__(self) -> int:
        return int(self.src_len.shape[0])

    def example(self, i: int) -> Example:
        return self._blk.example(i)


class _Dropped:
    """A corrupt block skipped with ``on_corrupt=skip``: the lengths of its header (what every rank plans
    with; none when the header itself is bad) and no text (``_Pool`` gives its examples length 0 and marks
    them dropped: no batch ever takes them)."""

    dropped = True
    src_data = tgt_data = b""
    src_ids = tgt_ids = np.zeros(0, np.int32)

    def __init__(self, h=None):
        z16, z32 = np.zeros(0, np.uint16), np.zeros(0, np.uint32)
        self.src_lang, self.tgt_lang = (z16, z16) if h is None else (h.src_lang, h.tgt_lang)
        self.src_len, self.tgt_len = (z32, z32) if h is None else (h.src_len, h.tgt_len)

    def set_lengths(self, s, t) -> "_Dropped":
        self.src_len, self.tgt_len = s, t
        return self

    def __len__(self) -> int:
        return int(self.src_len.shape[0])

    def example(self, i: int) -> Example:
        raise AssertionError("an example of a skipped corrupt block was requested")


class _Pool:
    """The examples of one slot's blocks in a window, as flat arrays (for vectorised collate)."""

    def __init__(self, blocks, lang_offset: int = LANG_OFFSET, tokens: bool = False, pad_to_multiple: int = 1):
        self.blocks = blocks
        self.pad_to_multiple = pad_to_multiple
        self.dropped = np.concatenate([np.full(len(b), getattr(b, "dropped", False)) for b in blocks]
                                      ) if blocks else np.zeros(0, bool)
        self.lang_offset = lang_offset
        self.starts = np.cumsum([0] + [len(b) for b in blocks])
        cat = lambda arrs, dt: np.concatenate(arrs).astype(dt, copy=False) if arrs else np.zeros(0, dt)  # noqa: E731
        self.src_lang = cat([b.src_lang for b in blocks], np.int64)
        self.tgt_lang = cat([b.tgt_lang for b in blocks], np.int64)
        # the text lengths within the pool's data (a dropped block has none; its plan lengths come from its header)
        text_len = lambda b, x: np.zeros(len(b), np.int64) if getattr(b, "dropped", False) else x  # noqa: E731
        self.src_len = cat([text_len(b, b.src_len) for b in blocks], np.int64)
        self.tgt_len = cat([text_len(b, b.tgt_len) for b in blocks], np.int64)
        if tokens:  # subword ids, tokenized once per window
            self.src_data = cat([b.src_ids for b in blocks], np.int32)
            self.tgt_data = cat([b.tgt_ids for b in blocks], np.int32)
        else:  # token ids (byte + BYTE_OFFSET) as int16, computed once per window
            self.src_data = np.frombuffer(b"".join(b.src_data for b in blocks), dtype=np.uint8).astype(np.int16)
            self.tgt_data = np.frombuffer(b"".join(b.tgt_data for b in blocks), dtype=np.uint8).astype(np.int16)
            self.src_data += BYTE_OFFSET
            self.tgt_data += BYTE_OFFSET
        self.src_start = np.cumsum(self.src_len) - self.src_len
        self.tgt_start = np.cumsum(self.tgt_len) - self.tgt_len

    def collate(self, idx: np.ndarray, max_bytes: int) -> Batch:
        return collate_arrays(self.src_lang[idx], self.tgt_lang[idx], self.src_data, self.src_start[idx],
                              self.src_len[idx], self.tgt_data, self.tgt_start[idx], self.tgt_len[idx], max_bytes,
                              pad_to_multiple=self.pad_to_multiple, lang_offset=self.lang_offset)

    def examples(self, idx: np.ndarray) -> list[Example]:
        bi = np.searchsorted(self.starts, idx, side="right") - 1
        return [self.blocks[b].example(int(i - self.starts[b])) for b, i in zip(bi.tolist(), idx.tolist())]


@dataclass
class _WindowPlan:
    epoch: int
    window: int
    batches: list  # list of (source slot, index array): the slot's examples they index
    pools: dict  # slot -> _Pool
    skipped: int = 0  # corrupt blocks skipped while making this plan

    def examples(self, item) -> list[Example]:
        slot, idx = item
        return self.pools[slot].examples(idx)

    def batch(self, item, max_bytes: int) -> Batch:
        slot, idx = item
        return self.pools[slot].collate(idx, max_bytes)


def _check_stream_args(rank: int, world_size: int, max_tokens: int, max_bytes: int, buffer_size: int,
                       temperature: float, epochs: int | None, on_corrupt: str = "stop", pad_to_multiple: int = 1,
                       max_rows: int = 0) -> None:
    """Reject ``ShardStream`` settings that cannot work, before any file is read."""
    if pad_to_multiple < 1 or max_rows < 0:
        raise ScaletrainError(f"pad_to_multiple must be >= 1 and max_rows >= 0 (got {pad_to_multiple}, {max_rows})")
    if on_corrupt not in ON_CORRUPT:
        raise ScaletrainError(f"on_corrupt must be stop or skip (got {on_corrupt!r})")
    if world_size < 1 or not (0 <= rank < world_size):
        raise ScaletrainError(f"rank {rank} is not in 0..world_size-1 (world_size={world_size})")
    if max_bytes < 1:
        raise ScaletrainError(f"max_bytes must be >= 1 (got {max_bytes})")
    problem = token_budget_problem(max_tokens, max_bytes, pad_to_multiple=pad_to_multiple)
    if problem:
        raise ScaletrainError(problem)
    if buffer_size < 1:
        raise ScaletrainError(f"buffer_size (blocks per rank and window) must be >= 1 (got {buffer_size})")
    if not temperature > 0:
        raise ScaletrainError(f"temperature must be > 0 (got {temperature}); 1 = natural proportions")
    if epochs is not None and epochs < 0:
        raise ScaletrainError(f"epochs must be >= 0 or None (got {epochs})")


class ShardStream:
    """Iterable of ``Batch`` over one split of a shard directory; see the module doc."""

    def __init__(
        self,
        shard_dir: str | Path,
        split: str = "train",
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        max_tokens: int = 4096,
        max_bytes: int = 256,
        buffer_size: int = 16,
        epochs: int | None = None,
        drop_last: bool = False,
        shuffle: bool = True,
        temperature: float = 1.0,
        vocab=None,
        on_corrupt: str = "stop",
        fetch: FetchOptions | None = None,
        pad_to_multiple: int = 1,
        max_rows: int = 0,
    ):
        _check_stream_args(rank, world_size, max_tokens, max_bytes, buffer_size, temperature, epochs, on_corrupt,
                           pad_to_multiple, max_rows)
        self.shard_dir = shard_dir if is_remote(shard_dir) else Path(shard_dir)
        self.source = open_source(shard_dir, fetch)
        self.manifest = load_manifest(self.source)
        self.on_corrupt = on_corrupt
        self._n_langs = len(self.manifest.languages)
        self._skipped_done = 0  # corrupt blocks skipped in the windows before the current one
        self._plan_skips = 0  # ... while making the current plan
        if not self.manifest.block_checksums and str(shard_dir) not in _UNCHECKED_WARNED:
            _UNCHECKED_WARNED.add(str(shard_dir))
            log.warning("%s: the manifest has no per-block checksums (format < 3): blocks are not verified while "
                        "streaming; re-run `prepare` (or check the shards with `scaletrain data verify`)", shard_dir)
        self.split = split
        info = self.manifest.split(split)
        # the split's blocks as flat arrays (constant memory per block): shard number, block number
        # within the shard, examples
        self._shards = info.shards
        counts = np.array([len(sh.blocks) for sh in info.shards], dtype=np.int64)
        self._b_shard = np.repeat(np.arange(len(counts)), counts)
        self._b_index = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        self._b_n = np.concatenate([sh.blocks.n for sh in info.shards]) if len(counts) else np.zeros(0, np.int64)
        self.n_blocks = int(counts.sum())
        if not self.n_blocks or not int(self._b_n.sum()):
            raise ScaletrainError(f"split {split!r} of {shard_dir} has no examples")
        self.rank, self.world_size = rank, world_size
        self.seed, self.max_tokens, self.max_bytes = seed, max_tokens, max_bytes
        self.buffer_size, self.epochs, self.drop_last, self.shuffle = buffer_size, epochs, drop_last, shuffle
        self.temperature = float(temperature)
        self.pad_to_multiple, self.max_rows = pad_to_multiple, max_rows  # fixed shapes (the module docstring)
        # subword stream: a vocabulary with kind "spm" (ByteVocab / None: the byte stream)
        self.vocab = vocab if vocab is not None and getattr(vocab, "kind", "byte") != "byte" else None
        if vocab is not None and list(vocab.langs) != list(self.manifest.languages):
            raise ScaletrainError(f"the vocabulary's languages {list(vocab.langs)} differ from {shard_dir}'s manifest "
                                  f"{self.manifest.languages}")
        if self.vocab is not None and is_remote(shard_dir):
            raise ScaletrainError(f"data.tokenizer=spm needs a local shard directory (its model and token lengths "
                                  f"files are read beside the shards), not {shard_dir}")
        self.lang_offset = LANG_OFFSET if self.vocab is None else int(self.vocab.lang_offset)
        self._tok_lengths = self._load_token_lengths() if self.vocab is not None else None
        self._b_start = np.cumsum(self._b_n) - self._b_n  # first example of each block within the split
        self._weights = self._direction_weights()
        self.n_windows = -(-self.n_blocks // (buffer_size * world_size))
        self._epoch = self._window = self._batch = 0
        self._plan: _WindowPlan | None = None

    # ---- plan ------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    def _block_order(self, epoch: int) -> np.ndarray:
        n = self.n_blocks
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, 0xB10C]).permutation(n)

    def _slot_blocks(self, epoch: int, window: int) -> list[list[int]]:
        n, nw = self.n_blocks, self.n_windows
        chunk = self._block_order(epoch)[window * n // nw : (window + 1) * n // nw].tolist()
        # balance example counts: biggest block first to the slot with the fewest examples so far
        # (equal-size blocks simply go round robin); ties keep the permuted order, and the slot that
        # wins a tie rotates with the window so no rank systematically gets the extra block
        sizes = self._b_n[chunk].tolist()
        S = self.world_size
        slots: list[list[int]] = [[] for _ in range(S)]
        load = [0] * S
        first = (epoch * nw + window) % S
        for j in sorted(range(len(chunk)), key=lambda j: -sizes[j]):
            s = min(range(S), key=lambda s: (load[s], (s - first) % S))
            slots[s].append(chunk[j])
            load[s] += sizes[j]
        return slots

    def block(self, i: int):
        """(ShardInfo, BlockInfo) of block ``i`` of the split (manifest order)."""
        sh = self._shards[int(self._b_shard[i])]
        return sh, sh.blocks[int(self._b_index[i])]

    def _read(self, block_ids: list[int], lengths_only: bool):
        # headers suffice for the byte stream's lengths, and for the subword one when its lengths file exists
        header = lengths_only and (self.vocab is None or self._tok_lengths is not None)
        blocks = [self._read_one(i, header, lengths_only) for i in block_ids]
        if self.vocab is None:
            return blocks
        if self._tok_lengths is not None:  # token lengths from the lengths file: tokenize own blocks only
            out = []
            for i, b in zip(block_ids, blocks):
                a, n = int(self._b_start[i]), int(self._b_n[i])
                s, t = self._tok_lengths[a:a + n, 0].astype(np.int64), self._tok_lengths[a:a + n, 1].astype(np.int64)
                if isinstance(b, _Dropped):
                    b = b.set_lengths(s, t) if len(b) else b
                elif lengths_only:
                    b.src_len, b.tgt_len = s, t
                else:
                    b = _TokBlock(b, self.vocab)
                    if not (np.array_equal(b.src_len, s) and np.array_equal(b.tgt_len, t)):
                        sh, bi = self.block(i)
                        raise ScaletrainError(
                            f"{self.shard_dir / sh.name} block {bi.key}: token lengths differ from the tokenizer's "
                            "lengths file (another sentencepiece version?); every rank must tokenize alike: "
                            f"re-create the model with `scaletrain data spm {self.shard_dir} --vocab-size "
                            f"{self.vocab.spm_size} --overwrite`"
                        )
                out.append(b)
            return out
        return [b if isinstance(b, _Dropped) else _TokBlock(b, self.vocab, keep=not lengths_only) for b in blocks]

    def _read_one(self, i: int, header: bool, lengths_only: bool):
        """Block ``i`` (its length header only with ``header``); with ``on_corrupt=skip`` a corrupt block is a
        ``_Dropped`` with the lengths of its header, which every rank decodes alike."""
        sh, b = self.block(i)
        try:
            return read_block(self.source, sh, b, lengths_only=header, n_langs=self._n_langs)
        except CorruptShardError as e:
            if self.on_corrupt != "skip":
                raise
            if header:
                return _Dropped()  # the header is bad: every rank plans this block as empty
            if not lengths_only:  # this slot's own block: count it (other slots' owners count theirs)
                self._plan_skips += 1
                log.warning("skipping a corrupt block (data.on_corrupt=skip): %s", e)
            try:
                return _Dropped(read_block(self.source, sh, b, lengths_only=True, n_langs=self._n_langs))
            except CorruptShardError:
                return _Dropped()

    def _load_token_lengths(self):
        """The split's per-example (source, target) token lengths [n, 2] (memory-mapped), or None."""
        return load_token_lengths(self.shard_dir, self.manifest, self.vocab, self.split)

    def _lengths(self, blocks) -> tuple[np.ndarray, np.ndarray]:
        if not blocks:
            z = np.zeros(0, np.int64)
            return z, z
        mb = self.max_bytes
        s = np.concatenate([np.minimum(b.src_len.astype(np.int64), mb) + 2 for b in blocks])
        t = np.concatenate([np.minimum(b.tgt_len.astype(np.int64), mb) + 1 for b in blocks])
        return s, t

    def _slot_rng(self, epoch: int, window: int, slot: int):
        return np.random.default_rng([self.seed, epoch, window, slot]) if self.shuffle else None

    def _direction_weights(self) -> np.ndarray | None:
        """Per-example repeat weight of each direction (index src * L + tgt): p_d * N / n_d."""
        if self.temperature == 1.0:
            return None
        langs = self.manifest.languages
        L = len(langs)
        index = {f"{a}-{b}": i * L + j for i, a in enumerate(langs) for j, b in enumerate(langs)}
        dirs = {index[k]: v.n for k, v in self.manifest.split(self.split).directions.items() if v.n > 0}
        keys = np.array(sorted(dirs))
        n = np.array([dirs[k] for k in keys], dtype=np.float64)
        p = n ** (1.0 / self.temperature)
        p /= p.sum()
        w = np.zeros(L * L)
        w[keys] = p * n.sum() / n
        return w

    def _slot_batches(self, blocks, epoch: int, window: int, slot: int) -> list[np.ndarray]:
        """Batch plan of one slot: arrays of indices into the slot's examples (repeats if upsampled)."""
        s_len, t_len = self._lengths(blocks)
        rng = self._slot_rng(epoch, window, slot)
        shape = dict(pad_to_multiple=self.pad_to_multiple, max_rows=self.max_rows)
        if self._weights is None or not blocks:
            return plan_batches(s_len, t_len, self.max_tokens, rng, **shape)
        L = len(self.manifest.languages)
        d = np.concatenate([b.src_lang.astype(np.int64) * L + b.tgt_lang for b in blocks])
        w = self._weights[d]
        u = np.random.default_rng([self.seed, epoch, window, slot, 0x7E3]).random(len(w))
        reps = np.floor(w).astype(np.int64) + (u < w - np.floor(w))
        idx = np.repeat(np.arange(len(w)), reps)
        return [idx[b] for b in plan_batches(s_len[idx], t_len[idx], self.max_tokens, rng, **shape)]

    def _make_plan(self, epoch: int, window: int) -> _WindowPlan:
        slots = self._slot_blocks(epoch, window)
        me = self.rank
        pools: dict = {}
        plans = []
        self._plan_skips = 0
        tokens = self.vocab is not None
        for s, ids in enumerate(slots):
            blocks = self._read(ids, lengths_only=(s != me))
            if s == me:
                pools[me] = _Pool(blocks, self.lang_offset, tokens, self.pad_to_multiple)
            plans.append(self._slot_batches(blocks, epoch, window, s))
        counts = [len(p) for p in plans]
        target = min(counts) if self.drop_last else max(counts)
        mine = [(me, b) for b in equalise(plans[me], target)[:target]]
        if len(mine) < target:  # fewer examples than batches needed: repeat batches (documented)
            donor = me if plans[me] else next(s for s, p in enumerate(plans) if p)
            if donor not in pools:
                pools[donor] = _Pool(self._read(slots[donor], lengths_only=False), self.lang_offset, tokens,
                                     self.pad_to_multiple)
            src = list(mine) if donor == me else [(donor, b) for b in plans[donor]]
            i = 0
            while len(mine) < target:
                mine.append(src[i % len(src)])
                i += 1
        if any(p.dropped.any() for p in pools.values()):
            mine = self._without_dropped(mine, pools, epoch, window)
        return _WindowPlan(epoch, window, mine, pools, self._plan_skips)

    def _without_dropped(self, mine: list, pools: dict, epoch: int, window: int) -> list:
        """The batches without the examples of skipped blocks; a batch left empty repeats another one of
        this rank's window, so the batch count (agreed by every rank from the headers) does not change."""
        kept = [(s, idx[~pools[s].dropped[idx]]) for s, idx in mine]
        full = [x for x in kept if len(x[1])]
        if mine and not full:
            raise ScaletrainError(f"rank {self.rank}: every example of window {window} of epoch {epoch} of "
                                  f"{self.shard_dir} is in a corrupt block; re-create or re-download the shards")
        return [x if len(x[1]) else full[i % len(full)] for i, x in enumerate(kept)]

    def _get_plan(self) -> _WindowPlan:
        p = self._plan
        if p is None or p.epoch != self._epoch or p.window != self._window:
            p = self._plan = self._make_plan(self._epoch, self._window)
        return p

    # ---- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        """Yield batches from the current state on; finite ``epochs`` end the iteration."""
        empty_windows = 0
        while self.epochs is None or self._epoch < self.epochs:
            plan = self._get_plan()
            if self._batch < len(plan.batches):
                empty_windows = 0
                item = plan.batches[self._batch]
                batch = plan.batch(item, self.max_bytes)
                self._advance(len(plan.batches))
                yield batch
            else:
                empty_windows += 1
                if empty_windows >= self.n_windows:
                    raise ScaletrainError(
                        f"an epoch of split {self.split!r} gives no batches on rank {self.rank} "
                        f"(drop_last with {self.n_blocks} blocks for {self.world_size} ranks?)"
                    )
                self._advance(0)

    @property
    def skipped_blocks(self) -> int:
        """Corrupt blocks this slot skipped so far (``on_corrupt=skip``), the current window's included."""
        p = self._plan
        now = p.skipped if p is not None and (p.epoch, p.window) == (self._epoch, self._window) else 0
        return self._skipped_done + now

    def _advance(self, n_batches: int) -> None:
        self._batch += 1
        if self._batch >= n_batches:
            p = self._plan
            if p is not None and (p.epoch, p.window) == (self._epoch, self._window):
                self._skipped_done += p.skipped
            self._batch = 0
            self._window += 1
            if self._window >= self.n_windows:
                self._window = 0
                self._epoch += 1

    def batches_per_epoch(self, epoch: int | None = None) -> int:
        """Batches every rank yields in ``epoch`` (default: the current one); reads all length arrays."""
        epoch = self._epoch if epoch is None else epoch
        total = 0
        for w in range(self.n_windows):
            counts = []
            for s, ids in enumerate(self._slot_blocks(epoch, w)):
                counts.append(len(self._slot_batches(self._read(ids, lengths_only=True), epoch, w, s)))
            total += min(counts) if self.drop_last else max(counts)
        return total

    # ---- state -------------------------------------------------------------------------------
    def _config(self) -> dict:
        cfg = {
            "split": self.split,
            "world_size": self.world_size,
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "max_bytes": self.max_bytes,
            "buffer_size": self.buffer_size,
            "drop_last": self.drop_last,
            "shuffle": self.shuffle,
            "temperature": self.temperature,
            "n_blocks": self.n_blocks,
        }
        if self.vocab is not None:  # byte streams keep the old state layout
            cfg["tokenizer"] = f"{self.vocab.kind}:{self.vocab.sha256}"
        if self.pad_to_multiple > 1 or self.max_rows:  # likewise: states without them load as before
            cfg.update(pad_to_multiple=self.pad_to_multiple, max_rows=self.max_rows)
        return cfg

    def state_dict(self) -> dict:
        """Small and JSON-able; identical on every rank (ranks move in lockstep) but for the counts of corrupt
        blocks skipped (``skipped_blocks``: in the windows before the current one, what a resume starts from;
        ``skipped_total``: the current window's too)."""
        return {"version": STATE_VERSION, "epoch": self._epoch, "window": self._window, "batch": self._batch,
                "config": self._config(), "skipped_blocks": self._skipped_done, "skipped_total": self.skipped_blocks}

    def load_state_dict(self, state: dict) -> None:
        try:
            version, cfg = state["version"], state["config"]
            epoch, window, batch = int(state["epoch"]), int(state["window"]), int(state["batch"])
        except (KeyError, TypeError, ValueError) as e:
            raise ScaletrainError(f"invalid data-stream state ({type(e).__name__}: {e})") from None
        if version != STATE_VERSION:
            raise ScaletrainError(f"data-stream state version {version}; this scaletrain reads {STATE_VERSION}")
        mine = self._config()
        diff = {k: (cfg.get(k), v) for k, v in mine.items() if cfg.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: saved {a!r} now {b!r}" for k, (a, b) in diff.items())
            raise ScaletrainError(f"cannot resume the data stream exactly, settings changed ({detail})")
        if not (0 <= window < self.n_windows) or batch < 0 or epoch < 0:
            raise ScaletrainError(f"data-stream state out of range: epoch {epoch}, window {window}, batch {batch}")
        self._epoch, self._window, self._batch = epoch, window, batch
        self._skipped_done = int(state.get("skipped_blocks", 0))


# ---------------------------------------------------------------------------------------------
# dataloader workers
# ---------------------------------------------------------------------------------------------
class _SlotDataset(torch.utils.data.IterableDataset):
    """What a DataLoader worker runs: the ShardStream of one virtual slot.

    In a worker process it yields *chunks*: ``(v, base_state, positions [k, 3], packed)`` holding
    consecutive batches of virtual worker ``v`` packed into one flat array, with the stream position
    (epoch, window, batch) after each batch. A chunk ends after the batch whose index within its
    window is ``chunk - 1`` mod ``chunk``, or the window's last batch: every slot has the same number
    of batches per window, so all slots share the same chunk grid and chunks never cross a window
    (or epoch) boundary. One message per chunk
    amortises the per-item cost of the DataLoader (index queue round trip, result queue, pickling
    a tuple of arrays and a state dict) over ``k`` batches. In this process (``num_workers=0``) it
    yields ``(v, state, Batch)`` per batch.
    """

    def __init__(self, loader: "ShardLoader"):
        super().__init__()
        self.args = loader._stream_args
        self.rank, self.world_size, self.nw = loader.rank, loader.world_size, loader.nw
        self.positions, self.next = list(loader._positions), loader._next
        self.chunk = loader._msg

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        i = info.id if info is not None else 0
        v = (self.next + i) % self.nw
        s = ShardStream(*self.args[0], rank=self.rank * self.nw + v, world_size=self.world_size * self.nw,
                        **self.args[1])
        if self.positions[v] is not None:
            s.load_state_dict(self.positions[v])
        if info is None:
            for batch in s:
                yield v, s.state_dict(), batch
            return
        base = s.state_dict()
        it = iter(s)
        batches, pos = [], []
        for batch in it:
            batches.append(batch)
            pos.append((s._epoch, s._window, s._batch, s._skipped_done, s.skipped_blocks))
            if s._batch % self.chunk == 0:  # the next batch starts a chunk (or a window)
                yield v, base, np.asarray(pos, dtype=np.int64), _pack_chunk(batches)
                batches, pos = [], []
        if batches:
            yield v, base, np.asarray(pos, dtype=np.int64), _pack_chunk(batches)


def _identity(x):
    return x


def _pack_chunk(batches: list[Batch]) -> tuple:
    """Batches as one header array ``[k, 6]`` (B, S, T, n_src, n_tgt, 0) and one flat id array (uint16
    when every id fits, else int64) holding each batch's src, tgt_in, tgt_out, src_lang, tgt_lang:
    two arrays to pickle per chunk instead of a tuple of tensors per batch."""
    head = np.array([(b.size, b.src.shape[1], b.tgt_in.shape[1], b.n_src_tokens, b.n_tgt_tokens, 0)
                     for b in batches], dtype=np.int64)
    parts = []
    for b in batches:
        parts += [b.src.numpy().ravel(), b.tgt_in.numpy().ravel(), b.tgt_out.numpy().ravel(), b.src_lang.numpy(),
                  b.tgt_lang.numpy()]
    flat = np.concatenate(parts)
    small = flat.size == 0 or (int(flat.max()) < 65536 and int(flat.min()) >= 0)
    return head, flat.astype(np.uint16) if small else flat


def _pack(b: Batch) -> tuple:
    """One batch in the worker wire format (a chunk of one)."""
    return _pack_chunk([b])


def _unpack(p) -> Batch:
    return p if isinstance(p, Batch) else _unpack_chunk(p)[0]


def _unpack_chunk(packed) -> list[Batch]:
    head, flat = packed
    out, o = [], 0
    for B, S, T, ns, nt, _ in head.tolist():
        arrs = []
        for n, shape in ((B * S, (B, S)), (B * T, (B, T)), (B * T, (B, T)), (B, (B,)), (B, (B,))):
            arrs.append(torch.from_numpy(flat[o:o + n].astype(np.int64).reshape(shape)))
            o += n
        out.append(Batch(*arrs, ns, nt))
    return out


def auto_num_workers(device_type: str, shards, local_ranks: int, cores: int,
                     threads: int | None = None) -> tuple[int, str]:
    """``data.num_workers: auto``: (workers per rank, why). Workers pay where the training process would
    otherwise wait for data that another core (or the network) can prepare meanwhile:

    * remote shards (``http(s)://`` / ``pipe:``): 2, their reads wait on the network, not on a core;
    * an accelerator whose host has spare cores (at least 4 per local rank): 2;
    * a CPU-only host with an idle core per rank beside the training threads (``threads`` torch threads
      per rank, default ``cores // local_ranks``, i.e. none idle): 1. One worker yields exactly the
      in-process batch sequence and state (checkpoints resume either way), takes the data side
      (window reads, CRC checks, planning, collation; ~0.6 ms of worker CPU per batch of the `small`
      model) off the step, and costs the step nothing measurable (``benchmarks/bench_loader_workers.py``
      on the same batches, 2 cores, 1 training thread: step time in-process / 1 worker 1.01 [0.99-1.05]);
      with a slow decode (``--decode-ms 500 --buffer-size 2``) the wait goes from 101 to 0.4 ms per step
      and the step is 1.08x faster. Its one-time cost: the fork, whose first step copies the trainer's
      written pages (copy-on-write: ~1e5 page faults, +0.2-0.25 s for that model); the worker keeps the
      pre-fork copy of those pages.
    * a CPU-only host whose cores all train: 0, a worker would take its cycles from the training threads.
    """
    from scaletrain.data.sources import is_remote

    local = max(1, local_ranks)
    per_rank = cores // local
    if is_remote(shards):
        return 2, "shards are remote: workers overlap the network reads with training"
    if device_type != "cpu" and per_rank >= 4:
        return 2, f"{device_type} training with {per_rank} host cores per rank"
    if device_type == "cpu":
        threads = threads or per_rank
        spare = cores - local * threads
        if spare >= local:
            return 1, f"{spare} core(s) idle beside {local} rank(s) x {threads} training thread(s): one worker per rank"
        return 0, "CPU training uses every core; workers would compete with it"
    return 0, f"only {per_rank} host core(s) per rank"


class ShardLoader:
    """``ShardStream`` served by ``num_workers`` DataLoader worker processes, exactly resumable.

    Each (rank, worker) pair is one slot of a ShardStream with ``world_size * num_workers`` slots,
    so workers split the rank's data at block granularity and every slot yields the same number
    of batches per window. Workers send up to ``chunk`` consecutive batches per DataLoader item
    (chunks follow a per-window grid: batch indices ``[0, chunk)``, ``[chunk, 2 chunk)``, ... of each
    window) and the DataLoader takes items round robin, so the batch order is: a chunk of virtual
    worker 0, the same chunk of worker 1, ...; windows and epochs end at the same point of the
    sequence as with ``chunk=1``. Worker ``i`` plays virtual worker ``(next + i) % num_workers``,
    where ``next`` is the one whose chunk is due (it may be part-way through it), so a resumed loader
    continues the same sequence. The state is each virtual worker's stream position plus ``next``.
    ``num_workers=0`` iterates in this process (same batches as ``ShardStream``).

    Cost: every worker plans the batches of all ``world_size * num_workers`` slots of a window (the
    plans give the equal per-slot batch count without communication), so planning work grows with
    the number of workers; reading and collating the examples does not (each worker reads only its
    own blocks fully). The DataLoader sets one torch thread per worker.
    """

    def __init__(self, shard_dir: str | Path, split: str = "train", *, rank: int = 0, world_size: int = 1,
                 num_workers: int = 0, prefetch_factor: int = 2, chunk: int = 8, **stream_kwargs):
        if num_workers < 0:
            raise ScaletrainError(f"num_workers must be >= 0 (got {num_workers})")
        if chunk < 1:
            raise ScaletrainError(f"chunk (batches per worker message) must be >= 1 (got {chunk})")
        if world_size < 1 or not (0 <= rank < world_size):
            raise ScaletrainError(f"rank {rank} is not in 0..world_size-1 (world_size={world_size})")
        self.rank, self.world_size, self.num_workers = rank, world_size, num_workers
        self.nw = max(1, num_workers)
        self.chunk = chunk if num_workers > 1 else 1  # with 0 or 1 worker the order does not depend on it
        self._msg = chunk  # batches per message from a worker process (at most)
        self.prefetch_factor = prefetch_factor
        self._stream_args = ((shard_dir, split), stream_kwargs)
        # validate the settings here (bad input -> ScaletrainError in the main process)
        ShardStream(shard_dir, split, rank=rank * self.nw, world_size=world_size * self.nw, **stream_kwargs)
        self._positions: list[dict | None] = [None] * self.nw
        self._next = 0

    @property
    def skipped_blocks(self) -> int:
        """Corrupt blocks skipped so far by this rank's worker slots (``on_corrupt=skip``)."""
        return sum(int(p.get("skipped_total", 0)) for p in self._positions if p is not None)

    @property
    def epoch(self) -> int:
        pos = self._positions[self._next]
        return 0 if pos is None else int(pos["epoch"])

    def _advance(self, v: int, pos: dict) -> None:
        self._positions[v] = pos
        if int(pos["batch"]) % self.chunk == 0:  # v's chunk is complete: the next worker's is due
            self._next = (v + 1) % self.nw

    def __iter__(self) -> Iterator[Batch]:
        ds = _SlotDataset(self)
        if self.num_workers == 0:
            for v, pos, batch in ds:
                self._advance(v, pos)
                yield batch
            return
        # A generator of its own: the DataLoader draws its workers' base seed from the generator it is given,
        # by default torch's global one, which would shift dropout's random stream by one draw at every
        # start and resume (a resumed run would not be bitwise the uninterrupted one). The workers use no
        # torch randomness (the stream is seeded by data.seed).
        dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=self.num_workers,
                                         prefetch_factor=self.prefetch_factor, collate_fn=_identity,
                                         generator=torch.Generator().manual_seed(0))
        for v, base, pos, packed in dl:
            for (e, w, b, sd, st), batch in zip(pos.tolist(), _unpack_chunk(packed)):
                self._advance(v, {**base, "epoch": e, "window": w, "batch": b, "skipped_blocks": sd,
                                  "skipped_total": st})
                yield batch

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "num_workers": self.nw, "next": self._next, "chunk": self.chunk,
                "positions": [None if p is None else dict(p) for p in self._positions]}

    def load_state_dict(self, state: dict) -> None:
        try:
            nw, nxt, positions = int(state["num_workers"]), int(state["next"]), list(state["positions"])
            chunk = int(state.get("chunk", 1))  # older states: one batch per worker turn
        except (KeyError, TypeError, ValueError) as e:
            raise ScaletrainError(f"invalid data-loader state ({type(e).__name__}: {e})") from None
        if nw != self.nw or len(positions) != nw or not (0 <= nxt < nw):
            raise ScaletrainError(
                f"cannot resume the data loader exactly: saved with {nw} worker slot(s), now {self.nw}; "
                "use the same data.num_workers as the run that saved the checkpoint"
            )
        if chunk != self.chunk and nw > 1:
            raise ScaletrainError(
                f"cannot resume the data loader exactly: saved with chunk={chunk} batches per worker turn, "
                f"this loader uses chunk={self.chunk}; construct it with chunk={chunk}"
            )
        for v, p in enumerate(positions):  # validates each position against the current settings
            if p is not None:
                (a, kw) = self._stream_args
                ShardStream(*a, rank=self.rank * nw + v, world_size=self.world_size * nw, **kw).load_state_dict(p)
        self._positions, self._next = positions, nxt
