"""DataLoader worker processes for the stream: ``ShardLoader``, its worker protocol and ``data.num_workers: auto``.

Each (rank, worker) pair is one slot of a ``ShardStream`` with ``world_size * num_workers`` slots, so workers
split the rank's data at block granularity and every slot yields the same number of batches per window; the
loader's state records every worker's stream position, so resume is exact whatever the worker count (the same
count is needed to resume). Workers send chunks of consecutive batches packed into two numpy arrays
(``pack_chunk`` / ``unpack_chunk``) with the stream position after each batch (``_SlotDataset``).

``ShardLoader.for_run(cfg.data, split, ...)`` is how a run builds its loaders (training, validation): the one
place the ``data`` section's stream keys are read.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from scaletrain.data.batch import Batch
from scaletrain.data.sources import fetch_options, is_remote
from scaletrain.data.stream import STATE_VERSION, ShardStream
from scaletrain.errors import ScaletrainError


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


class _SlotDataset(torch.utils.data.IterableDataset):
    """What a DataLoader worker runs: the ShardStream of one virtual slot.

    In a worker process it yields *chunks*: ``(v, base_state, positions [k, 5], packed)`` holding
    consecutive batches of virtual worker ``v`` packed into one flat array (``pack_chunk``), with the stream
    position (``ShardStream.position()``: epoch, window, batch, skipped blocks before and with the window)
    after each batch. A chunk ends after the batch whose index within its
    window is ``chunk - 1`` mod ``chunk``, or the window's last batch: every slot has the same number
    of batches per window, so all slots share the same chunk grid and chunks never cross a window
    (or epoch) boundary. One message per chunk
    amortises the per-item cost of the DataLoader (index queue round trip, result queue, pickling
    a tuple of arrays and a state dict) over ``k`` batches. In this process (``num_workers=0``) it
    yields ``(v, state, Batch)`` per batch, from ``stream`` when given (the loader's unused first stream).
    """

    def __init__(self, loader: "ShardLoader", stream: ShardStream | None = None):
        super().__init__()
        self.args = loader._stream_args
        self.rank, self.world_size, self.nw = loader.rank, loader.world_size, loader.nw
        self.positions, self.next = list(loader._positions), loader._next
        self.chunk = loader._msg
        self.stream = stream

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        i = info.id if info is not None else 0
        v = (self.next + i) % self.nw
        s, self.stream = self.stream, None
        if s is None:
            s = ShardStream(*self.args[0], rank=self.rank * self.nw + v, world_size=self.world_size * self.nw,
                            **self.args[1])
        if self.positions[v] is not None:
            s.load_state_dict(self.positions[v])
        if info is None:
            for batch in s:
                yield v, s.state_dict(), batch
            return
        base = s.state_dict()
        batches, pos = [], []
        for batch in s:
            batches.append(batch)
            pos.append(s.position())
            if pos[-1].batch % self.chunk == 0:  # the next batch starts a chunk (or a window)
                yield v, base, np.asarray(pos, dtype=np.int64), pack_chunk(batches)
                batches, pos = [], []
        if batches:
            yield v, base, np.asarray(pos, dtype=np.int64), pack_chunk(batches)


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
        # validate the settings here (bad input -> ScaletrainError in the main process); in-process, the first
        # iteration streams with it (a second stream would read the manifest again)
        first = ShardStream(shard_dir, split, rank=rank * self.nw, world_size=world_size * self.nw, **stream_kwargs)
        self._first: ShardStream | None = first if num_workers == 0 else None
        self._positions: list[dict | None] = [None] * self.nw
        self._next = 0

    @classmethod
    def for_run(cls, data, split: str = "train", *, rank: int = 0, world_size: int = 1, vocab=None,
                num_workers: int = 0) -> "ShardLoader":
        """The loader of a run's ``split``, from the config's ``data`` section (``scaletrain.config.DataConfig``):
        the one place its stream keys are read. Every split takes the token budget (resolved: ``max_tokens:
        auto`` is a number by now), the fixed shapes, ``max_bytes``, ``on_corrupt`` and the fetch keys;
        ``train`` also ``seed``, ``buffer_size`` and ``temperature``, and never ends. Any other split is read
        once (one epoch) in natural proportions, shuffled with seed 0 in windows of the stream's default
        ``buffer_size``: the validation loss's stream. ``num_workers``: a number (the trainer resolves
        ``data.num_workers: auto`` with ``auto_num_workers``)."""
        common = dict(rank=rank, world_size=world_size, num_workers=num_workers, max_tokens=data.max_tokens,
                      max_bytes=data.max_bytes, vocab=vocab, on_corrupt=data.on_corrupt, fetch=fetch_options(data),
                      pad_to_multiple=data.pad_to_multiple, max_rows=data.max_rows)
        if split == "train":
            return cls(data.shards, split, seed=data.seed, buffer_size=data.buffer_size,
                       temperature=data.temperature, **common)
        return cls(data.shards, split, seed=0, epochs=1, **common)

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
        if self.num_workers == 0:
            ds = _SlotDataset(self, self._first)
            self._first = None
            for v, pos, batch in ds:
                self._advance(v, pos)
                yield batch
            return
        ds = _SlotDataset(self)
        # A generator of its own: the DataLoader draws its workers' base seed from the generator it is given,
        # by default torch's global one, which would shift dropout's random stream by one draw at every
        # start and resume (a resumed run would not be bitwise the uninterrupted one). The workers use no
        # torch randomness (the stream is seeded by data.seed).
        dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=self.num_workers,
                                         prefetch_factor=self.prefetch_factor, collate_fn=_identity,
                                         generator=torch.Generator().manual_seed(0))
        for v, base, pos, packed in dl:
            for (e, w, b, sd, st), batch in zip(pos.tolist(), unpack_chunk(packed)):
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
