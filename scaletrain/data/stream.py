"""The training stream: shards -> token-budget batches, split across ranks, exactly resumable.

How an epoch is laid out (every rank computes the same plan, no communication needed):

1. The split's blocks (all shards, manifest order) are permuted with an RNG seeded by
   ``(seed, epoch)``. Ranks split the data at *block* granularity, whatever the number of shards.
2. The permuted list is cut into ``ceil(n_blocks / (buffer_size * world_size))`` *windows* of
   (nearly) equal numbers of blocks (so no small tail window); inside a window the blocks are
   dealt to ranks biggest first, each to the rank with the fewest examples so far (equal-size
   blocks go round robin), so example counts stay balanced.
3. Each rank reads its own blocks fully, and only the length arrays (first ``12 + 12 n`` bytes) of
   the other ranks' blocks. For every rank of the window it computes the same batch plan
   (``scaletrain.data.batching.plan_batches``: shuffled with an RNG seeded by
   ``(seed, epoch, window, rank)``, ordered along a Hilbert curve over (source length, target length),
   cut greedily with ``B * (S + T) <= max_tokens``, batch order shuffled).
4. Equal batch counts: every rank of a window ends with ``max`` of the counts. A rank with fewer
   batches splits its largest batches in two (halves still fit the budget, no example is lost or
   repeated). Only when a rank has fewer examples than the target count (a split with fewer
   blocks than ranks, or ``buffer_size=1``) are batches repeated (its own, else those of the first
   rank with data); those repeats are the only duplicates an epoch can contain. With ``drop_last=True`` every rank
   instead keeps ``min`` of the counts and drops its surplus batches.
5. State is ``(epoch, window, batch index within the window)``; resume re-plans one window.

The parts: ``SplitBlocks`` (the split's blocks and how one is read: checks, skipping, tokenizing),
``WindowPlanner`` (steps 1-4: which blocks each slot reads in a window and its batches) and
``ShardStream`` (the position of step 5, iteration, the state). ``scaletrain.data.loader.ShardLoader`` serves
a stream from DataLoader worker processes.

Language-pair temperature (``temperature=T``): direction d with n_d examples is drawn with
probability p_d ∝ n_d^(1/T). Each example of d is repeated ``w_d = p_d N / n_d`` times in
expectation (stochastic rounding, RNG seeded by ``(seed, epoch, window, rank)``), so an epoch still
holds about N examples: low-resource directions are upsampled, high-resource ones subsampled
(different examples each epoch). T=1 (default) reads every example exactly once per epoch.

Examples longer than ``max_bytes`` are truncated by ``collate`` (never dropped); ``max_tokens``
must fit one such example: ``max_tokens >= 2 * max_bytes + 3`` (``data.example.token_budget_problem``).

Fixed shapes (``pad_to_multiple``, ``max_rows``; see ``scaletrain.data.batching``): the stream state records
the two only when they are set, so states written without them load as before.

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
from typing import Iterator, NamedTuple

import numpy as np

from scaletrain.data.batch import Batch, collate_arrays
from scaletrain.data.batching import equalise, plan_batches
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


# ---------------------------------------------------------------------------------------------
# the split's blocks and how one is read
# ---------------------------------------------------------------------------------------------
class SplitBlocks:
    """The blocks of one split of a shard directory (manifest order) as flat arrays, constant memory per
    block, and how blocks are read: checked against the manifest (CRC-32, language ids), a corrupt one skipped
    with ``on_corrupt=skip`` (``_Dropped``), tokenized for a subword stream (``_TokBlock``)."""

    def __init__(self, shard_dir: str | Path, split: str, *, vocab=None, on_corrupt: str = "stop",
                 fetch: FetchOptions | None = None):
        self.shard_dir = shard_dir if is_remote(shard_dir) else Path(shard_dir)
        self.source = open_source(shard_dir, fetch)
        self.manifest = load_manifest(self.source)
        self.split, self.on_corrupt = split, on_corrupt
        self._n_langs = len(self.manifest.languages)
        self.skips = 0  # corrupt blocks of this slot skipped since the planner last set it to 0
        if not self.manifest.block_checksums and str(shard_dir) not in _UNCHECKED_WARNED:
            _UNCHECKED_WARNED.add(str(shard_dir))
            log.warning("%s: the manifest has no per-block checksums (format < 3): blocks are not verified while "
                        "streaming; re-run `prepare` (or check the shards with `scaletrain data verify`)", shard_dir)
        info = self.manifest.split(split)
        # per block: shard number, block number within the shard, examples, first example within the split
        self._shards = info.shards
        counts = np.array([len(sh.blocks) for sh in info.shards], dtype=np.int64)
        self._shard_of = np.repeat(np.arange(len(counts)), counts)
        self._index_in_shard = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        self.sizes = np.concatenate([sh.blocks.n for sh in info.shards]) if len(counts) else np.zeros(0, np.int64)
        self.n = int(counts.sum())
        if not self.n or not int(self.sizes.sum()):
            raise ScaletrainError(f"split {split!r} of {shard_dir} has no examples")
        self.starts = np.cumsum(self.sizes) - self.sizes
        self._set_vocab(vocab)

    def _set_vocab(self, vocab) -> None:
        """``vocab`` with kind "spm": the subword stream (``ByteVocab`` / None: the byte stream)."""
        self.vocab = vocab if vocab is not None and getattr(vocab, "kind", "byte") != "byte" else None
        if vocab is not None and list(vocab.langs) != list(self.manifest.languages):
            raise ScaletrainError(f"the vocabulary's languages {list(vocab.langs)} differ from {self.shard_dir}'s "
                                  f"manifest {self.manifest.languages}")
        if self.vocab is not None and is_remote(self.shard_dir):
            raise ScaletrainError(f"data.tokenizer=spm needs a local shard directory (its model and token lengths "
                                  f"files are read beside the shards), not {self.shard_dir}")
        self.lang_offset = LANG_OFFSET if self.vocab is None else int(self.vocab.lang_offset)
        # the split's per-example (source, target) token lengths [n, 2] (memory-mapped), or None
        self.token_lengths = None if self.vocab is None else load_token_lengths(self.shard_dir, self.manifest,
                                                                                self.vocab, self.split)

    def block(self, i: int):
        """(ShardInfo, BlockInfo) of block ``i`` of the split (manifest order)."""
        sh = self._shards[int(self._shard_of[i])]
        return sh, sh.blocks[int(self._index_in_shard[i])]

    def read(self, block_ids: list[int], lengths_only: bool) -> list:
        """The blocks ``block_ids``; ``lengths_only``: another slot's blocks, of which the plan needs only the
        lengths (the byte stream's headers, or the subword stream's token lengths)."""
        # headers suffice for the byte stream's lengths, and for the subword one when its lengths file exists
        header = lengths_only and (self.vocab is None or self.token_lengths is not None)
        blocks = [self._read_one(i, header, lengths_only) for i in block_ids]
        if self.vocab is None:
            return blocks
        if self.token_lengths is not None:  # token lengths from the lengths file: tokenize own blocks only
            return [self._with_file_lengths(i, b, lengths_only) for i, b in zip(block_ids, blocks)]
        return [b if isinstance(b, _Dropped) else _TokBlock(b, self.vocab, keep=not lengths_only) for b in blocks]

    def _with_file_lengths(self, i: int, b, lengths_only: bool):
        """Block ``i`` with the token lengths of the lengths file; a block of this slot tokenized and checked
        against them (every rank must plan with the same lengths)."""
        a, n = int(self.starts[i]), int(self.sizes[i])
        s, t = self.token_lengths[a:a + n, 0].astype(np.int64), self.token_lengths[a:a + n, 1].astype(np.int64)
        if isinstance(b, _Dropped):
            return b.set_lengths(s, t) if len(b) else b
        if lengths_only:
            b.src_len, b.tgt_len = s, t
            return b
        b = _TokBlock(b, self.vocab)
        if not (np.array_equal(b.src_len, s) and np.array_equal(b.tgt_len, t)):
            sh, bi = self.block(i)
            raise ScaletrainError(
                f"{self.shard_dir / sh.name} block {bi.key}: token lengths differ from the tokenizer's "
                "lengths file (another sentencepiece version?); every rank must tokenize alike: "
                f"re-create the model with `scaletrain data spm {self.shard_dir} --vocab-size "
                f"{self.vocab.spm_size} --overwrite`"
            )
        return b

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
                self.skips += 1
                log.warning("skipping a corrupt block (data.on_corrupt=skip): %s", e)
            try:
                return _Dropped(read_block(self.source, sh, b, lengths_only=True, n_langs=self._n_langs))
            except CorruptShardError:
                return _Dropped()


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


# ---------------------------------------------------------------------------------------------
# the plan of a window
# ---------------------------------------------------------------------------------------------
class WindowPlanner:
    """Steps 1-4 of the module doc: the windows of an epoch, the blocks each slot reads in a window, and the
    batches of a slot (length buckets, token budget, direction temperature, equal counts across slots)."""

    def __init__(self, blocks: SplitBlocks, *, world_size: int, seed: int, max_tokens: int, max_bytes: int,
                 buffer_size: int, drop_last: bool, shuffle: bool, temperature: float, pad_to_multiple: int,
                 max_rows: int):
        self.blocks, self.world_size = blocks, world_size
        self.seed, self.max_tokens, self.max_bytes = seed, max_tokens, max_bytes
        self.buffer_size, self.drop_last, self.shuffle = buffer_size, drop_last, shuffle
        self.temperature = float(temperature)
        self.pad_to_multiple, self.max_rows = pad_to_multiple, max_rows  # fixed shapes (scaletrain.data.batching)
        self.weights = self._direction_weights()
        self.n_windows = -(-blocks.n // (buffer_size * world_size))

    def block_order(self, epoch: int) -> np.ndarray:
        n = self.blocks.n
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, 0xB10C]).permutation(n)

    def slot_blocks(self, epoch: int, window: int) -> list[list[int]]:
        """The blocks of each slot in ``window`` of ``epoch`` (block numbers within the split)."""
        n, nw = self.blocks.n, self.n_windows
        chunk = self.block_order(epoch)[window * n // nw : (window + 1) * n // nw].tolist()
        # balance example counts: biggest block first to the slot with the fewest examples so far
        # (equal-size blocks simply go round robin); ties keep the permuted order, and the slot that
        # wins a tie rotates with the window so no rank systematically gets the extra block
        sizes = self.blocks.sizes[chunk].tolist()
        S = self.world_size
        slots: list[list[int]] = [[] for _ in range(S)]
        load = [0] * S
        first = (epoch * nw + window) % S
        for j in sorted(range(len(chunk)), key=lambda j: -sizes[j]):
            s = min(range(S), key=lambda s: (load[s], (s - first) % S))
            slots[s].append(chunk[j])
            load[s] += sizes[j]
        return slots

    def lengths(self, blocks) -> tuple[np.ndarray, np.ndarray]:
        """Padded (source, target) lengths of the blocks' examples, sides truncated to ``max_bytes``."""
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
        m = self.blocks.manifest
        L = len(m.languages)
        index = {f"{a}-{b}": i * L + j for i, a in enumerate(m.languages) for j, b in enumerate(m.languages)}
        dirs = {index[k]: v.n for k, v in m.split(self.blocks.split).directions.items() if v.n > 0}
        keys = np.array(sorted(dirs))
        n = np.array([dirs[k] for k in keys], dtype=np.float64)
        p = n ** (1.0 / self.temperature)
        p /= p.sum()
        w = np.zeros(L * L)
        w[keys] = p * n.sum() / n
        return w

    def slot_batches(self, blocks, epoch: int, window: int, slot: int) -> list[np.ndarray]:
        """Batch plan of one slot: arrays of indices into the slot's examples (repeats if upsampled)."""
        s_len, t_len = self.lengths(blocks)
        rng = self._slot_rng(epoch, window, slot)
        shape = dict(pad_to_multiple=self.pad_to_multiple, max_rows=self.max_rows)
        if self.weights is None or not blocks:
            return plan_batches(s_len, t_len, self.max_tokens, rng, **shape)
        L = len(self.blocks.manifest.languages)
        d = np.concatenate([b.src_lang.astype(np.int64) * L + b.tgt_lang for b in blocks])
        w = self.weights[d]
        u = np.random.default_rng([self.seed, epoch, window, slot, 0x7E3]).random(len(w))
        reps = np.floor(w).astype(np.int64) + (u < w - np.floor(w))
        idx = np.repeat(np.arange(len(w)), reps)
        return [idx[b] for b in plan_batches(s_len[idx], t_len[idx], self.max_tokens, rng, **shape)]

    def plan(self, epoch: int, window: int, me: int) -> _WindowPlan:
        """The batches of slot ``me`` in ``window``: as many as every other slot's (module doc, step 4)."""
        slots = self.slot_blocks(epoch, window)
        pools: dict = {}
        plans = []
        self.blocks.skips = 0
        for s, ids in enumerate(slots):
            blocks = self.blocks.read(ids, lengths_only=(s != me))
            if s == me:
                pools[me] = self._pool(blocks)
            plans.append(self.slot_batches(blocks, epoch, window, s))
        counts = [len(p) for p in plans]
        target = min(counts) if self.drop_last else max(counts)
        mine = [(me, b) for b in equalise(plans[me], target)[:target]]
        if len(mine) < target:  # fewer examples than batches needed: repeat batches (documented)
            donor = me if plans[me] else next(s for s, p in enumerate(plans) if p)
            if donor not in pools:
                pools[donor] = self._pool(self.blocks.read(slots[donor], lengths_only=False))
            src = list(mine) if donor == me else [(donor, b) for b in plans[donor]]
            i = 0
            while len(mine) < target:
                mine.append(src[i % len(src)])
                i += 1
        if any(p.dropped.any() for p in pools.values()):
            mine = self._without_dropped(mine, pools, epoch, window, me)
        return _WindowPlan(epoch, window, mine, pools, self.blocks.skips)

    def _pool(self, blocks) -> _Pool:
        return _Pool(blocks, self.blocks.lang_offset, self.blocks.vocab is not None, self.pad_to_multiple)

    def _without_dropped(self, mine: list, pools: dict, epoch: int, window: int, me: int) -> list:
        """The batches without the examples of skipped blocks; a batch left empty repeats another one of
        this rank's window, so the batch count (agreed by every rank from the headers) does not change."""
        kept = [(s, idx[~pools[s].dropped[idx]]) for s, idx in mine]
        full = [x for x in kept if len(x[1])]
        if mine and not full:
            raise ScaletrainError(f"rank {me}: every example of window {window} of epoch {epoch} of "
                                  f"{self.blocks.shard_dir} is in a corrupt block; re-create or re-download the shards")
        return [x if len(x[1]) else full[i % len(full)] for i, x in enumerate(kept)]

    def batches_per_epoch(self, epoch: int) -> int:
        """Batches every slot yields in ``epoch``; reads all length arrays."""
        total = 0
        for w in range(self.n_windows):
            counts = [len(self.slot_batches(self.blocks.read(ids, lengths_only=True), epoch, w, s))
                      for s, ids in enumerate(self.slot_blocks(epoch, w))]
            total += min(counts) if self.drop_last else max(counts)
        return total


