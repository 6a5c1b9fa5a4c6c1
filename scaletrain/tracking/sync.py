"""``scaletrain tracking sync RUN_DIR``: upload to MLflow what the tracking server missed.

Training appends every metric, param, tag, artifact and the end status to ``RUN_DIR/tracking/journal.jsonl``
before sending it (:mod:`scaletrain.tracking.journal`), and each node's system metrics to
``tracking/system/<node>/journal.jsonl``. :func:`sync_run` sends whatever is not on the server yet, matching
metrics by (key, step, timestamp) so nothing is sent twice, the run's dataset inputs and its checkpoints'
logged models (found by their checkpoint, never made twice: :mod:`scaletrain.tracking.models`), and
applies a pending end status.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from scaletrain.errors import ScaletrainError
from scaletrain.tracking.journal import JOURNAL, RUN_FILE, read_journal
from scaletrain.tracking.models import MODEL_RECORDS, ModelIds, apply_record
from scaletrain.tracking.store import MAX_METRICS_PER_BATCH, MAX_PARAMS_PER_BATCH, fast_failing_http, tracking_client

log = logging.getLogger("scaletrain")

__all__ = ["SyncReport", "sync_run"]


@dataclass
class SyncReport:
    """What :func:`sync_run` did for one run of the journal."""

    run_id: str
    metrics_sent: int
    metrics_present: int
    artifacts: int
    status: str | None  # the status applied, None if nothing to apply
    datasets: int = 0  # dataset inputs the run did not have
    models: int = 0  # checkpoints' logged models created
    model_updates: int = 0  # logged models' tags and linked metric values sent


def sync_run(run_dir: str | os.PathLike, uri: str | None = None) -> list[SyncReport]:
    """Upload what a run's server missed from ``run_dir`` (a training output directory holding
    ``tracking/``, or that ``tracking`` directory itself): metrics not on the server (matched by key, step
    and timestamp, so running it twice sends nothing twice), params, tags, artifacts, and the end status
    if the journal's last event for the run is its end; and the system metrics each node journaled in
    ``tracking/system/<node>/journal.jsonl``. ``uri`` overrides the one in ``run.json``."""
    d = Path(run_dir)
    tdir = d if (d / RUN_FILE).is_file() else d / "tracking"
    if not (tdir / RUN_FILE).is_file() or not (tdir / JOURNAL).is_file():
        raise ScaletrainError(f"tracking sync: {d} has no tracking/{RUN_FILE} and tracking/{JOURNAL} "
                              "(is it the out_dir of a training run with tracking enabled?)")
    info = json.loads((tdir / RUN_FILE).read_text())
    target = uri or info["uri"]
    fast_failing_http(target)
    client = tracking_client(target)
    by_run: dict[str, dict] = {}
    cur = info["run_id"]
    for rec in read_journal(tdir / JOURNAL):
        t = rec.get("t")
        if t in ("start", "resume"):
            cur = rec["run_id"]
        r = by_run.setdefault(cur, {"m": [], "params": {}, "tags": {}, "artifacts": [], "records": [], "last": None})
        if t == "m":
            r["m"].extend((k, v, rec["ts"], rec["s"]) for k, v in rec["v"].items())
        elif t == "params":
            r["params"].update(rec["v"])
        elif t == "tags":
            r["tags"].update(rec["v"])
        elif t == "artifact":
            r["artifacts"].append((rec["path"], rec.get("dir")))
        elif t in MODEL_RECORDS:
            r["records"].append(rec)
        if t in ("start", "resume", "end"):
            r["last"] = rec
    for sys_journal in sorted((tdir / "system").glob(f"*/{JOURNAL}")):  # scaletrain.tracking.system_metrics, per node
        for rec in read_journal(sys_journal):
            if rec.get("t") == "m" and rec.get("run_id") in by_run:
                by_run[rec["run_id"]]["m"].extend((k, v, rec["ts"], rec["s"]) for k, v in rec["v"].items())
    reports = []
    for run_id, r in by_run.items():
        try:
            reports.append(_sync_one(client, run_id, r))
        except ScaletrainError:
            raise
        except Exception as e:  # noqa: BLE001 - the server is down or refused: nothing is lost, run it again
            raise ScaletrainError(f"tracking sync: run {run_id} at {target}: "
                                  f"{str(e).splitlines()[0] if str(e) else type(e).__name__} "
                                  "(nothing is lost: the journal stays; run sync again)") from None
    return reports


def send_missing_metrics(client, run_id: str, metrics: list[tuple]) -> tuple[int, int]:
    """Send the ``(key, value, timestamp, step)`` points the run does not have on the server (matched by key,
    step and timestamp: nothing twice); returns (sent, already there)."""
    from mlflow.entities import Metric

    missing, present = [], 0
    for key in sorted({m[0] for m in metrics}):
        have = {(m.step, m.timestamp) for m in client.get_metric_history(run_id, key)}
        for k, v, ts, s in (m for m in metrics if m[0] == key):
            if (s, ts) in have:
                present += 1
            else:
                have.add((s, ts))
                missing.append(Metric(k, v, ts, s))
    for i in range(0, len(missing), MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=missing[i : i + MAX_METRICS_PER_BATCH])
    return len(missing), present


def send_journaled_steps(client, run_id: str, journal: str | os.PathLike, after: int, until: int) -> int:
    """A resumed job's re-done steps ``after+1 .. until`` are not logged again (``Tracker.replaying_until``): send what
    the journal has of them and the server lacks (a session killed before its sender delivered them).
    Returns the points sent."""
    points = [(k, v, rec["ts"], rec["s"]) for rec in read_journal(journal)
              if rec.get("t") == "m" and after < int(rec.get("s", -1)) <= until for k, v in rec["v"].items()]
    return send_missing_metrics(client, run_id, points)[0] if points else 0


def _sync_one(client, run_id: str, r: dict) -> SyncReport:
    from mlflow.entities import Param, RunTag

    run = client.get_run(run_id)
    n_missing, present = send_missing_metrics(client, run_id, r["m"])
    params = [Param(k, v) for k, v in r["params"].items() if k not in run.data.params]
    for i in range(0, len(params), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=params[i : i + MAX_PARAMS_PER_BATCH])
    tags = [RunTag(k, v) for k, v in r["tags"].items() if run.data.tags.get(k) != v]
    for i in range(0, len(tags), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, tags=tags[i : i + MAX_PARAMS_PER_BATCH])
    n_art = 0
    for path, adir in r["artifacts"]:
        p = Path(path)
        if not p.exists():
            log.warning("tracking sync: artifact %s is gone, skipped", p)
            continue
        (client.log_artifacts if p.is_dir() else client.log_artifact)(run_id, str(p), adir)
        n_art += 1
    counts = _sync_models(client, run_id, r["records"])
    applied = None
    last = r["last"]
    if last is not None and last["t"] == "end" and run.info.status != last["status"]:
        client.set_terminated(run_id, status=last["status"], end_time=last["ts"])
        applied = last["status"]
    return SyncReport(run_id, n_missing, present, n_art, applied, datasets=counts["inputs"], models=counts["model"],
                      model_updates=counts["model_tags"] + counts["model_metrics"])


def _sync_models(client, run_id: str, records: list[dict]) -> dict[str, int]:
    """Replay the run's dataset and logged-model records (each idempotent); how many of each sent something.
    A server without those APIs (MLflow 2) gets a warning, not a failed sync."""
    from mlflow.exceptions import MlflowException

    counts = {"inputs": 0, "model": 0, "model_tags": 0, "model_metrics": 0}
    models, tags = ModelIds(), {}
    try:
        for rec in records:  # in journal order: a model before its metrics; each model's tags as they ended
            if rec["t"] == "model_tags":
                tags.setdefault(rec["key"], {}).update(rec["v"])
            else:
                counts[rec["t"]] += apply_record(client, run_id, rec, models)
        for key, v in tags.items():
            counts["model_tags"] += apply_record(client, run_id, {"t": "model_tags", "key": key, "v": v}, models)
    except MlflowException as e:
        if e.error_code != "ENDPOINT_NOT_FOUND":
            raise
        log.warning("tracking sync: run %s: the server has no dataset or logged-model API (an MLflow before 3?); "
                    "its datasets and checkpoint models were not sent", run_id)
    return counts
