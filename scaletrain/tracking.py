"""Everything MLflow. Only rank 0 talks to the tracking store; other ranks get a no-op Tracker.

Tracking URI, first match wins: the ``uri`` argument (the config's ``tracking.uri``), the
``MLFLOW_TRACKING_URI`` environment variable, then a SQLite store inside the project directory,
``sqlite:///<project_dir>/mlruns.db``. MLflow 3.x refuses the file store (``./mlruns``) unless
``MLFLOW_ALLOW_FILE_STORE=true`` ("maintenance mode"), and SQLite is the backend it recommends for local
use, so that is the default. With a SQLite store, new experiments put their artifacts next to the
database, in ``<db dir>/mlartifacts`` (so ``<project_dir>/mlartifacts`` for the default store); MLflow's own
default would be ``./mlruns`` relative to the current working directory, wherever the job happened to start.

The run id lives on rank 0; :func:`broadcast_run_id` (or :meth:`Tracker.sync_run_id`, a collective every
rank must call) sends it to the other ranks when a ``torch.distributed`` process group is initialised.

Metrics are buffered and written with ``MlflowClient.log_batch`` (at most 1000 per request) when the buffer
holds ``flush_every`` values, when ``flush_secs`` have passed since the last write, and on ``flush()``,
``log_artifact``, ``end()``; so per-step logging costs a dict append.

Metric and parameter names are made MLflow-safe: ``->`` becomes ``-`` (``bleu/xx->en`` -> ``bleu/xx-en``),
any other character outside ``[A-Za-z0-9_./ :-]`` becomes ``_``.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from scaletrain.errors import ScaletrainError

__all__ = [
    "DEFAULT_EXPERIMENT",
    "Tracker",
    "RunComparison",
    "broadcast_run_id",
    "compare_runs",
    "default_tracking_uri",
    "flatten_params",
    "resolve_tracking_uri",
    "safe_key",
]

DEFAULT_EXPERIMENT = "scaletrain"
_MAX_PARAM_VAL = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
_MAX_KEY = 250  # MAX_ENTITY_KEY_LENGTH
_MAX_TAG_VAL = 8000
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAMS_PER_BATCH = 100
_BAD_KEY_CHARS = re.compile(r"[^\w./ :\-]")


# ----------------------------------------------------------------------------------------------
# helpers


def default_tracking_uri(project_dir) -> str:
    return f"sqlite:///{Path(project_dir).resolve() / 'mlruns.db'}"


def resolve_tracking_uri(uri: str | None, project_dir) -> str:
    """``uri`` if given, else ``$MLFLOW_TRACKING_URI``, else the project's SQLite store."""
    if uri:
        return str(uri)
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return default_tracking_uri(project_dir)


def _artifact_location(uri: str, project_dir) -> str | None:
    """Artifact root for a new experiment: next to a SQLite database file (``<db dir>/mlartifacts``, which
    is ``<project_dir>/mlartifacts`` for the default store), ``<project_dir>/mlartifacts`` for an in-memory
    SQLite store; None (the server's / file store's own default) for everything else."""
    if uri.startswith("sqlite:///"):
        db = uri[len("sqlite:///"):].split("?", 1)[0]
        if db and db != ":memory:":
            return (Path(db).resolve().parent / "mlartifacts").as_uri()
    if uri.startswith("sqlite:"):
        return (Path(project_dir).resolve() / "mlartifacts").as_uri()
    return None


def safe_key(key: str) -> str:
    """An MLflow-valid metric/param name (see module docstring)."""
    k = str(key).replace("->", "-")
    k = _BAD_KEY_CHARS.sub("_", k)
    k = re.sub(r"/{2,}", "/", k).strip("/")
    parts = [p if p not in (".", "..") else "_" for p in k.split("/")]
    k = "/".join(parts) or "_"
    return k[:_MAX_KEY]


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return value


def flatten_params(config: Mapping[str, Any] | Any, prefix: str = "") -> dict[str, str]:
    """Nested dicts / dataclasses -> ``{"model.d_model": "512", ...}`` with string values.

    Lists and tuples become their ``repr``-like string; ``None`` becomes ``"None"``; values longer than
    MLflow's limit (6000 chars) are cut with a trailing ``...``.
    """
    out: dict[str, str] = {}

    def rec(obj: Any, pre: str) -> None:
        obj = _plain(obj)
        if isinstance(obj, Mapping):
            if not obj and pre:
                out[pre] = "{}"
            for k, v in obj.items():
                rec(v, f"{pre}.{k}" if pre else str(k))
            return
        if isinstance(obj, Path):
            obj = str(obj)
        if isinstance(obj, (list, tuple)):
            obj = [str(_plain(x)) if not isinstance(x, (int, float, str, bool)) else x for x in obj]
        s = str(obj)
        if len(s) > _MAX_PARAM_VAL:
            s = s[: _MAX_PARAM_VAL - 3] + "..."
        out[safe_key(pre)] = s

    rec(_plain(config), prefix)
    return out


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


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


