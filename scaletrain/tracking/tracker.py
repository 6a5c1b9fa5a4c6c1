"""The tracker: the rank-0 API a training job records its MLflow run with. Other ranks get a no-op one.

Creating or resuming the run talks to the store directly (the run id is needed at once); the store, its
URI and the run's name are :mod:`scaletrain.tracking.store`'s. Everything after that (params, tags,
metrics, artifacts, the end status) goes through the run's :class:`~scaletrain.tracking.outbox.Outbox`:
journaled first, with ``local_dir`` (training uses ``<out_dir>/tracking``), then sent by a background
thread that retries with backoff while the server is down (one warning) and sends the backlog when it is
back; metric values are buffered and handed over in batches. So the training thread never waits for the
network, and ``scaletrain tracking sync RUN_DIR`` (:mod:`scaletrain.tracking.sync`) uploads what the
server missed.

The run id lives on rank 0; :func:`broadcast_run_id` (or :meth:`Tracker.sync_run_id`, a collective every
rank must call) sends it to the other ranks when a ``torch.distributed`` process group is initialised.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from scaletrain.errors import ScaletrainError
from scaletrain.tracking.checkpoint_models import CheckpointModels
from scaletrain.tracking.journal import CHECKPOINTS_FILE, checkpoint_list, last_logged_step, now_ms
from scaletrain.tracking.models import ModelIds
from scaletrain.tracking.outbox import Outbox, execute_op
from scaletrain.tracking.store import (DEFAULT_EXPERIMENT, MAX_PARAMS_PER_BATCH, MAX_TAG_VAL, RUN_ID_FIELD, create_run,
                                       experiment_id, fast_failing_http, flatten_params, reopen_run,
                                       resolve_tracking_uri, safe_key, server_unreachable, tracking_client)

log = logging.getLogger("scaletrain")

__all__ = ["Tracker", "broadcast_run_id"]


def _dist_ready() -> bool:
    try:
        import torch.distributed as dist
    except Exception:  # pragma: no cover - torch without distributed
        return False
    return dist.is_available() and dist.is_initialized()


def broadcast_run_id(run_id: str | None, is_main: bool) -> str | None:
    """Send rank 0's run id to every rank (``broadcast_object_list``); identity without a process group.

    Collective: every rank must call it. ``is_main`` must be true exactly on global rank 0."""
    if not _dist_ready():
        return run_id
    import torch.distributed as dist

    if is_main != (dist.get_rank() == 0):
        raise ScaletrainError(
            f"broadcast_run_id: is_main={is_main} on global rank {dist.get_rank()}; the tracker's main process "
            "must be global rank 0"
        )
    obj = [run_id if is_main else None]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


class Tracker:
    """MLflow run handle, created on every rank; only ``is_main`` writes.

    Usage (every rank)::

        tr = Tracker(cfg.tracking.uri, cfg.tracking.experiment, run_name, is_main, project_dir,
                     local_dir=out_dir / "tracking")
        tr.start(params=config_dict, tags={...})   # or tr.resume(run_id) after a restart
        tr.sync_run_id()                           # collective: all ranks learn the id
        tr.log_metrics({"train/loss": 2.3}, step)
        tr.end("FINISHED")

    With ``local_dir``, every operation is first appended to ``local_dir/journal.jsonl`` (metrics with the
    timestamp they are sent with) and the run's identity is in ``local_dir/run.json``. Metric values are
    handed to the sender when ``flush_every`` of them wait, when ``flush_secs`` have passed since the last
    hand-over, and on ``flush()``, ``log_artifact``, ``end()``. ``end()`` waits at most ``end_timeout``
    seconds for the sender.
    """

    def __init__(
        self,
        uri: str | None,
        experiment: str = DEFAULT_EXPERIMENT,
        run_name: str | None = None,
        is_main: bool = True,
        project_dir: str | os.PathLike = ".",
        *,
        flush_every: int = 200,
        flush_secs: float = 30.0,
        local_dir: str | os.PathLike | None = None,
        end_timeout: float = 30.0,
        max_backoff: float = 30.0,
        max_queued: int = 1_000_000,
    ):
        if not experiment or not isinstance(experiment, str):
            raise ScaletrainError(f"tracking: experiment name must be a non-empty string, got {experiment!r}")
        self.is_main = bool(is_main)
        self.replay_until = -1  # metrics at steps up to this one were logged before a restart (replaying_until)
        self.project_dir = Path(project_dir)
        self.uri = resolve_tracking_uri(uri, project_dir)
        self.experiment = experiment
        self.run_name = run_name
        self.local_dir = Path(local_dir) if local_dir is not None else None
        self.end_timeout = float(end_timeout)
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._client_obj = None
        self._ended = False
        self.models = ModelIds()  # the checkpoints' logged models on the server (the sender thread's)
        self.checkpoint_models: CheckpointModels | None = None  # set: each checkpoint is a logged model
        self._last: dict[str, tuple[int, int, float]] = {}  # metric key -> last (step, timestamp, value)
        self.outbox = Outbox(self._execute, local_dir=self.local_dir, flush_every=flush_every, flush_secs=flush_secs,
                             max_backoff=max_backoff, max_queued=max_queued)
        if self.is_main:
            fast_failing_http(self.uri)

    # ---- store ---------------------------------------------------------------------------------
    @property
    def client(self):
        if not self.is_main:
            raise ScaletrainError("tracking: only the main process may talk to MLflow")
        if self._client_obj is None:
            if self.uri.startswith("sqlite:///"):
                Path(self.uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
            try:
                self._client_obj = tracking_client(self.uri)
            except Exception as e:
                raise ScaletrainError(f"tracking: cannot open MLflow store {self.uri!r}: {e}") from e
        return self._client_obj

    @property
    def flush_every(self) -> int:
        """Buffered metric values that make a batch for the sender."""
        return self.outbox.flush_every

    @flush_every.setter
    def flush_every(self, n: int) -> None:
        self.outbox.flush_every = max(1, int(n))

    def _require_run(self, what: str) -> str:
        if self.run_id is None:
            raise ScaletrainError(f"tracking: {what} before start() or resume()")
        return self.run_id

    def _open(self, event: str) -> None:
        """The run id is known: ``run.json``, the journal's start/resume record, the sender."""
        self.outbox.open(event, {"uri": self.uri, "run_id": self.run_id, "experiment_id": self.experiment_id,
                                 "experiment": self.experiment, "run_name": self.run_name})

    def _execute(self, kind: str, payload: Any) -> None:
        """Runs on the sender thread."""
        execute_op(self.client, self.run_id, kind, payload, self.models)

    # ---- lifecycle -----------------------------------------------------------------------------
    def unreachable(self, timeout: float = 5.0) -> str | None:
        """Why an ``http(s)://`` tracking server does not answer within ``timeout`` seconds, or None
        (:func:`~scaletrain.tracking.store.server_unreachable`)."""
        return server_unreachable(self.uri, timeout)

    def start(self, params: Mapping[str, Any] | Any | None = None, tags: Mapping[str, Any] | None = None) -> str | None:
        """Create the run (main rank); log ``params`` (nested config, flattened with dotted keys) and
        ``tags``. Returns the run id (None on other ranks until :meth:`sync_run_id`)."""
        if not self.is_main:
            return None
        if self.run_id is not None:
            raise ScaletrainError(f"tracking: run {self.run_id} already started")
        if why := self.unreachable():  # nothing is lost yet: say so now, not after minutes of retries
            raise ScaletrainError(
                f"tracking server {self.uri} is unreachable at the start of the job ({why}); start it, or train "
                "with a local store (tracking.uri=sqlite:///mlruns.db) or tracking.enabled=false")
        if self.experiment_id is None:
            self.experiment_id = experiment_id(self.client, self.experiment, self.uri, self.project_dir)
        self.run_id, self.run_name = create_run(self.client, self.experiment_id, self.run_name, tags or {})
        self._ended = False
        self._open("start")
        if params is not None:
            self.log_params(params)
        return self.run_id

    def resume(self, run_id: str) -> str | None:
        """Continue logging into an existing run (e.g. after restarting from a checkpoint)."""
        if not self.is_main:
            self.run_id = run_id
            return run_id
        if why := self.unreachable():
            # a resumed job (e.g. requeued after preemption) must not wait for the server: the run exists
            # there already, so everything goes to the journal and the sender delivers it when it is back
            log.warning("tracking server %s unreachable at resume (%s): training continues; run %s gets "
                        "the metrics when the server is back (or by `scaletrain tracking sync`)",
                        self.uri, why, run_id)
            self.run_id, self._ended = run_id, False
            if self.run_name:  # the server has the name; a default one is known from the id
                self.run_name = self.run_name.replace(RUN_ID_FIELD, run_id[:6])
            self._open("resume")
            return self.run_id
        self.run_id, self.run_name, self.experiment_id = reopen_run(self.client, run_id, self.uri)
        self._ended = False
        self._open("resume")
        return self.run_id

    def sync_run_id(self) -> str | None:
        """Collective: give every rank the main rank's run id (no-op without a process group)."""
        self.run_id = broadcast_run_id(self.run_id, self.is_main)
        return self.run_id

    def end(self, status: str = "FINISHED", timeout: float | None = None) -> bool:
        """Mark the run FINISHED / FAILED / KILLED after everything logged before. Waits at most ``timeout``
        (default ``end_timeout``) seconds for the server; returns False if it did not get everything (the
        journal keeps it for ``scaletrain tracking sync``)."""
        if not self.is_main or self.run_id is None or self._ended:
            return True
        status = status.upper()
        if status not in ("FINISHED", "FAILED", "KILLED"):
            raise ScaletrainError(f"tracking: end(status) must be FINISHED, FAILED or KILLED, got {status!r}")
        self.outbox.submit_metrics()
        ts = now_ms()
        self.outbox.record({"t": "end", "status": status, "ts": ts})
        self.outbox.send("end", (self.run_id, status, ts))
        self._ended = True
        return self.outbox.finish(self.run_id, self.end_timeout if timeout is None else timeout)

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.end("FINISHED")
        else:
            self.end("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")

    # ---- logging -------------------------------------------------------------------------------
    def log_params(self, params: Mapping[str, Any] | Any) -> None:
        if not self.is_main:
            return
        from mlflow.entities import Param

        run_id = self._require_run("log_params")
        flat = flatten_params(params)
        self.outbox.record({"t": "params", "v": flat})
        items = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self.outbox.send("params", (run_id, items[i : i + MAX_PARAMS_PER_BATCH]))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if not self.is_main:
            return
        from mlflow.entities import RunTag

        run_id = self._require_run("set_tags")
        flat = {safe_key(k): str(v)[:MAX_TAG_VAL] for k, v in tags.items()}
        self.outbox.record({"t": "tags", "v": flat})
        items = [RunTag(k, v) for k, v in flat.items()]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self.outbox.send("tags", (run_id, items[i : i + MAX_PARAMS_PER_BATCH]))

    def replaying_until(self, journal: Path, resumed_step: int) -> None:
        """The job resumed at ``resumed_step`` after a crash: the steps after it up to the last one ``journal``
        recorded before this session are trained again, bit-identically, so their metrics are already in the run
        and :meth:`log_metrics` drops them (every step's metrics are in the run exactly once)."""
        last = last_logged_step(journal)
        if last > resumed_step:
            self.replay_until = last
            if self.is_main:
                log.info("steps %d-%d were logged before the restart: their metrics are not logged again",
                         resumed_step + 1, last)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record ``metrics`` (numbers, 0-d tensors/arrays) at ``step``: one journal line now, sent in
        batches by the background thread; nothing at a step already logged before a restart
        (:meth:`replaying_until`)."""
        if not self.is_main or step <= self.replay_until:
            return
        from mlflow.entities import Metric

        self._require_run("log_metrics")
        ts = now_ms()
        vals = {}
        for k, v in metrics.items():
            try:
                val = float(v.item() if hasattr(v, "item") else v)
            except (TypeError, ValueError):
                raise ScaletrainError(f"tracking: metric {k!r} has a non-numeric value {v!r:.100}") from None
            vals[safe_key(k)] = val
        self.outbox.record({"t": "m", "s": int(step), "ts": ts, "v": vals})
        self.outbox.add_metrics([Metric(k, v, ts, int(step)) for k, v in vals.items()])
        self._last.update((k, (int(step), ts, v)) for k, v in vals.items())

    def flush(self, timeout: float | None = None) -> bool:
        """Hand the buffered metrics to the sender and wait up to ``timeout`` seconds (default
        ``end_timeout``; 0: do not wait) for everything logged so far. Returns whether all of it reached
        the store (False: it is still queued, and in the journal)."""
        if not self.is_main or self.run_id is None:
            return True
        return self.outbox.flush(self.end_timeout if timeout is None else timeout)

    @property
    def pending(self) -> int:
        """Metric values logged but not yet written to the store."""
        return self.outbox.pending

    @property
    def server_failing(self) -> bool:
        return self.outbox.failing

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Upload a file or a directory (recursively) to the run's artifacts (in the background)."""
        if not self.is_main:
            return
        run_id = self._require_run("log_artifact")
        p = Path(path)
        if not p.exists():
            raise ScaletrainError(f"tracking: log_artifact: {p} does not exist")
        self.outbox.submit_metrics()
        self.outbox.record({"t": "artifact", "path": str(p.resolve()), "dir": artifact_path})
        self.outbox.send("artifact", (run_id, str(p), artifact_path))

    def log_input(self, dataset: Mapping[str, Any], context: str) -> None:
        """Log a dataset (:func:`scaletrain.tracking.datasets.corpus_dataset`) as an input of the run, read as
        split ``context`` (journaled, sent in the background; the store keeps one input per dataset)."""
        if not self.is_main:
            return
        self._model_record({"t": "inputs", "datasets": [{"dataset": dict(dataset), "context": str(context)}]})

    def _model_record(self, rec: dict) -> None:
        """Journal a dataset / logged-model record and queue it (after the metrics logged before it)."""
        run_id = self._require_run(rec["t"])
        self.outbox.submit_metrics()
        self.outbox.record(rec)
        self.outbox.send(rec["t"], (run_id, rec))

    def log_checkpoint(self, ckpt_dir: str | os.PathLike, step: int) -> None:
        """Add a written checkpoint to the run's ``checkpoints.json`` artifact (every checkpoint of the job,
        resumed sessions included: ``step``, ``path``, ``time``, and ``exists``, false once ``keep_last``
        pruned it). Written in ``local_dir/artifacts`` and uploaded in the background: never waits. With
        :attr:`checkpoint_models` set, the checkpoint is also a logged model of the run, its validation
        metrics linked to it, the models of deleted checkpoints and the best one tagged
        (:mod:`scaletrain.tracking.models`)."""
        if not self.is_main or self.run_id is None:
            return
        dest = self._local_artifact(CHECKPOINTS_FILE)
        data = checkpoint_list(dest, ckpt_dir, step, self.run_id)
        if self.checkpoint_models is not None:
            entries = data["checkpoints"]
            new = next(e for e in entries if e["path"] == str(Path(ckpt_dir).resolve()))
            for rec in self.checkpoint_models.records(entries, new, self._last):
                self._model_record(rec)
        if dest is None:
            self.outbox.send("dict", (self.run_id, data, CHECKPOINTS_FILE))
            return
        from scaletrain.fileio import atomic_write_text

        atomic_write_text(dest, json.dumps(data, indent=2) + "\n")
        self.log_artifact(dest)

    def _local_artifact(self, artifact_file: str) -> Path | None:
        if self.local_dir is None:
            return None
        dest = self.local_dir / "artifacts" / artifact_file
        dest.parent.mkdir(parents=True, exist_ok=True)
        return dest

    def _artifact_dest(self, what: str, kind: str, data: Any, artifact_file: str) -> Path | None:
        """Where ``artifact_file`` is written before its upload (``local_dir/artifacts``); without a
        ``local_dir`` the operation (``kind``, ``data``) is queued for the sender as it is, and None returned."""
        run_id = self._require_run(what)
        dest = self._local_artifact(artifact_file)
        if dest is None:
            self.outbox.send(kind, (run_id, data, artifact_file))
        return dest

    def log_dict(self, data: Mapping[str, Any] | Sequence, artifact_file: str) -> None:
        """Store ``data`` as a JSON (``.json``) or YAML (``.yaml``/``.yml``) artifact."""
        if not self.is_main or self._artifact_dest("log_dict", "dict", data, artifact_file) is None:
            return
        if artifact_file.endswith((".yaml", ".yml")):
            import yaml

            text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
        else:
            text = json.dumps(data, indent=2, ensure_ascii=False)
        self.log_text(text, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` as the artifact ``artifact_file``."""
        if not self.is_main:
            return
        dest = self._artifact_dest("log_text", "text", text, artifact_file)
        if dest is None:
            return
        dest.write_text(text, encoding="utf-8")
        self.log_artifact(dest, str(Path(artifact_file).parent) if Path(artifact_file).parent != Path(".") else None)