# ---------------------------------------------------------------------------------------------
# the stream
# ---------------------------------------------------------------------------------------------
class Position(NamedTuple):
    """Where a stream is: the next batch is number ``batch`` of ``window`` of ``epoch``; corrupt blocks skipped
    in the windows before (``skipped_done``) and with the current one (``skipped_total``)."""

    epoch: int
    window: int
    batch: int
    skipped_done: int
    skipped_total: int


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
        self.blocks = SplitBlocks(shard_dir, split, vocab=vocab, on_corrupt=on_corrupt, fetch=fetch)
        self.planner = WindowPlanner(self.blocks, world_size=world_size, seed=seed, max_tokens=max_tokens,
                                     max_bytes=max_bytes, buffer_size=buffer_size, drop_last=drop_last,
                                     shuffle=shuffle, temperature=temperature, pad_to_multiple=pad_to_multiple,
                                     max_rows=max_rows)
        self.shard_dir, self.source, self.split = self.blocks.shard_dir, self.blocks.source, split
        self.manifest, self.n_blocks, self.n_windows = self.blocks.manifest, self.blocks.n, self.planner.n_windows
        self.vocab = self.blocks.vocab  # a SubwordVocab, or None: the byte stream
        self.rank, self.world_size, self.epochs = rank, world_size, epochs
        self._epoch = self._window = self._batch = 0
        self._skipped_done = 0  # corrupt blocks skipped in the windows before the current one
        self._plan: _WindowPlan | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    def block(self, i: int):
        """(ShardInfo, BlockInfo) of block ``i`` of the split (manifest order)."""
        return self.blocks.block(i)

    def _get_plan(self) -> _WindowPlan:
        p = self._plan
        if p is None or p.epoch != self._epoch or p.window != self._window:
            p = self._plan = self.planner.plan(self._epoch, self._window, self.rank)
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
                batch = plan.batch(item, self.planner.max_bytes)
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

    def position(self) -> Position:
        """The stream's position (what ``state_dict`` records of it), as numbers."""
        return Position(self._epoch, self._window, self._batch, self._skipped_done, self.skipped_blocks)

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
        return self.planner.batches_per_epoch(self._epoch if epoch is None else epoch)

    # ---- state -------------------------------------------------------------------------------
    def _config(self) -> dict:
        p = self.planner
        cfg = {
            "split": self.split,
            "world_size": self.world_size,
            "seed": p.seed,
            "max_tokens": p.max_tokens,
            "max_bytes": p.max_bytes,
            "buffer_size": p.buffer_size,
            "drop_last": p.drop_last,
            "shuffle": p.shuffle,
            "temperature": p.temperature,
            "n_blocks": self.n_blocks,
        }
        if self.vocab is not None:  # byte streams keep the old state layout
            cfg["tokenizer"] = f"{self.vocab.kind}:{self.vocab.sha256}"
        if p.pad_to_multiple > 1 or p.max_rows:  # likewise: states without them load as before
            cfg.update(pad_to_multiple=p.pad_to_multiple, max_rows=p.max_rows)
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
