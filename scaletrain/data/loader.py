"""DataLoader worker processes for the stream: ``ShardLoader``, its worker protocol and ``data.num_workers: auto``.

The workers do not change the batches: a rank's sequence is ``ShardStream``'s (a function of the seed, the epoch
and the batch slot count), and worker ``i`` of ``n`` reads the segments (windows) ``i, i + n, ...`` of it, each
block read by one worker; this process puts their messages back in order (``ShardLoader._in_order``). Workers
send chunks of consecutive batches packed into two numpy arrays (``pack_chunk`` / ``unpack_chunk``) with the
stream state after each batch (``_SegmentDataset``); the loader's state is the stream's, so a checkpoint resumes
with any ``num_workers``. ``scaletrain.data.position.states_for_layout`` gives the states of a new rank layout
from a checkpoint's states of every old rank.

``ShardLoader.for_run(cfg.data, split, parallel=...)`` is how a run builds its loaders (training, validation): the
one place the ``data`` section's stream keys are read, split by the parallel context's data-parallel rank and size.
"""
from __future__ import annotations

import collections
import copy
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from scaletrain.data.batch import Batch
from scaletrain.data.sources import fetch_options, is_remote
from scaletrain.data.stream import ShardStream, no_batches_message
from scaletrain.errors import ScaletrainError


def auto_num_workers(device_type: str, shards, local_ranks: int, cores: int,
                     threads: int | None = None) -> tuple[int, str]:
    """``data.num_workers: auto``: (workers per rank, why). Workers pay where the training process would
    otherwise wait for data that another core (or the network) can prepare meanwhile:

    * remote shards (``http(s)://`` / ``pipe:``): 2, their reads wait on the network, not on a core;
    * an accelerator whose host has spare cores (at least 4 per local rank): 2;
    * a CPU-only host with an idle core per rank beside the training threads (``threads`` torch threads
      per rank, default ``cores // local_ranks``, i.e. none idle): 1. Any worker count yields exactly the
      in-process batch sequence and state (checkpoints resume either way); one worker takes the data side
      (window reads, CRC checks, planning, collation; ~0.6 ms of worker CPU per batch of the `small`
      model) off the step, and costs the step nothing measurable (``benchmarks/bench_loader_workers.py``
      on the same batches, 2 cores, 1 training thread: step time in-process / 1 worker 1.01 [0.99-1.05]);
      with a slow decode (``--decode-ms 500 --buffer-size 2``) the wait goes from 101 to 0.4 ms per step
      and the step is 1.08x faster. Its one-time cost: the fork, whose first step copies the trainer's
      written pages (copy-on-write: ~1e5 page faults, +0.2-0.25 s for that model); the worker keeps the
      pre-fork copy of those pages.
    * a CPU-only host whose cores all train: 0, a worker would take its cycles from the training threads.
    """
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


class _SegmentDataset(torch.utils.data.IterableDataset):
    """What a DataLoader worker runs: the rank's ``ShardStream``, reading every ``num_workers``-th segment.

    Worker ``v`` plans and reads segments ``v``, ``v + nw``, ... counted from the loader's position (the first
    one from inside, at the position), passing over the others without reading them (``skip_segment``), so
    no block is read by two workers. It sends each segment as messages of up to ``chunk`` consecutive batches
    packed into two arrays (``pack_chunk``): ``(v, states, packed, (skipped, n_blocks, end))``, where
    ``states`` holds the stream state after each batch, ``skipped`` the corrupt blocks the segment skipped,
    ``n_blocks`` the blocks of its window and ``end`` marks the segment's last message (a segment without
    batches sends one empty message). In this process (``num_workers=0``) it yields ``(state, Batch)`` per batch,
    from ``stream`` when given (the loader's first stream)."""

    def __init__(self, loader: "ShardLoader", stream: ShardStream | None = None):
        super().__init__()
        self.args, self.state = loader._stream_args, loader._state
        self.nw, self.chunk = loader.nw, loader.chunk
        self.stream = stream

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        s, self.stream = self.stream, None
        if s is None:
            s = ShardStream(*self.args[0], **self.args[1])
            s.load_state_dict(self.state)
        if info is None:
            for batch in s:
                yield s.state_dict(), batch
            return
        seq = 0
        while not s.finished:
            if seq % self.nw == info.id:
                yield from self._segment(s, info.id)
            else:
                s.skip_segment()
            seq += 1

    def _segment(self, s: ShardStream, v: int):
        plan = s.segment_plan()
        info = [plan.skipped, plan.n_blocks, False]
        batches, states = [], []
        for batch in s.read_segment():
            batches.append(batch)
            states.append(s.state_dict())
            if len(batches) == self.chunk:
                yield v, states, pack_chunk(batches), tuple(info)
                batches, states = [], []
        info[2] = True
        yield v, states, pack_chunk(batches) if batches else None, tuple(info)


