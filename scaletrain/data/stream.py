"""The training stream: shards -> token-budget batches in *batch slots*, split across ranks, exactly resumable.

An update reads one batch from each of ``slots = data-parallel size x grad_accum`` batch slots; slot ``s`` is
micro-batch ``s % grad_accum`` of data-parallel rank ``s // grad_accum``. Everything below is planned per slot
from ``(seed, epoch, slots)`` alone, so how the slots are spread over ranks (2 ranks x 1 micro-batch or 1 rank
x 2) does not change which examples form which update. How an epoch is laid out (every rank computes the same
plan, no communication needed):

1. The split's blocks (all shards, manifest order) are permuted with an RNG seeded by
   ``(seed, epoch)``. Slots split the data at *block* granularity, whatever the number of shards.
2. The permuted list is cut into ``ceil(n_blocks / (buffer_size * slots))`` *windows* of
   (nearly) equal numbers of blocks (so no small tail window); inside a window the blocks are
   dealt to slots biggest first, each to the slot with the fewest examples so far (equal-size
   blocks go round robin), so example counts stay balanced.
3. Each rank reads its own slots' blocks fully, and only the length arrays (first ``12 + 12 n`` bytes) of
   the other slots' blocks. For every slot of the window it computes the same batch plan
   (``scaletrain.data.batching.plan_batches``: shuffled with an RNG seeded by
   ``(seed, epoch, window, slot)``, ordered along a Hilbert curve over (source length, target length),
   cut greedily with ``B * (S + T) <= max_tokens``, batch order shuffled).
4. Equal batch counts: every slot of a window ends with ``max`` of the counts. A slot with fewer
   batches splits its largest batches in two (halves still fit the budget, no example is lost or
   repeated). Only when a slot has fewer examples than the target count (a split with fewer
   blocks than slots, or ``buffer_size=1``) are batches repeated (its own, else those of the first
   slot with data); those repeats are the only duplicates an epoch can contain. With ``drop_last=True`` every slot
   instead keeps ``min`` of the counts and drops its surplus batches.
5. Update ``j`` of a window is batch ``j`` of every slot; a rank yields, update by update, its ``grad_accum``
   slots' batches in slot order. The state (``scaletrain.data.position``) is ``(epoch, window, update,
   micro-batch)`` plus the slot count; resume re-plans one window. A state saved with the same slot count
   resumes exactly under any layout; one saved with another count continues the epoch with nothing lost or
   repeated (the unread rest of the current window regrouped for the new count: a *carry*, then windows
   planned for the new count from the next block on: ``scaletrain.data.position.change_slots``).

The parts: ``SplitBlocks`` (the split's blocks and how one is read: checks, skipping, tokenizing),
``WindowPlanner`` (steps 1-5: which blocks each slot reads in a window, its batches, a rank's batches in a window
or a carry) and ``ShardStream`` (the position, iteration, the state). ``scaletrain.data.loader.ShardLoader``
serves a stream from DataLoader worker processes (the same batches).

Language-pair temperature (``temperature=T``): direction d with n_d examples is drawn with
probability p_d ∝ n_d^(1/T). Each example of d is repeated ``w_d = p_d N / n_d`` times in
expectation (stochastic rounding, RNG seeded by ``(seed, epoch, window, slot)``), so an epoch still
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

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from scaletrain.data.batch import Batch, collate_arrays
from scaletrain.data.batching import equalise, equalise_tagged, plan_batches
from scaletrain.data.example import Example, token_budget_problem
from scaletrain.data.position import STATE_VERSION, change_slots, upgrade, window_span, windows_from
from scaletrain.data.shards import CorruptShardError, load_manifest, read_block
from scaletrain.data.sources import FetchOptions, is_remote, open_source
from scaletrain.data.spm_models import load_token_lengths
from scaletrain.errors import ScaletrainError
from scaletrain.vocab.base import BYTE_OFFSET, LANG_OFFSET

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
    """The examples of one batch slot's blocks in a window, as flat arrays (for vectorised collate)."""

    def __init__(self, blocks, lang_offset: int = LANG_OFFSET, tokens: bool = False, pad_to_multiple: int = 1,
                 ids: np.ndarray | None = None):
        self.blocks = blocks
        self.ids = ids  # the examples' numbers within the split (ShardStream.example_ids)
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
    """This rank's batches in one segment of the sequence (a window, or a carry: ``scaletrain.data.position``)."""

    key: tuple  # the segment: (epoch, origin, window, carry)
    batches: list  # (slot whose examples it indexes, index array), update by update, this rank's slots in order
    pools: dict  # slot -> _Pool
    skipped: int = 0  # corrupt blocks skipped while making this plan
    n_blocks: int = 0  # blocks of the window it plans (0 for a carry): the empty-epoch check

    def examples(self, item) -> list[Example]:
        slot, idx = item
        return self.pools[slot].examples(idx)

    def batch(self, item, max_bytes: int) -> Batch:
        slot, idx = item
        return self.pools[slot].collate(idx, max_bytes)

    def example_ids(self, item) -> np.ndarray:
        slot, idx = item
        return self.pools[slot].ids[idx]


