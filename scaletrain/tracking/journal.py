"""The local record of a run: ``<out_dir>/tracking/journal.jsonl`` and ``run.json``.

Every operation the tracker is asked to send is first appended to the journal as one JSON line (metrics
with the step and the timestamp they are sent with), and ``run.json`` names the run and the store; so
``scaletrain tracking sync`` (:mod:`scaletrain.tracking.sync`) can upload what an unreachable server
missed, the plots (:mod:`scaletrain.tracking.plots`) draw a job's curves without the server, and a
resumed job knows which steps it already logged (:func:`last_logged_step`). Each node's system-metrics
sampler keeps a journal of its own under ``tracking/system/<node>/``. :func:`checkpoint_list` keeps the
run's list of checkpoints (``tracking/artifacts/checkpoints.json``, uploaded as an artifact).

Record kinds (``"t"``): ``start`` / ``resume`` (``run_id``, ``uri``, ``ts``), ``m`` (``s`` step, ``ts``,
``v`` {key: value}), ``params`` / ``tags`` (``v``), ``artifact`` (``path``, ``dir``), ``end`` (``status``,
``ts``); datasets and logged models (:mod:`scaletrain.tracking.models`): ``inputs`` (``datasets``: [{``dataset``:
the MLflow dataset's fields, ``context``: the split}]), ``model`` (a checkpoint: ``key`` = its directory name,
``step``, ``name``, ``tags``, ``params``), ``model_tags`` (``key``, ``v``), ``model_metrics`` (``key``, ``s``,
``m`` [[metric, value, ts]], ``dataset`` {``name``, ``digest``}). Logged models are named by their checkpoint,
not by the id the server gives them, so replaying a record finds the model it made before. Plain JSON
lines: a torn last line (a crash mid-write) is skipped on reading, nothing else is lost.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

__all__ = ["JOURNAL", "RUN_FILE", "CHECKPOINTS_FILE", "Journal", "read_journal", "last_logged_step", "checkpoint_list",
           "now_ms"]

JOURNAL = "journal.jsonl"
RUN_FILE = "run.json"
CHECKPOINTS_FILE = "checkpoints.json"


def now_ms() -> int:
    """Wall-clock milliseconds, MLflow's timestamp unit."""
    return int(time.time() * 1000)


class Journal:
    """Append-only JSON lines in ``<local_dir>/journal.jsonl``: everything a tracker (or a node's system
    metrics sampler) was asked to send, written *before* it is sent; thread-safe, flushed per line."""

    def __init__(self, local_dir: str | os.PathLike):
        self.dir = Path(local_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / JOURNAL
        self._f = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def append(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False, allow_nan=True)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()

    def close(self) -> None:
        with self._lock:
            self._f.close()


def read_journal(path: str | os.PathLike) -> list[dict]:
    """The journal's records; a torn last line (a crash mid-write) is skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def last_logged_step(journal: str | os.PathLike) -> int:
    """The highest step with a metric record in the tracking journal (-1: none, or no journal)."""
    if not Path(journal).is_file():
        return -1
    return max((int(r["s"]) for r in read_journal(journal) if r.get("t") == "m" and "s" in r), default=-1)


def checkpoint_list(previous: str | os.PathLike | None, ckpt_dir: str | os.PathLike, step: int, run_id: str) -> dict:
    """The run's ``checkpoints.json`` with checkpoint ``ckpt_dir`` (written at ``step``) added: the list in
    ``previous`` (its local copy; missing or damaged: started afresh) plus this one, each with ``step``,
    ``path``, ``time`` and ``exists`` (false once ``keep_last`` pruned it)."""
    entries = []
    if previous is not None and Path(previous).is_file():
        try:
            entries = json.loads(Path(previous).read_text(encoding="utf-8")).get("checkpoints", [])
        except (ValueError, AttributeError):
            entries = []  # a damaged list is rebuilt from this checkpoint on
    path = str(Path(ckpt_dir).resolve())
    entries = [e for e in entries if e.get("path") != path]
    entries.append({"step": int(step), "path": path, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    for e in entries:
        e["exists"] = Path(e["path"]).is_dir()
    return {"run_id": run_id, "checkpoints": entries}
