"""The background thread that sends a run's operations to MLflow, retrying while the server is down.

The training thread (or a node's system-metrics sampler) never waits for the network: it hands each
operation to a :class:`Sender`, which sends them in order, merges consecutive metric batches into requests
of up to 1000 values, retries an operation that failed for an outage (connection refused, timeouts, 5xx)
with exponential backoff (one warning when the server is lost, one line when it is back) and drops one
the server refused for good (a bad value, a deleted run). Memory is bounded: in a long outage the oldest
queued metric batches are dropped from memory, and only the journal (:mod:`scaletrain.tracking.journal`)
keeps them for ``scaletrain tracking sync``. Written here because a training step must never wait for the
network and an outage must lose nothing (MLflow's own ``SystemMetricsMonitor``, for one, stops for good
after one failed call).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

from scaletrain.tracking.store import MAX_METRICS_PER_BATCH

log = logging.getLogger("scaletrain")

__all__ = ["Sender", "PERMANENT_ERRORS", "JOIN_TIMEOUT"]

JOIN_TIMEOUT = 2.0  # seconds the end of a job waits for a sender thread to finish, after its last request

PERMANENT_ERRORS = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS", "BAD_REQUEST",
                    "INVALID_STATE", "PERMISSION_DENIED", "UNAUTHENTICATED",
                    "ENDPOINT_NOT_FOUND"}  # MLflow error codes: no retry (the last: a server without that API)


def _permanent(e: BaseException) -> bool:
    """An error that retrying cannot fix (a bad value, a deleted run); anything else (connection refused,
    timeouts, 5xx) is an outage and is retried."""
    return getattr(e, "error_code", None) in PERMANENT_ERRORS


class Sender(threading.Thread):
    """Sends operations to MLflow in order, off the training thread. An operation that fails for an outage
    is retried with exponential backoff (``min_backoff`` doubling up to ``max_backoff`` seconds) until it
    succeeds; one warning when the server is lost, one line when it is back. Consecutive metric batches
    are merged into requests of up to 1000 values. At most ``max_queued`` metric values wait in memory: in
    a long outage the oldest queued batches are dropped from memory (one warning; ``dropped`` counts them)
    and only the journal keeps them, for ``scaletrain tracking sync``.

    ``execute(kind, payload)`` performs one operation (raising on failure); it runs on this thread. The
    thread starts at construction; ``close()`` lets it end once the queue is empty, ``abandon()`` at once."""

    def __init__(self, execute: Callable[[str, Any], None], *, min_backoff: float = 0.5, max_backoff: float = 30.0, name: str = "",
                 max_queued: int = 1_000_000):
        super().__init__(name=f"scaletrain-tracking{name}", daemon=True)
        self._execute = execute
        self.min_backoff, self.max_backoff = min_backoff, max_backoff
        self._ops: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._submitted = 0
        self._done = 0
        self._closing = False
        self._abandon = False
        self.max_queued = max(1, int(max_queued))
        self._queued_metrics = 0
        self.dropped = 0
        self.failing = False
        self.warned = False
        self.last_error: str | None = None
        self.start()

    def submit(self, kind: str, payload: Any, size: int = 1) -> int:
        """Queue an operation (``size``: its number of metric values); returns its sequence number."""
        with self._cv:
            self._submitted += 1
            self._ops.append((self._submitted, kind, payload, size))
            if kind == "metrics":
                self._queued_metrics += size
                self._shed()
            self._cv.notify_all()
            return self._submitted

    def _shed(self) -> None:
        """Drop the oldest queued metric batches (never the head, which may be in flight) above the cap."""
        i = 1
        while self._queued_metrics > self.max_queued and i < len(self._ops):
            if self._ops[i][1] != "metrics":
                i += 1
                continue
            size = self._ops[i][3]
            del self._ops[i]
            self._queued_metrics -= size
            if not self.dropped:
                log.warning("tracking: more than %d metric values are waiting for the MLflow server; the oldest "
                            "are now kept only in the run directory's tracking journal: run `scaletrain tracking "
                            "sync RUN_DIR` when the server is back", self.max_queued)
            self.dropped += size

    @property
    def in_flight(self) -> int:
        with self._cv:
            return self._queued_metrics

    def wait(self, seq: int | None = None, timeout: float | None = None) -> bool:
        """Block until operation ``seq`` (default: everything submitted so far) is sent; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            target = self._submitted if seq is None else seq
            while self._done < target:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()

    def _take(self):
        """The head operation, with the following metric batches merged into it (not yet removed)."""
        seq, kind, payload, size = self._ops[0]
        if kind != "metrics":
            return 1, seq, kind, payload
        merged, n, last = list(payload), 1, seq
        for s2, k2, p2, _ in list(self._ops)[1:]:
            if k2 != "metrics" or len(merged) + len(p2) > MAX_METRICS_PER_BATCH:
                break
            merged.extend(p2)
            n, last = n + 1, s2
        return n, last, kind, merged

    def run(self) -> None:
        backoff = self.min_backoff
        while True:
            with self._cv:
                while not self._ops and not self._closing:
                    self._cv.wait()
                if not self._ops:
                    return
                n, last, kind, payload = self._take()
            try:
                self._execute(kind, payload)
            except Exception as e:  # noqa: BLE001 - any failure: keep training, retry or drop
                msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                self.last_error = msg
                if not _permanent(e):
                    if not self.warned:
                        self.warned = True
                        log.warning("tracking: MLflow server unreachable (%s); training continues, metrics are "
                                    "kept in the run directory and sent when it is back (retrying with backoff up "
                                    "to %.0f s)", msg, self.max_backoff)
                    self.failing = True
                    with self._cv:
                        if self._closing and self._abandon:
                            return
                        self._cv.wait(backoff)
                    backoff = min(backoff * 2, self.max_backoff)
                    continue
                log.warning("tracking: MLflow refused a %s request, dropped (%s)", kind, msg)
            else:
                if self.failing:
                    log.warning("tracking: MLflow server reachable again; sending what it missed")
                self.failing = False
                backoff = self.min_backoff
            with self._cv:
                for _ in range(n):
                    op = self._ops.popleft()
                    if op[1] == "metrics":
                        self._queued_metrics -= op[3]
                # everything submitted is sent or (shed) dropped when the queue is empty
                self._done = last if self._ops else self._submitted
                self._cv.notify_all()

    def abandon(self) -> None:
        """Stop retrying (the process is ending; the journal keeps what was not sent)."""
        with self._cv:
            self._abandon = True
            self._closing = True
            self._cv.notify_all()

    def stop(self, abandon: bool = False, timeout: float = JOIN_TIMEOUT) -> bool:
        """End the thread and join it, waiting at most ``timeout`` s: :meth:`close` (it ends once the queue is
        empty) or, with ``abandon``, :meth:`abandon` (it ends as soon as a request in flight returns: a
        refused connection at once, an unanswered one after ``MLFLOW_HTTP_REQUEST_TIMEOUT``). True if it
        ended; otherwise, a daemon thread, it cannot hold up the interpreter's exit."""
        self.abandon() if abandon else self.close()
        if self is not threading.current_thread():
            self.join(timeout)
        return not self.is_alive()