def _check_stream_args(rank: int, world_size: int, max_tokens: int, max_bytes: int, buffer_size: int,
                       temperature: float, epochs: int | None, on_corrupt: str = "stop", pad_to_multiple: int = 1,
                       max_rows: int = 0, grad_accum: int = 1) -> None:
    """Reject ``ShardStream`` settings that cannot work, before any file is read."""
    if pad_to_multiple < 1 or max_rows < 0:
        raise ScaletrainError(f"pad_to_multiple must be >= 1 and max_rows >= 0 (got {pad_to_multiple}, {max_rows})")
    if on_corrupt not in ON_CORRUPT:
        raise ScaletrainError(f"on_corrupt must be stop or skip (got {on_corrupt!r})")
    if world_size < 1 or not (0 <= rank < world_size):
        raise ScaletrainError(f"rank {rank} is not in 0..world_size-1 (world_size={world_size})")
    if grad_accum < 1:
        raise ScaletrainError(f"grad_accum (micro-batches per update) must be >= 1 (got {grad_accum})")
    if max_bytes < 1:
        raise ScaletrainError(f"max_bytes must be >= 1 (got {max_bytes})")
    problem = token_budget_problem(max_tokens, max_bytes, pad_to_multiple=pad_to_multiple)
    if problem:
        raise ScaletrainError(problem)
    if buffer_size < 1:
        raise ScaletrainError(f"buffer_size (blocks per batch slot and window) must be >= 1 (got {buffer_size})")
    if not temperature > 0:
        raise ScaletrainError(f"temperature must be > 0 (got {temperature}); 1 = natural proportions")
    if epochs is not None and epochs < 0:
        raise ScaletrainError(f"epochs must be >= 0 or None (got {epochs})")