# ----------------------------------------------------------------------------------------------
# tracker


class Tracker:
    """MLflow run handle, created on every rank; only ``is_main`` writes.

    Usage (every rank)::

        tr = Tracker(cfg.tracking.uri, cfg.tracking.experiment, run_name, is_main, project_dir)
        tr.start(params=config_dict, tags={...})   # or tr.resume(run_id) after a restart
        tr.sync_run_id()                           # collective: all ranks learn the id
        tr.log_metrics({"train/loss": 2.3}, step)
        tr.end("FINISHED")
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
    ):
        if not experiment or not isinstance(experiment, str):
            raise ScaletrainError(f"tracking: experiment name must be a non-empty string, got {experiment!r}")
        self.is_main = bool(is_main)
        self.project_dir = Path(project_dir)
        self.uri = resolve_tracking_uri(uri, project_dir)
        self.experiment = experiment
        self.run_name = run_name
        self.flush_every = max(1, int(flush_every))
        self.flush_secs = float(flush_secs)
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._client_obj = None
        self._buffer: list = []
        self._last_flush = time.monotonic()
        self._ended = False

    # ---- store ---------------------------------------------------------------------------------
    @property
    def client(self):
        if not self.is_main:
            raise ScaletrainError("tracking: only the main process may talk to MLflow")
        if self._client_obj is None:
            if self.uri.startswith("sqlite:///"):
                Path(self.uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
            try:
                self._client_obj = _client(self.uri)
            except Exception as e:
                raise ScaletrainError(f"tracking: cannot open MLflow store {self.uri!r}: {e}") from e
        return self._client_obj

    def _experiment_id(self) -> str:
        if self.experiment_id is None:
            c = self.client
            exp = c.get_experiment_by_name(self.experiment)
            if exp is None:
                loc = _artifact_location(self.uri, self.project_dir)
                self.experiment_id = c.create_experiment(self.experiment, artifact_location=loc)
            else:
                if exp.lifecycle_stage == "deleted":
                    raise ScaletrainError(
                        f"tracking: experiment {self.experiment!r} is deleted in {self.uri}; restore it "
                        "(mlflow experiments restore) or choose another tracking.experiment"
                    )
                self.experiment_id = exp.experiment_id
        return self.experiment_id

    def _require_run(self, what: str) -> str:
        if self.run_id is None:
            raise ScaletrainError(f"tracking: {what} before start() or resume()")
        return self.run_id

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self, params: Mapping[str, Any] | Any | None = None, tags: Mapping[str, Any] | None = None) -> str | None:
        """Create the run (main rank); log ``params`` (nested config, flattened with dotted keys) and
        ``tags``. Returns the run id (None on other ranks until :meth:`sync_run_id`)."""
        if not self.is_main:
            return None
        if self.run_id is not None:
            raise ScaletrainError(f"tracking: run {self.run_id} already started")
        eid = self._experiment_id()
        run = self.client.create_run(eid, run_name=self.run_name, tags={k: str(v) for k, v in (tags or {}).items()})
        self.run_id = run.info.run_id
        self.run_name = run.info.run_name
        self._ended = False
        if params is not None:
            self.log_params(params)
        return self.run_id

    def resume(self, run_id: str) -> str | None:
        """Continue logging into an existing run (e.g. after restarting from a checkpoint)."""
        if not self.is_main:
            self.run_id = run_id
            return run_id
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as e:
            raise ScaletrainError(
                f"tracking: cannot resume run {run_id!r}: not found in {self.uri} ({e.message.splitlines()[0]})"
            ) from None
        self.run_id = run.info.run_id
        self.run_name = run.info.run_name
        self.experiment_id = run.info.experiment_id
        self._ended = False
        if run.info.status != "RUNNING":
            self.client.update_run(self.run_id, status="RUNNING")
        return self.run_id

    def sync_run_id(self) -> str | None:
        """Collective: give every rank the main rank's run id (no-op without a process group)."""
        self.run_id = broadcast_run_id(self.run_id, self.is_main)
        return self.run_id

    def end(self, status: str = "FINISHED") -> None:
        """Flush buffered metrics and mark the run FINISHED / FAILED / KILLED."""
        if not self.is_main or self.run_id is None or self._ended:
            return
        status = status.upper()
        if status not in ("FINISHED", "FAILED", "KILLED"):
            raise ScaletrainError(f"tracking: end(status) must be FINISHED, FAILED or KILLED, got {status!r}")
        self.flush()
        self.client.set_terminated(self.run_id, status=status)
        self._ended = True

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
        items = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=items[i : i + _MAX_PARAMS_PER_BATCH])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if not self.is_main:
            return
        from mlflow.entities import RunTag

        run_id = self._require_run("set_tags")
        items = [RunTag(safe_key(k), str(v)[:_MAX_TAG_VAL]) for k, v in tags.items()]
        for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            self.client.log_batch(run_id, tags=items[i : i + _MAX_PARAMS_PER_BATCH])

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Buffer ``metrics`` (numbers, 0-d tensors/arrays) at ``step``; written in batches."""
        if not self.is_main:
            return
        from mlflow.entities import Metric

        self._require_run("log_metrics")
        ts = int(time.time() * 1000)
        for k, v in metrics.items():
            try:
                val = float(v.item() if hasattr(v, "item") else v)
            except (TypeError, ValueError):
                raise ScaletrainError(f"tracking: metric {k!r} has a non-numeric value {v!r:.100}") from None
            self._buffer.append(Metric(safe_key(k), val, ts, int(step)))
        if len(self._buffer) >= self.flush_every or time.monotonic() - self._last_flush >= self.flush_secs:
            self.flush()

    def flush(self) -> None:
        if not self.is_main or not self._buffer or self.run_id is None:
            self._last_flush = time.monotonic()
            return
        buf, self._buffer = self._buffer, []
        for i in range(0, len(buf), _MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=buf[i : i + _MAX_METRICS_PER_BATCH])
        self._last_flush = time.monotonic()

    @property
    def pending(self) -> int:
        """Metric values buffered but not yet written."""
        return len(self._buffer)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Upload a file or a directory (recursively) to the run's artifacts."""
        if not self.is_main:
            return
        run_id = self._require_run("log_artifact")
        p = Path(path)
        if not p.exists():
            raise ScaletrainError(f"tracking: log_artifact: {p} does not exist")
        self.flush()
        if p.is_dir():
            self.client.log_artifacts(run_id, str(p), artifact_path)
        else:
            self.client.log_artifact(run_id, str(p), artifact_path)

    def log_dict(self, data: Mapping[str, Any] | Sequence, artifact_file: str) -> None:
        """Store ``data`` as a JSON (``.json``) or YAML (``.yaml``/``.yml``) artifact."""
        if not self.is_main:
            return
        self.client.log_dict(self._require_run("log_dict"), data, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        if not self.is_main:
            return
        self.client.log_text(self._require_run("log_text"), text, artifact_file)


# ----------------------------------------------------------------------------------------------
# run comparison


@dataclass
class RunComparison:
    columns: list[str]
    rows: list[dict[str, Any]]

    def format(self) -> str:
        def cell(v: Any) -> str:
            if v is None:
                return "-"
            if isinstance(v, float):
                return "nan" if math.isnan(v) else f"{v:.4g}"
            return str(v)

        table = [[cell(r.get(c)) for c in self.columns] for r in self.rows]
        widths = [max([len(c)] + [len(t[i]) for t in table]) for i, c in enumerate(self.columns)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(self.columns, widths)).rstrip(),
                 "  ".join("-" * w for w in widths)]
        for t in table:
            lines.append("  ".join(v.ljust(w) for v, w in zip(t, widths)).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def compare_runs(
    experiment: str,
    metric_keys: Iterable[str],
    *,
    param_keys: Iterable[str] = (),
    uri: str | None = None,
    project_dir: str | os.PathLike = ".",
    agg: str = "last",
    max_runs: int = 100,
    filter_string: str = "",
) -> RunComparison:
    """One row per run of ``experiment`` (newest first): run id, name, status, the given params and each
    metric's last / min / max value (``agg``). Missing values are None."""
    if agg not in ("last", "min", "max"):
        raise ScaletrainError(f"compare_runs: agg must be last, min or max, got {agg!r}")
    metric_keys = [safe_key(k) for k in metric_keys]
    param_keys = [safe_key(k) for k in param_keys]
    resolved = resolve_tracking_uri(uri, project_dir)
    client = _client(resolved)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise ScaletrainError(f"compare_runs: no experiment named {experiment!r} in {resolved}")
    runs = client.search_runs([exp.experiment_id], filter_string=filter_string, max_results=max_runs,
                              order_by=["attributes.start_time DESC"])
    columns = ["run_id", "run_name", "status", *param_keys, *metric_keys]
    rows = []
    for run in runs:
        row: dict[str, Any] = {"run_id": run.info.run_id, "run_name": run.info.run_name,
                               "status": run.info.status}
        for k in param_keys:
            row[k] = run.data.params.get(k)
        for k in metric_keys:
            if agg == "last":
                row[k] = run.data.metrics.get(k)
            else:
                hist = [m.value for m in client.get_metric_history(run.info.run_id, k)]
                row[k] = (min(hist) if agg == "min" else max(hist)) if hist else None
        rows.append(row)
    return RunComparison(columns, rows)