def _identity(x):
    return x


def pack_chunk(batches: list[Batch]) -> tuple:
    """Batches in the worker wire format: one header array ``[k, 6]`` (B, S, T, n_src, n_tgt, 0) and one flat id
    array (uint16 when every id fits, else int64) holding each batch's src, tgt_in, tgt_out, src_lang, tgt_lang:
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


def unpack_chunk(packed) -> list[Batch]:
    """The batches of ``pack_chunk``."""
    head, flat = packed
    out, o = [], 0
    for B, S, T, ns, nt, _ in head.tolist():
        arrs = []
        for n, shape in ((B * S, (B, S)), (B * T, (B, T)), (B * T, (B, T)), (B, (B,)), (B, (B,))):
            arrs.append(torch.from_numpy(flat[o:o + n].astype(np.int64).reshape(shape)))
            o += n
        out.append(Batch(*arrs, ns, nt))
    return out


class ShardLoader:
    """``ShardStream`` served by ``num_workers`` DataLoader worker processes, exactly resumable.

    The batches are those of ``ShardStream(rank=..., world_size=..., grad_accum=...)`` whatever the number of
    workers: worker ``i`` of ``num_workers`` reads segments (windows) ``i, i + num_workers, ...`` of the
    sequence (``_SegmentDataset``), sending up to ``chunk`` batches per message, and this process puts them
    back in sequence order. So every block is read by one worker, the plans need no communication, and the
    state (``state_dict``: the stream state after the last batch yielded, ``scaletrain.data.position``) resumes
    with any ``num_workers``. Memory: each worker holds the segment it reads (this rank's ``grad_accum`` slots of
    a window); this process holds the messages of later segments that arrive while it still yields an earlier
    one (about ``num_workers - 1`` windows of packed batches). ``num_workers=0`` iterates in this process. The
    DataLoader sets one torch thread per worker.
    """

    def __init__(self, shard_dir: str | Path, split: str = "train", *, rank: int = 0, world_size: int = 1,
                 grad_accum: int = 1, num_workers: int = 0, prefetch_factor: int = 2, chunk: int = 8,
                 **stream_kwargs):
        if num_workers < 0:
            raise ScaletrainError(f"num_workers must be >= 0 (got {num_workers})")
        if chunk < 1:
            raise ScaletrainError(f"chunk (batches per worker message) must be >= 1 (got {chunk})")
        self.rank, self.world_size, self.grad_accum, self.num_workers = rank, world_size, grad_accum, num_workers
        self.nw = max(1, num_workers)
        self.chunk = chunk  # batches per message from a worker process (at most)
        self.prefetch_factor = prefetch_factor
        self._stream_args = ((shard_dir, split), dict(rank=rank, world_size=world_size, grad_accum=grad_accum,
                                                      **stream_kwargs))
        # validate the settings here (bad input -> ScaletrainError in the main process); in-process, the first
        # iteration streams with it (a second stream would read the manifest again)
        first = ShardStream(*self._stream_args[0], **self._stream_args[1])
        self._first: ShardStream | None = first if num_workers == 0 else None
        self._state = first.state_dict()

    @classmethod
    def for_run(cls, data, split: str = "train", *, parallel=None, rank: int = 0, world_size: int = 1,
                grad_accum: int = 1, vocab=None, num_workers: int = 0) -> "ShardLoader":
        """The loader of a run's ``split``, from the config's ``data`` section (``scaletrain.config.DataConfig``):
        the one place its stream keys are read. ``parallel``: the run's ``ParallelContext``, whose data-parallel
        rank and size split the data (``rank``/``world_size`` give them directly where there is no context);
        ``grad_accum``: the training loader's micro-batches per update. Every split takes the token budget
        (resolved: ``max_tokens: auto`` is a number by now), the fixed shapes, ``max_bytes``, ``on_corrupt`` and
        the fetch keys; ``train`` also ``seed``, ``buffer_size``, ``temperature`` and ``grad_accum``, and never
        ends. Any other split is read once (one epoch) in natural proportions, one batch per rank at a time,
        shuffled with seed 0 in windows of the stream's default ``buffer_size``: the validation loss's stream.
        ``num_workers``: a number (the trainer resolves ``data.num_workers: auto`` with ``auto_num_workers``)."""
        if parallel is not None:
            rank, world_size = parallel.rank, parallel.world_size
        common = dict(rank=rank, world_size=world_size, num_workers=num_workers, max_tokens=data.max_tokens,
                      max_bytes=data.max_bytes, vocab=vocab, on_corrupt=data.on_corrupt, fetch=fetch_options(data),
                      pad_to_multiple=data.pad_to_multiple, max_rows=data.max_rows)
        if split == "train":
            return cls(data.shards, split, seed=data.seed, buffer_size=data.buffer_size, grad_accum=grad_accum,
                       temperature=data.temperature, **common)
        return cls(data.shards, split, seed=0, epochs=1, **common)

    @property
    def skipped_blocks(self) -> int:
        """Corrupt blocks this rank skipped so far (``on_corrupt=skip``)."""
        return int(self._state.get("skipped_total", 0))

    @property
    def epoch(self) -> int:
        return int(self._state["epoch"])

    def __iter__(self) -> Iterator[Batch]:
        if self.num_workers == 0:
            ds = _SegmentDataset(self, self._first)
            self._first = None
            for state, batch in ds:
                self._state = state
                yield batch
            return
        # A generator of its own: the DataLoader draws its workers' base seed from the generator it is given,
        # by default torch's global one, which would shift dropout's random stream by one draw at every
        # start and resume (a resumed run would not be bitwise the uninterrupted one). The workers use no
        # torch randomness (the stream is seeded by data.seed).
        dl = torch.utils.data.DataLoader(_SegmentDataset(self), batch_size=None, num_workers=self.num_workers,
                                         prefetch_factor=self.prefetch_factor, collate_fn=_identity,
                                         generator=torch.Generator().manual_seed(0))
        yield from self._in_order(iter(dl))

    def _in_order(self, messages) -> Iterator[Batch]:
        """The workers' messages in sequence order: segment ``seq`` is worker ``seq % num_workers``'s; messages of
        later segments wait in their worker's queue. The corrupt-block counts of the states are this process's
        (a worker knows only the segments it read)."""
        queues = [collections.deque() for _ in range(self.nw)]
        seq, done, empty, got = 0, int(self._state.get("skipped_blocks", 0)), 0, False
        n_blocks, slots = int(self._state["config"]["n_blocks"]), self.world_size * self.grad_accum
        while True:
            owner = seq % self.nw
            while not queues[owner]:
                msg = next(messages, None)
                if msg is None:
                    return
                queues[msg[0]].append(msg[1:])
            states, packed, (skipped, blocks, end) = queues[owner].popleft()
            batches = unpack_chunk(packed) if packed is not None else []
            for i, (state, batch) in enumerate(zip(states, batches)):
                now = done + skipped * (end and i == len(batches) - 1)  # the last batch: the next segment's start
                self._state = {**state, "skipped_blocks": now, "skipped_total": done + skipped}
                yield batch
            got = got or bool(batches)
            if end:  # an epoch's worth of windows without a batch: stop, as the stream does
                empty = 0 if got else empty + blocks
                if empty >= n_blocks:
                    raise ScaletrainError(no_batches_message(self._stream_args[0][1], self.rank, n_blocks, slots))
                done, seq, got = done + skipped, seq + 1, False

    def state_dict(self) -> dict:
        """The stream state after the last batch yielded (``scaletrain.data.position``); any worker count resumes it."""
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (a stream or loader state of any version; a different batch slot count moves
        the position as ``scaletrain.data.position.change_slots`` says)."""
        s = ShardStream(*self._stream_args[0], **self._stream_args[1])
        s.load_state_dict(state)
        self._state = s.state_dict()
        self._first = s if self.num_workers == 0 else None
