"""A lost host ends the job within ``engine.peer_timeout_s``, named, with a retryable exit code.

Why a heartbeat and not a shorter collective timeout: a host whose link goes down leaves half-open
connections, and a gloo/NCCL collective blocked on it only fails after the collective timeout
(``engine.collective_timeout_minutes``, 10 by default). That timeout also bounds the legitimate waits of a
job -- rank 0 writing a checkpoint or running validation while the others sit in a barrier -- so making it
short enough to catch a lost host (about a minute) would kill healthy jobs with slow saves. PyTorch's NCCL
watchdog (``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``) watches only its own NCCL work on GPUs, not gloo on CPU, and
cannot name which host is gone. So every rank runs one daemon thread that adds 1 to its own counter in the
job's rendezvous store (torch's TCPStore, the one ``init_process_group`` used: a new client connection to
it, ``Store.clone``) every ``interval`` seconds and reads everyone's counters with one ``multi_get``. A rank
whose counter has not moved for ``peer_timeout_s`` is lost; a store this rank cannot reach for that long
means rank 0's host is lost (the store lives there; a second thread watches the age of the last store
request that went through, since a request to a host cut off can block without a timeout). It then prints one line naming the lost
host(s) by hostname and their ranks, and the last good checkpoint, and ends the process with
:data:`PEER_LOST_EXIT` (the main thread may be stuck in a collective that nothing else can interrupt).

Cost: nothing on the training step's path (the thread runs between steps' GIL releases); per interval
each rank makes two store round trips (``add`` + ``multi_get`` of ``world_size`` keys), i.e. the store
serves ``2 * world_size / interval`` requests per second (a few hundred at 256 ranks and 2 s).
Measured per-step cost is in docs/OPERATIONS.md.

A collective that fails at once (a peer killed: its sockets closed) is explained by :meth:`Heartbeat.confirm`:
the ranks whose counters do not move for a few intervals after the failure are the lost ones, so the
line names the host within seconds instead of after ``peer_timeout_s``.

A rank that finishes adds :data:`DONE` to its counter, so a peer that ends early is never taken for lost.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

from scaletrain.errors import ScaletrainError

PEER_LOST_EXIT = 76  # retry: a peer or host was lost; distinct from 2 (fix the input), 71 (OOM), 75 (preempted)
DONE = 1 << 40  # added to a finished rank's counter
log = logging.getLogger("scaletrain")


class PeerLost(ScaletrainError):
    """A peer rank or host was lost (killed, partitioned, hung): re-run the same command to resume."""

    exit_code = PEER_LOST_EXIT


def record_exit(code: int) -> None:
    """Write this rank's exit code to ``$SCALETRAIN_EXIT_FILE`` (set by launch.sh): torchrun and ``accelerate
    launch`` exit 1 whatever code a rank ended with, so launch.sh reads the code from there."""
    path = os.environ.get("SCALETRAIN_EXIT_FILE")
    if path:
        try:
            with open(path, "w") as f:
                f.write(f"{code}\n")
        except OSError:
            pass


def interval_for(timeout_s: float) -> float:
    """The heartbeat interval for a given staleness bound: a tenth of it, between 0.2 s and 2 s."""
    return max(0.2, min(2.0, timeout_s / 10.0))


def describe_lost(lost: list[int], table: list[tuple[str, int]], store_lost: bool = False) -> str:
    """``host1 (ranks [2, 3])`` for the lost ranks grouped by host (``table``: every rank's (host, pid))."""
    by_host: dict[str, list[int]] = {}
    for r in lost:
        by_host.setdefault(table[r][0], []).append(r)
    parts = [f"{h} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, sorted(rs)))})" for h, rs in by_host.items()]
    return ", ".join(parts)


class Heartbeat:
    """Counters in the rendezvous store; :meth:`poll` is the logic (a fake clock and store in the tests),
    :meth:`start` the daemon thread that beats, polls and ends the process on a loss."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, interval_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, prefix: str = "scaletrain/hb"):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s = float(timeout_s)
        self.interval_s = interval_s if interval_s is not None else interval_for(self.timeout_s)
        self.clock = clock
        self.keys = [f"{prefix}/{r}" for r in range(world_size)]
        now = clock()
        self.seen = [-1] * world_size  # last counter value read
        self.changed = [now] * world_size  # when it last moved (this rank's clock: no skew between hosts)
        self.store_ok = now  # the last time a store request went through
        self._made = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._threads: list[threading.Thread] = []

    # -- the logic ---------------------------------------------------------------------------------------
    def beat(self) -> None:
        self.store.add(self.keys[self.rank], 1)

    def read(self) -> list[int]:
        if not self._made:  # multi_get waits for missing keys: make every key exist (once)
            for k in self.keys:
                self.store.add(k, 0)
            self._made = True
        return [int(v) for v in self.store.multi_get(self.keys)]

    def poll(self) -> tuple[list[int], bool]:
        """One beat and one read. Returns (ranks whose counter has not moved for ``timeout_s``, whether the
        store itself has been unreachable that long)."""
        now = self.clock()
        try:
            self.beat()
            values = self.read()
        except Exception:  # noqa: BLE001 - unreachable store (rank 0's host gone or cut off), counted by time
            return [], now - self.store_ok >= self.timeout_s
        self.store_ok = now
        for r, v in enumerate(values):
            if v != self.seen[r]:
                self.seen[r], self.changed[r] = v, now
        lost = [r for r in range(self.world_size)
                if r != self.rank and self.seen[r] < DONE and now - self.changed[r] >= self.timeout_s]
        return lost, False

    def confirm(self, window_s: float | None = None, sleep: Callable[[float], None] = time.sleep) -> tuple[list[int], bool]:
        """After a collective failed: the ranks whose counters do not move during ``window_s`` (default: three
        intervals) -- alive ranks' threads keep beating -- and whether the store stayed unreachable."""
        window = window_s if window_s is not None else 3 * self.interval_s
        start = self.clock()
        try:
            base = self.read()
        except Exception:  # noqa: BLE001
            base = None
        while self.clock() - start < window:
            sleep(self.interval_s)
        try:
            now = self.read()
        except Exception:  # noqa: BLE001
            return [], True
        if base is None:
            return [], False
        return [r for r in range(self.world_size)
                if r != self.rank and now[r] < DONE and now[r] == base[r]], False

    def done(self) -> None:
        """This rank finished: its peers stop watching it; both threads stop and are joined, and the store
        connection is dropped here, not left to a thread still running at the interpreter's exit (a C++ store
        destroyed then aborts the process) or into the next job of the same process."""
        if self.store is None:  # already done
            return
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2 * self.interval_s + 5)  # a store request in flight ends within its own timeout
        self._threads = []
        try:
            self.store.add(self.keys[self.rank], DONE)
        except Exception:  # noqa: BLE001 - best effort at the end of a job
            pass
        self.store = None  # this rank's own connection, closed before the process group goes

    # -- the thread --------------------------------------------------------------------------------------
    def start(self, on_lost: Callable[[list[int], bool], None]) -> "Heartbeat":
        """Two daemon threads: one beats and reads (a store request to a host cut off from the network can
        block with no timeout), one watches the results and the age of the last request that went through."""
        self._lost: list[int] = []

        def beat():
            while not self._stop.wait(self.interval_s):
                lost, _ = self.poll()
                self._lost = lost

        def watch():
            while not self._stop.wait(self.interval_s):
                lost, store_lost = self._lost, self.clock() - self.store_ok >= self.timeout_s
                if (lost or store_lost) and not self._stop.is_set():
                    on_lost(lost, store_lost)
                    return

        self._thread = threading.Thread(target=beat, name="scaletrain-heartbeat", daemon=True)
        self._threads = [self._thread, threading.Thread(target=watch, name="scaletrain-heartbeat-watch", daemon=True)]
        for t in self._threads:
            t.start()
        return self


