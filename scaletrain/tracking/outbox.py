"""One run's way to the store: the journal and the sender as a pair, and the metric buffer in front of them.

The :class:`~scaletrain.tracking.tracker.Tracker` decides *what* a run records; an :class:`Outbox` makes
sure it gets there without the caller waiting: each operation is appended to the run's journal first (with
a ``local_dir``) and then queued for the background :class:`~scaletrain.tracking.sender.Sender`. Metric
values wait in a buffer and are handed over when it holds ``flush_every`` values, when ``flush_secs``
have passed since the last hand-over, and on :meth:`Outbox.flush` (the tracker also hands them over before
an artifact and at the end), so per-step logging costs a list append and a journal line.
:func:`execute_op` turns a queued operation into the MLflow client call, on the sender thread.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from scaletrain.tracking.journal import RUN_FILE, Journal, now_ms
from scaletrain.tracking.models import MODEL_RECORDS, apply_record
from scaletrain.tracking.sender import Sender
from scaletrain.tracking.store import MAX_METRICS_PER_BATCH, filled_run_name

log = logging.getLogger("scaletrain")

__all__ = ["Outbox", "execute_op"]


def execute_op(client, run_id: str, kind: str, payload: Any, models=None) -> None:
    """Perform one queued operation with ``client``: ``metrics`` (a list of ``Metric`` for ``run_id``);
    ``params`` / ``tags`` / ``artifact`` / ``text`` / ``dict`` / ``end``, each a tuple whose first item is
    the run id it was logged for; the journal records of datasets and logged models (``inputs``, ``model``,
    ``model_tags``, ``model_metrics``: (run id, record)), performed by
    :func:`scaletrain.tracking.models.apply_record` with ``models`` (a ``ModelIds``)."""
    if kind == "metrics":
        client.log_batch(run_id, metrics=payload)
        return
    run_id = payload[0]
    if kind in MODEL_RECORDS:
        apply_record(client, run_id, payload[1], models)
    elif kind == "params":
        client.log_batch(run_id, params=payload[1])
    elif kind == "tags":
        client.log_batch(run_id, tags=payload[1])
    elif kind == "artifact":
        _, path, artifact_path = payload
        if Path(path).is_dir():
            client.log_artifacts(run_id, path, artifact_path)
        else:
            client.log_artifact(run_id, path, artifact_path)
    elif kind == "text":
        client.log_text(run_id, payload[1], payload[2])
    elif kind == "dict":
        client.log_dict(run_id, payload[1], payload[2])
    elif kind == "end":
        filled_run_name(client, run_id)
        client.set_terminated(run_id, status=payload[1], end_time=payload[2])
    else:  # pragma: no cover
        raise AssertionError(kind)


class Outbox:
    """Journal, then send: ``execute(kind, payload)`` (run on the sender thread) performs each operation;
    ``local_dir`` (training: ``<out_dir>/tracking``) holds the journal and ``run.json``, None for no journal.
    The sender is started when the run opens (:meth:`open`) and again by :meth:`send` if an earlier
    :meth:`finish` let it stop."""

    def __init__(self, execute: Callable[[str, Any], None], *, local_dir: str | os.PathLike | None = None,
                 flush_every: int = 200, flush_secs: float = 30.0, max_backoff: float = 30.0,
                 max_queued: int = 1_000_000):
        self._execute = execute
        self.local_dir = Path(local_dir) if local_dir is not None else None
        self.flush_every = max(1, int(flush_every))
        self.flush_secs = float(flush_secs)
        self.max_backoff = float(max_backoff)
        self.max_queued = int(max_queued)
        self.journal: Journal | None = None
        self.sender: Sender | None = None
        self._buffer: list = []
        self._last_flush = time.monotonic()

    def open(self, event: str, info: dict) -> None:
        """The run is known (``event``: ``start`` or ``resume``; ``info``: ``uri``, ``run_id``, ...): write
        ``run.json``, journal the event, start the sender."""
        if self.local_dir is not None:
            if self.journal is None:
                self.journal = Journal(self.local_dir)
            from scaletrain.fileio import atomic_write_text

            atomic_write_text(self.local_dir / RUN_FILE, json.dumps(info, indent=2) + "\n")
            self.journal.append({"t": event, "run_id": info["run_id"], "uri": info["uri"], "ts": now_ms()})
        self._sender()

    def _sender(self) -> Sender:
        if self.sender is None or not self.sender.is_alive():
            self.sender = Sender(self._execute, max_backoff=self.max_backoff, max_queued=self.max_queued)
        return self.sender

    def record(self, record: dict) -> None:
        """Append ``record`` to the journal (nothing without one)."""
        if self.journal is not None:
            self.journal.append(record)

    def send(self, kind: str, payload: Any, size: int = 1) -> int:
        """Queue an operation for the sender thread; returns its sequence number."""
        return self._sender().submit(kind, payload, size=size)

    def add_metrics(self, metrics: list) -> None:
        """Buffer ``metrics`` (MLflow ``Metric``s, already journaled); hand the buffer over when it is due."""
        self._buffer.extend(metrics)
        if len(self._buffer) >= self.flush_every or time.monotonic() - self._last_flush >= self.flush_secs:
            self.submit_metrics()

    def submit_metrics(self) -> None:
        """Hand the buffered metric values to the sender now (in requests of at most 1000)."""
        self._last_flush = time.monotonic()
        if not self._buffer:
            return
        buf, self._buffer = self._buffer, []
        for i in range(0, len(buf), MAX_METRICS_PER_BATCH):
            chunk = buf[i : i + MAX_METRICS_PER_BATCH]
            self.send("metrics", chunk, size=len(chunk))

    def flush(self, timeout: float | None) -> bool:
        """Hand the buffer over and wait up to ``timeout`` seconds (None: no limit) for everything queued."""
        self.submit_metrics()
        if self.sender is None:
            return True
        return self.sender.wait(timeout=timeout)

    @property
    def pending(self) -> int:
        """Metric values logged but not yet written to the store."""
        return len(self._buffer) + (self.sender.in_flight if self.sender is not None else 0)

    @property
    def failing(self) -> bool:
        """The sender is retrying: the server did not answer its last request."""
        return bool(self.sender is not None and self.sender.failing)

    def finish(self, run_id: str, timeout: float) -> bool:
        """After the run's last operation: wait at most ``timeout`` s for the sender, then end its thread (or
        abandon what it could not send: the journal keeps it) and join it (:meth:`Sender.stop`: a few seconds
        at most), and close the journal. True if the store got everything."""
        ok = self.sender.wait(timeout=timeout)
        where = f" {self.local_dir.parent}" if self.local_dir is not None else ""
        if ok and self.sender.dropped:
            ok = False
            log.warning("tracking: %d metric values of run %s were kept only in the journal during the outage; "
                        "`scaletrain tracking sync%s` uploads them", self.sender.dropped, run_id, where)
            self.sender.stop()
        elif ok:
            self.sender.stop()
        else:
            self.sender.stop(abandon=True)
            log.warning("tracking: MLflow run %s did not get everything before the end (%s); %s", run_id,
                        self.sender.last_error,
                        f"`scaletrain tracking sync{where}` uploads it" if where else "it is lost")
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        return ok