# ---------------------------------------------------------------------------------------------
# the plan of a window
# ---------------------------------------------------------------------------------------------
class WindowPlanner:
    """Steps 1-5 of the module doc: the windows of an epoch, the blocks each batch slot reads in a window, the
    batches of a slot (length buckets, token budget, direction temperature, equal counts across slots), and a
    rank's batches update by update, in a window or in a carry (the regrouped rest of a window planned for
    another slot count)."""

    def __init__(self, blocks: SplitBlocks, *, slots: int, seed: int, max_tokens: int, max_bytes: int,
                 buffer_size: int, drop_last: bool, shuffle: bool, temperature: float, pad_to_multiple: int,
                 max_rows: int):
        self.blocks, self.slots = blocks, slots
        self.seed, self.max_tokens, self.max_bytes = seed, max_tokens, max_bytes
        self.buffer_size, self.drop_last, self.shuffle = buffer_size, drop_last, shuffle
        self.temperature = float(temperature)
        self.pad_to_multiple, self.max_rows = pad_to_multiple, max_rows  # fixed shapes (scaletrain.data.batching)
        self.weights = self._direction_weights()
        self.n_windows = self.windows_from(0)

    def windows_from(self, origin: int) -> int:
        """Windows of an epoch's grid starting at block ``origin`` of the permuted order."""
        return windows_from(self.blocks.n, origin, self.buffer_size, self.slots)

    def with_slots(self, slots: int) -> "WindowPlanner":
        """The same planner for another number of batch slots (to re-plan a window of a carry)."""
        p = copy.copy(self)
        p.slots = slots
        p.n_windows = p.windows_from(0)
        return p

    def block_order(self, epoch: int) -> np.ndarray:
        n = self.blocks.n
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, 0xB10C]).permutation(n)

    def slot_blocks(self, epoch: int, window: int, origin: int = 0) -> list[list[int]]:
        """The blocks of each slot in ``window`` of ``epoch`` (block numbers within the split)."""
        nw = self.windows_from(origin)
        a, b = window_span(self.blocks.n, origin, window, nw)
        chunk = self.block_order(epoch)[a:b].tolist()
        # balance example counts: biggest block first to the slot with the fewest examples so far
        # (equal-size blocks simply go round robin); ties keep the permuted order, and the slot that
        # wins a tie rotates with the window so no slot systematically gets the extra block
        sizes = self.blocks.sizes[chunk].tolist()
        S = self.slots
        slots: list[list[int]] = [[] for _ in range(S)]
        load = [0] * S
        first = (epoch * nw + window + origin) % S
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

    def _seed(self, epoch: int, window: int, slot: int, origin: int, *extra: int) -> list[int]:
        """The RNG seed of a slot's plan in a window (a grid starting mid-epoch adds its origin)."""
        return [self.seed, epoch, window, slot, *extra, *([origin] if origin else [])]

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

    def slot_batches(self, blocks, epoch: int, window: int, slot: int, origin: int = 0) -> list[np.ndarray]:
        """Batch plan of one slot: arrays of indices into the slot's examples (repeats if upsampled)."""
        s_len, t_len = self.lengths(blocks)
        rng = np.random.default_rng(self._seed(epoch, window, slot, origin)) if self.shuffle else None
        shape = dict(pad_to_multiple=self.pad_to_multiple, max_rows=self.max_rows)
        if self.weights is None or not blocks:
            return plan_batches(s_len, t_len, self.max_tokens, rng, **shape)
        L = len(self.blocks.manifest.languages)
        d = np.concatenate([b.src_lang.astype(np.int64) * L + b.tgt_lang for b in blocks])
        w = self.weights[d]
        u = np.random.default_rng(self._seed(epoch, window, slot, origin, 0x7E3)).random(len(w))
        reps = np.floor(w).astype(np.int64) + (u < w - np.floor(w))
        idx = np.repeat(np.arange(len(w)), reps)
        return [idx[b] for b in plan_batches(s_len[idx], t_len[idx], self.max_tokens, rng, **shape)]

    def window_lists(self, epoch: int, window: int, origin: int, full, want) -> tuple[list, list, dict]:
        """(blocks of each slot, the blocks read, ``{slot: batches}`` for the slots in ``want``): every slot's
        batches as ``(slot whose examples, indices)`` pairs, as many as every other slot's (module doc, step 4).
        Slots in ``full`` read their blocks fully (their pools), the others only the lengths."""
        slots = self.slot_blocks(epoch, window, origin)
        read = [self.blocks.read(ids, lengths_only=s not in full) for s, ids in enumerate(slots)]
        plans = [self.slot_batches(b, epoch, window, s, origin) for s, b in enumerate(read)]
        counts = [len(p) for p in plans]
        target = min(counts) if self.drop_last else max(counts)
        return slots, read, {s: self._equal_count(plans, s, target) for s in want}

    @staticmethod
    def _equal_count(plans: list, me: int, target: int) -> list:
        mine = [(me, b) for b in equalise(plans[me], target)[:target]]
        if len(mine) < target:  # fewer examples than batches needed: repeat batches (documented)
            donor = me if plans[me] else next(s for s, p in enumerate(plans) if p)
            src = list(mine) if donor == me else [(donor, b) for b in plans[donor]]
            mine += [src[i % len(src)] for i in range(target - len(mine))]
        return mine

    def plan(self, epoch: int, window: int, mine: list[int], origin: int = 0) -> _WindowPlan:
        """The batches of this rank's slots ``mine`` in ``window``: update by update, its slots in order."""
        self.blocks.skips = 0
        slots, read, lists = self.window_lists(epoch, window, origin, full=mine, want=mine)
        pools = {s: self._pool(read[s], slots[s]) for s in mine}
        items = [lists[s][j] for j in range(len(lists[mine[0]])) for s in mine]
        where = f"window {window} of epoch {epoch}"
        return self._finish(items, pools, slots, (epoch, origin, window, None), where, sum(map(len, slots)))

    def carry_plan(self, epoch: int, carry: dict, mine: list[int]) -> _WindowPlan:
        """The batches of this rank's slots ``mine`` in ``carry`` (``scaletrain.data.position``): the unread
        batches of a window planned for ``carry["slots"]`` slots, in update order, regrouped ``self.slots`` to
        an update (after the ``regroups`` of earlier changes)."""
        old = self if carry["slots"] == self.slots else self.with_slots(carry["slots"])
        self.blocks.skips = 0
        slots, _, lists = old.window_lists(epoch, carry["window"], carry["origin"], full=(), want=range(old.slots))
        starts = carry["starts"] if isinstance(carry["starts"], list) else [carry["starts"]] * old.slots
        left = [lists[s][j] for j in range(len(lists[0])) for s in range(old.slots)
                if starts[s] is not None and j >= starts[s]]
        for g, u in carry["regroups"]:
            left = self._regroup(left, g, say=False)[u * g:]
        left = self._regroup(left, self.slots)
        G = self.slots
        items = [left[u * G + s] for u in range(len(left) // G) for s in mine]
        where = f"the regrouped rest of window {carry['window']} of epoch {epoch}"
        return self._finish(items, {}, slots, (epoch, None, None, _frozen(carry)), where, 0)

    def _regroup(self, items: list, slots: int, say: bool = True) -> list:
        """``items`` made a multiple of ``slots`` long: the largest batches split in two (repeated from the start
        only when too few examples are left); with ``drop_last`` the surplus dropped instead. A regroup that
        drops or repeats batches says so in the log (``say``; not when an earlier regroup is replayed)."""
        if self.drop_last:
            keep = len(items) // slots * slots
            if keep < len(items) and say:
                log.warning("data stream: regrouping %d batch(es) %d to an update drops the last %d (data.drop_last); "
                            "their examples are not read in this epoch", len(items), slots, len(items) - keep)
            return items[:keep]
        want = -(-len(items) // slots) * slots
        items = equalise_tagged(items, want)
        src = list(items)
        if want > len(items) and say:
            log.warning("data stream: regrouping %d batch(es) %d to an update repeats %d batch(es) (too few examples "
                        "left to split); those examples are read twice in this epoch", len(items), slots,
                        want - len(items))
        return items + [src[i % len(src)] for i in range(want - len(items))]

    def _finish(self, items: list, pools: dict, slots: list, key: tuple, where: str, n_blocks: int) -> _WindowPlan:
        """The plan of ``items``: the pools of every slot they take examples from read (fully), the examples of
        skipped corrupt blocks removed."""
        for s in sorted({s for s, _ in items} - pools.keys()):
            pools[s] = self._pool(self.blocks.read(slots[s], lengths_only=False), slots[s])
        if any(p.dropped.any() for p in pools.values()):
            items = self._without_dropped(items, pools, where)
        return _WindowPlan(key, items, pools, self.blocks.skips, n_blocks)

    def _pool(self, blocks, block_ids: list[int]) -> _Pool:
        ids = [np.arange(self.blocks.starts[i], self.blocks.starts[i] + len(b)) for i, b in zip(block_ids, blocks)]
        return _Pool(blocks, self.blocks.lang_offset, self.blocks.vocab is not None, self.pad_to_multiple,
                     ids=np.concatenate(ids) if ids else np.zeros(0, np.int64))

    def _without_dropped(self, mine: list, pools: dict, where: str) -> list:
        """The batches without the examples of skipped blocks; a batch left empty repeats another one of
        this rank's window, so the batch count (agreed by every rank from the headers) does not change."""
        kept = [(s, idx[~pools[s].dropped[idx]]) for s, idx in mine]
        full = [x for x in kept if len(x[1])]
        if mine and not full:
            raise ScaletrainError(f"every example of this rank's batches in {where} of {self.blocks.shard_dir} is "
                                  "in a corrupt block; re-create or re-download the shards")
        return [x if len(x[1]) else full[i % len(full)] for i, x in enumerate(kept)]

    def batches_per_epoch(self, epoch: int) -> int:
        """Batches every slot yields in ``epoch`` (a grid from the epoch's first block); reads all length arrays."""
        total = 0
        for w in range(self.n_windows):
            counts = [len(self.slot_batches(self.blocks.read(ids, lengths_only=True), epoch, w, s))
                      for s, ids in enumerate(self.slot_blocks(epoch, w))]
            total += min(counts) if self.drop_last else max(counts)
        return total


def no_batches_message(split: str, rank: int, n_blocks: int, slots: int) -> str:
    return (f"an epoch of split {split!r} gives no batches on rank {rank} (drop_last with {n_blocks} blocks for "
            f"{slots} batch slots?)")


def _frozen(x):
    """A hashable, comparable copy of a JSON-like value (a carry in a plan's key)."""
    if isinstance(x, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in x.items()))
    if isinstance(x, list):
        return tuple(_frozen(v) for v in x)
    return x


# ---------------------------------------------------------------------------------------------
# the stream
# ---------------------------------------------------------------------------------------------
class ShardStream:
    """Iterable of ``Batch`` over one split of a shard directory for data-parallel rank ``rank`` of
    ``world_size`` with ``grad_accum`` micro-batches per update; see the module doc."""

    def __init__(
        self,
        shard_dir: str | Path,
        split: str = "train",
        *,
        rank: int = 0,
        world_size: int = 1,
        grad_accum: int = 1,
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
                           pad_to_multiple, max_rows, grad_accum)
        self.blocks = SplitBlocks(shard_dir, split, vocab=vocab, on_corrupt=on_corrupt, fetch=fetch)
        self.planner = WindowPlanner(self.blocks, slots=world_size * grad_accum, seed=seed, max_tokens=max_tokens,
                                     max_bytes=max_bytes, buffer_size=buffer_size, drop_last=drop_last,
                                     shuffle=shuffle, temperature=temperature, pad_to_multiple=pad_to_multiple,
                                     max_rows=max_rows)
        self.shard_dir, self.source, self.split = self.blocks.shard_dir, self.blocks.source, split
        self.manifest, self.n_blocks, self.n_windows = self.blocks.manifest, self.blocks.n, self.planner.n_windows
        self.vocab = self.blocks.vocab  # a SubwordVocab, or None: the byte stream
        self.rank, self.world_size, self.grad_accum, self.epochs = rank, world_size, grad_accum, epochs
        self.slots = list(range(rank * grad_accum, (rank + 1) * grad_accum))  # this rank's batch slots
        self._epoch = self._origin = self._window = self._k = 0  # _k: this rank's batches read in the segment
        self._carry: dict | None = None
        self._skipped_done = 0  # corrupt blocks skipped in the segments before the current one
        self._plan: _WindowPlan | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def finished(self) -> bool:
        """The stream has read its ``epochs``."""
        return self.epochs is not None and self._epoch >= self.epochs

    def block(self, i: int):
        """(ShardInfo, BlockInfo) of block ``i`` of the split (manifest order)."""
        return self.blocks.block(i)

    def _segment(self) -> tuple:
        return (self._epoch, None, None, _frozen(self._carry)) if self._carry is not None else (
            self._epoch, self._origin, self._window, None)

    def segment_plan(self) -> _WindowPlan:
        """This rank's batches in the current segment (a window, or a carry), planned once."""
        p, key = self._plan, self._segment()
        if p is None or p.key != key:
            if self._carry is None:
                p = self.planner.plan(self._epoch, self._window, self.slots, self._origin)
            else:
                p = self.planner.carry_plan(self._epoch, self._carry, self.slots)
            self._plan = p
        return p

    def end_segment(self) -> None:
        """Go to the next segment's first batch, counting the corrupt blocks the current one skipped."""
        p = self._plan
        if p is not None and p.key == self._segment():
            self._skipped_done += p.skipped
        self.skip_segment()

    def skip_segment(self) -> None:
        """Go to the next segment's first batch without planning the current one (a worker's turn to pass)."""
        if self._carry is not None:
            self._carry, self._window = None, 0
        else:
            self._window += 1
        self._k = 0
        if self._window >= self.planner.windows_from(self._origin):
            self._epoch, self._origin, self._window = self._epoch + 1, 0, 0

    # ---- iteration ---------------------------------------------------------------------------
    def _read(self, emit) -> Iterator:
        """``emit(plan, item)`` for every batch from the current position on; finite ``epochs`` end it."""
        empty = 0  # blocks of consecutive windows without a batch
        while not self.finished:
            plan = self.segment_plan()
            empty = empty + plan.n_blocks if self._k >= len(plan.batches) else 0
            if empty >= self.n_blocks:
                raise ScaletrainError(no_batches_message(self.split, self.rank, self.n_blocks, self.planner.slots))
            yield from self._rest_of_segment(emit)

    def _rest_of_segment(self, emit) -> Iterator:
        plan = self.segment_plan()
        n = len(plan.batches)
        if self._k >= n:
            self.end_segment()
            return
        for k in range(self._k, n):
            self._k = k + 1
            if self._k == n:
                self.end_segment()  # the position after a segment's last batch is the next one's start
            yield emit(plan, plan.batches[k])

    def read_segment(self) -> Iterator[Batch]:
        """The rest of the current segment's batches (a DataLoader worker's share); the position advances with
        each, and is the next segment's start after the last (or at once, when none is left)."""
        max_bytes = self.planner.max_bytes
        return self._rest_of_segment(lambda plan, item: plan.batch(item, max_bytes))

    def __iter__(self) -> Iterator[Batch]:
        """Yield batches from the current state on: for each update, this rank's ``grad_accum`` micro-batches."""
        max_bytes = self.planner.max_bytes
        return self._read(lambda plan, item: plan.batch(item, max_bytes))

    def example_ids(self) -> Iterator[np.ndarray]:
        """As iterating, but each batch as the numbers of its examples within the split (manifest order; an
        example drawn twice by the temperature sampling appears twice): the batches' identity without
        collating them, for checks and audits. The position advances as with iteration."""
        return self._read(lambda plan, item: plan.example_ids(item))

    @property
    def skipped_blocks(self) -> int:
        """Corrupt blocks this rank skipped so far (``on_corrupt=skip``), the current segment's included."""
        p = self._plan
        now = p.skipped if p is not None and p.key == self._segment() else 0
        return self._skipped_done + now

    def batches_per_epoch(self, epoch: int | None = None) -> int:
        """Batches this rank yields in ``epoch`` (default: the current one) read from its start; reads all
        length arrays."""
        return self.planner.batches_per_epoch(self._epoch if epoch is None else epoch) * self.grad_accum

    # ---- state -------------------------------------------------------------------------------
    def _config(self) -> dict:
        p = self.planner
        cfg = {
            "split": self.split,
            "slots": p.slots,
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
        """Small and JSON-able (format: ``scaletrain.data.position``); identical on every rank (ranks move in
        lockstep) but for the counts of corrupt blocks skipped (``skipped_blocks``: in the segments before the
        current one, what a resume starts from; ``skipped_total``: the current one's too)."""
        batch, micro = divmod(self._k, self.grad_accum)
        return {"version": STATE_VERSION, "epoch": self._epoch, "origin": self._origin, "window": self._window,
                "batch": batch, "micro": micro, "carry": copy.deepcopy(self._carry), "config": self._config(),
                "skipped_blocks": self._skipped_done, "skipped_total": self.skipped_blocks}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (any version; ``scaletrain.data.position.upgrade``): exactly, when it was saved
        with the same batch slot count (data-parallel size x grad_accum, however spread over ranks); with another
        count, from the position ``change_slots`` gives (nothing of the epoch lost or repeated)."""
        st = upgrade(state, self._config())
        mine, cfg = self._config(), st["config"]
        diff = {k: (cfg.get(k), mine.get(k)) for k in {*mine, *cfg} - {"slots"} if cfg.get(k) != mine.get(k)}
        if diff:
            detail = ", ".join(f"{k}: saved {a!r} now {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ScaletrainError(f"cannot resume the data stream exactly, settings changed ({detail})")
        st = change_slots(st, self.planner.slots)
        self._check_range(st)
        self._epoch, self._origin, self._window, self._carry = st["epoch"], st["origin"], st["window"], st["carry"]
        self._k = st["batch"] * self.grad_accum + st["micro"]
        self._skipped_done = int(st["skipped_blocks"])

    def _check_range(self, st: dict) -> None:
        epoch, origin, window, batch, micro, carry = (st[k] for k in ("epoch", "origin", "window", "batch", "micro",
                                                                     "carry"))
        ok = epoch >= 0 and batch >= 0 and 0 <= micro < self.grad_accum and 0 <= origin <= self.n_blocks
        if carry is None:
            ok = ok and 0 <= window < self.planner.windows_from(origin)
        else:
            c_windows = windows_from(self.n_blocks, carry["origin"], self.planner.buffer_size, carry["slots"])
            ok = ok and window == 0 and carry["slots"] >= 1 and 0 <= carry["window"] < c_windows and all(
                g >= 1 and u >= 0 for g, u in carry["regroups"])
        if not ok:
            raise ScaletrainError(f"data-stream state out of range: epoch {epoch}, origin {origin}, window {window}, "
                                  f"batch {batch}, micro-batch {micro} of {self.grad_accum}, carry {carry}")