def lost_line(rank: int, lost: list[int], store_lost: bool, table: list[tuple[str, int]], timeout_s: float,
              resume_note: str, cause: str = "") -> str:
    """The one line a surviving rank prints when peers are lost."""
    if store_lost or not lost:
        who = f"{table[0][0]} (rank 0's host, which holds the rendezvous store) is unreachable"
    else:
        who = f"lost {describe_lost(lost, table)}"
    how = cause or f"no heartbeat for {timeout_s:g} s (engine.peer_timeout_s)"
    return (f"{who}: {how}; rank {rank} on {socket.gethostname()} stops (exit {PEER_LOST_EXIT}: retry); "
            f"{resume_note}")


def start_heartbeat(cfg, rank: int, world_size: int, table, resume_note: Callable[[], str]) -> Heartbeat | None:
    """The running heartbeat of this rank, or None (one process, ``engine.peer_timeout_s=0``, no store)."""
    import torch.distributed as dist

    timeout_s = float(cfg.engine.peer_timeout_s)
    if world_size == 1 or timeout_s <= 0 or not dist.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store().clone()  # its own connection: the main thread's requests are not delayed
    except Exception as e:  # noqa: BLE001 - a store without clone(): no lost-host watch, said once
        log.warning("no heartbeat (the rendezvous store cannot be shared: %s): a lost host stops the job after "
                    "engine.collective_timeout_minutes", e)
        return None
    interval = interval_for(timeout_s)
    try:
        store.set_timeout(timedelta(seconds=max(1.0, 2 * interval)))
    except Exception:  # noqa: BLE001
        pass
    # keys of this attempt alone, the same on every rank: rank 0's host and pid (every rank has the table).
    # Not TORCHELASTIC_RESTART_COUNT: a node that joins a running elastic job starts at 0 while the nodes it
    # joins are at 1 or more (torchrun's restart for a new node does not count), and the store may outlive
    # an attempt (torchrun's agent store), with its counters
    host0, pid0 = table[0]
    hb = Heartbeat(store, rank, world_size, timeout_s, interval, prefix=f"scaletrain/hb/{host0}-{pid0}")

    def on_lost(lost, store_lost):
        try:
            note = resume_note()
        except Exception:  # noqa: BLE001
            note = "re-run the same command to resume from the last checkpoint"
        print(f"scaletrain: error: {lost_line(rank, lost, store_lost, table, timeout_s, note)}", file=sys.stderr,
              flush=True)
        sys.stdout.flush()
        record_exit(PEER_LOST_EXIT)
        os._exit(PEER_LOST_EXIT)  # the main thread may be blocked in a collective nothing else interrupts

    return hb.start(on_lost)
