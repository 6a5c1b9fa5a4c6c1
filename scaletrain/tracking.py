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

Metrics are buffered and handed to a background sender thread (``MlflowClient.log_batch``, at most 1000
per request) when the buffer holds ``flush_every`` values, when ``flush_secs`` have passed since the last
hand-over, and on ``flush()``, ``log_artifact``, ``end()``; so per-step logging costs a dict append and a
journal line. The training thread never waits for the network: params, tags, artifacts and the end status
go through the same sender, which retries with backoff while the server is down (one warning), and sends
the backlog when it is back.

Outage tolerance: with ``local_dir`` (training uses ``<out_dir>/tracking``) every operation is first
appended to ``journal.jsonl`` (metrics with the timestamp they are sent with) and ``run.json`` names the run
and the store. :func:`sync_run` (``scaletrain tracking sync RUN_DIR``) uploads what the server missed,
matching metrics by (key, step, timestamp) so nothing is sent twice, and applies a pending end status.
For HTTP stores, MLflow's own retries (7, backoff up to 120 s) are turned off in this process unless
``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` / ``MLFLOW_HTTP_REQUEST_TIMEOUT`` are set: the sender retries itself.

Run names: the trainer names a run ``<recipe> · <out_dir> · <short id>`` (:func:`default_run_name`; the
``{run_id}`` field of a name becomes the first 6 hex digits of the run id when the run is created), so runs
of one recipe differ in MLflow's run list and in ``scaletrain compare``; a resumed run keeps its name.

Evaluations (:func:`log_evaluation`): each ``scaletrain evaluate`` is a run nested under the training run,
named by what it evaluated (:mod:`scaletrain.eval.records` says why); only the run's full evaluation also
writes the training run's own ``<split>/...`` metrics. These are one-shot writes from a command that has
already waited for its decoding, so they go to the store directly, not through the background sender.

Metric and parameter names are made MLflow-safe: ``->`` becomes ``-`` (``bleu/xx->en`` -> ``bleu/xx-en``),
any other character outside ``[A-Za-z0-9_./ :-]`` becomes ``_``.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from scaletrain.errors import ScaletrainError

log = logging.getLogger("scaletrain")

__all__ = [
    "DEFAULT_EXPERIMENT",
    "EvaluationLogged",
    "evaluation_runs",
    "Tracker",
    "SyncReport",
    "read_journal",
    "sync_run",
    "broadcast_run_id",
    "default_run_name",
    "default_tracking_uri",
    "flatten_params",
    "log_evaluation",
    "node_layout",
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


RUN_ID_FIELD = "{run_id}"  # in a run name: replaced by the run id's first 6 hex digits when the run starts


def default_run_name(recipe: str, out_dir: str | os.PathLike, cwd: str | os.PathLike | None = None) -> str:
    """``<recipe> · <out_dir> · {run_id}``: the recipe, the output directory (relative to ``cwd`` when inside
    it, else its last two parts after ``...``) and a short id, so runs of one recipe differ at a glance
    (MLflow's run list, ``scaletrain compare``)."""
    out = Path(out_dir)
    base = Path(cwd) if cwd is not None else Path.cwd()
    try:
        shown = str(out.resolve().relative_to(base.resolve())) if out.is_absolute() else str(out)
    except ValueError:
        shown = str(out) if len(str(out)) <= 48 else str(Path("...", *out.parts[-2:]))
    return f"{recipe} · {shown} · {RUN_ID_FIELD}"


def _name_from_id(client, run_id: str) -> str:
    """The run's name, with a ``{run_id}`` field still in it (on the server) filled in. The trainer renames its
    run right after creating it; in one of many runs the server was seen to keep the name it was created with,
    so the end of a job and a resume check it once more."""
    name = client.get_run(run_id).info.run_name or ""
    if RUN_ID_FIELD in name:
        name = name.replace(RUN_ID_FIELD, run_id[:6])[:_MAX_KEY]
        client.update_run(run_id, name=name)
    return name


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


def node_layout(rank: int, world_size: int, env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(this process's node rank, number of nodes) from the launcher's environment: the ``deepspeed``
    launcher's ``CROSS_RANK``/``CROSS_SIZE``, torchrun's (and ``accelerate launch``'s) ``GROUP_RANK``/
    ``GROUP_WORLD_SIZE``, else ``rank // local size`` with ``LOCAL_WORLD_SIZE`` or ``LOCAL_SIZE``."""
    env = os.environ if env is None else env
    for r_key, n_key in (("CROSS_RANK", "CROSS_SIZE"), ("GROUP_RANK", "GROUP_WORLD_SIZE")):
        if env.get(r_key, "").isdigit() and env.get(n_key, "").isdigit():
            return int(env[r_key]), max(1, int(env[n_key]))
    local = env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or ""
    local_n = int(local) if local.isdigit() and int(local) > 0 else world_size
    return rank // local_n, max(1, -(-world_size // local_n))


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


# ----------------------------------------------------------------------------------------------
# local journal and background sender

JOURNAL = "journal.jsonl"
RUN_FILE = "run.json"
CHECKPOINTS_FILE = "checkpoints.json"
_PERMANENT_ERRORS = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS", "BAD_REQUEST",
                     "INVALID_STATE", "PERMISSION_DENIED", "UNAUTHENTICATED"}


def _now_ms() -> int:
    return int(time.time() * 1000)


def _permanent(e: BaseException) -> bool:
    """An error that retrying cannot fix (a bad value, a deleted run); anything else (connection refused,
    timeouts, 5xx) is an outage and is retried."""
    return getattr(e, "error_code", None) in _PERMANENT_ERRORS


def _fast_failing_http(uri: str) -> None:
    """MLflow's HTTP client retries a failed request 7 times with backoff up to 120 s; our sender retries
    by itself, so requests made in this process fail fast (unless the user set these variables)."""
    if uri.startswith(("http://", "https://")):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


class _Journal:
    """Append-only JSON lines in ``<local_dir>/journal.jsonl``: everything the tracker was asked to send,
    written *before* it is sent, so that ``scaletrain tracking sync`` can upload what the server missed."""

    def __init__(self, local_dir: Path):
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


class _Sender(threading.Thread):
    """Sends operations to MLflow in order, off the training thread. An operation that fails for an outage
    is retried with exponential backoff (``min_backoff`` doubling up to ``max_backoff`` seconds) until it
    succeeds; one warning when the server is lost, one line when it is back. Consecutive metric batches
    are merged into requests of up to 1000 values. At most ``max_queued`` metric values wait in memory: in
    a long outage the oldest queued batches are dropped from memory (one warning; ``dropped`` counts them)
    and only the journal keeps them, for ``scaletrain tracking sync``."""

    def __init__(self, execute, *, min_backoff: float = 0.5, max_backoff: float = 30.0, name: str = "",
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
            if k2 != "metrics" or len(merged) + len(p2) > _MAX_METRICS_PER_BATCH:
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


# ----------------------------------------------------------------------------------------------
# tracker


class Tracker:
    """MLflow run handle, created on every rank; only ``is_main`` writes.

    Usage (every rank)::

        tr = Tracker(cfg.tracking.uri, cfg.tracking.experiment, run_name, is_main, project_dir,
                     local_dir=out_dir / "tracking")
        tr.start(params=config_dict, tags={...})   # or tr.resume(run_id) after a restart
        tr.sync_run_id()                           # collective: all ranks learn the id
        tr.log_metrics({"train/loss": 2.3}, step)
        tr.end("FINISHED")

    Creating or resuming the run talks to the store directly (the run id is needed at once). Everything
    after that (params, tags, metrics, artifacts, the end status) goes through a background thread that
    retries with backoff while the server is unreachable, so the caller never waits for the network; with
    ``local_dir``, every operation is first appended to ``local_dir/journal.jsonl`` (metrics with the
    timestamp they are sent with) and the run's identity is in ``local_dir/run.json``: :func:`sync_run`
    (``scaletrain tracking sync RUN_DIR``) uploads whatever the server missed, without duplicates.
    ``end()`` waits at most ``end_timeout`` seconds for the sender.
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
        self.project_dir = Path(project_dir)
        self.uri = resolve_tracking_uri(uri, project_dir)
        self.experiment = experiment
        self.run_name = run_name
        self.flush_every = max(1, int(flush_every))
        self.flush_secs = float(flush_secs)
        self.local_dir = Path(local_dir) if local_dir is not None else None
        self.end_timeout = float(end_timeout)
        self.max_backoff = float(max_backoff)
        self.max_queued = int(max_queued)
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._client_obj = None
        self._buffer: list = []
        self._last_flush = time.monotonic()
        self._ended = False
        self._journal: _Journal | None = None
        self._sender: _Sender | None = None
        if self.is_main:
            _fast_failing_http(self.uri)

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

    def _open_local(self, event: str) -> None:
        """Start the sender (and the journal) once the run id is known."""
        if self.local_dir is not None:
            if self._journal is None:
                self._journal = _Journal(self.local_dir)
            info = {"uri": self.uri, "run_id": self.run_id, "experiment_id": self.experiment_id,
                    "experiment": self.experiment, "run_name": self.run_name}
            from scaletrain.fileio import atomic_write_text

            atomic_write_text(self.local_dir / RUN_FILE, json.dumps(info, indent=2) + "\n")
            self._journal.append({"t": event, "run_id": self.run_id, "uri": self.uri, "ts": _now_ms()})
        if self._sender is None or not self._sender.is_alive():
            self._sender = _Sender(self._execute, max_backoff=self.max_backoff, max_queued=self.max_queued)

    def _send(self, kind: str, payload: Any, size: int = 1) -> int:
        """Queue an operation for the sender thread (a new one if an earlier end() let it stop)."""
        if self._sender is None or not self._sender.is_alive():
            self._sender = _Sender(self._execute, max_backoff=self.max_backoff, max_queued=self.max_queued)
        return self._sender.submit(kind, payload, size=size)

    def _record(self, record: dict) -> None:
        if self._journal is not None:
            self._journal.append(record)

    def _execute(self, kind: str, payload: Any) -> None:
        """Runs on the sender thread."""
        c = self.client
        if kind == "metrics":
            c.log_batch(self.run_id, metrics=payload)
            return
        run_id = payload[0]
        if kind == "params":
            c.log_batch(run_id, params=payload[1])
        elif kind == "tags":
            c.log_batch(run_id, tags=payload[1])
        elif kind == "artifact":
            _, path, artifact_path = payload
            if Path(path).is_dir():
                c.log_artifacts(run_id, path, artifact_path)
            else:
                c.log_artifact(run_id, path, artifact_path)
        elif kind == "text":
            c.log_text(run_id, payload[1], payload[2])
        elif kind == "dict":
            c.log_dict(run_id, payload[1], payload[2])
        elif kind == "end":
            _name_from_id(c, run_id)
            c.set_terminated(run_id, status=payload[1], end_time=payload[2])
        else:  # pragma: no cover
            raise AssertionError(kind)

    # ---- lifecycle -----------------------------------------------------------------------------
    def unreachable(self, timeout: float = 5.0) -> str | None:
        """Why an ``http(s)://`` tracking server does not answer its ``/health`` endpoint within ``timeout``
        seconds (one phrase), or None (answers, or a local store). MLflow's own client would retry for
        minutes before failing."""
        if not self.uri.startswith(("http://", "https://")):
            return None
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.uri.rstrip('/')}/health", timeout=timeout) as r:
                return None if r.status == 200 else f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            return f"HTTP {e.code}"
        except (OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            return f"{type(reason).__name__}: {reason}"

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
        eid = self._experiment_id()
        run = self.client.create_run(eid, run_name=self.run_name, tags={k: str(v) for k, v in (tags or {}).items()})
        self.run_id = run.info.run_id
        self.run_name = run.info.run_name
        if self.run_name and RUN_ID_FIELD in self.run_name:  # the short id is known only now
            self.run_name = self.run_name.replace(RUN_ID_FIELD, self.run_id[:6])[:_MAX_KEY]
            self.client.update_run(self.run_id, name=self.run_name)
        self._ended = False
        self._open_local("start")
        if params is not None:
            self.log_params(params)
        return self.run_id

    def resume(self, run_id: str) -> str | None:
        """Continue logging into an existing run (e.g. after restarting from a checkpoint)."""
        if not self.is_main:
            self.run_id = run_id
            return run_id
        from mlflow.exceptions import MlflowException

        if why := self.unreachable():
            # a resumed job (e.g. requeued after preemption) must not wait for the server: the run exists
            # there already, so everything goes to the journal and the sender delivers it when it is back
            log.warning("tracking server %s unreachable at resume (%s): training continues; run %s gets "
                        "the metrics when the server is back (or by `scaletrain tracking sync`)",
                        self.uri, why, run_id)
            self.run_id, self._ended = run_id, False
            if self.run_name:  # the server has the name; a default one is known from the id
                self.run_name = self.run_name.replace(RUN_ID_FIELD, run_id[:6])
            self._open_local("resume")
            return self.run_id
        try:
            run = self.client.get_run(run_id)
        except MlflowException as e:
            raise ScaletrainError(
                f"tracking: cannot resume run {run_id!r}: not found in {self.uri} ({e.message.splitlines()[0]})"
            ) from None
        self.run_id = run.info.run_id
        self.run_name = _name_from_id(self.client, self.run_id)
        self.experiment_id = run.info.experiment_id
        self._ended = False
        if run.info.status != "RUNNING":
            self.client.update_run(self.run_id, status="RUNNING")
        self._open_local("resume")
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
        self._submit_buffer()
        ts = _now_ms()
        self._record({"t": "end", "status": status, "ts": ts})
        self._send("end", (self.run_id, status, ts))
        self._ended = True
        ok = self._sender.wait(timeout=self.end_timeout if timeout is None else timeout)
        if ok and self._sender.dropped:
            ok = False
            where = f" {self.local_dir.parent}" if self.local_dir is not None else ""
            log.warning("tracking: %d metric values of run %s were kept only in the journal during the outage; "
                        "`scaletrain tracking sync%s` uploads them", self._sender.dropped, self.run_id, where)
            self._sender.close()
        elif ok:
            self._sender.close()
        else:
            self._sender.abandon()
            where = (f"`scaletrain tracking sync {self.local_dir.parent}` uploads it"
                     if self.local_dir is not None else "it is lost")
            log.warning("tracking: MLflow run %s did not get everything before the end (%s); %s",
                        self.run_id, self._sender.last_error, where)
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        return ok

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
        self._record({"t": "params", "v": flat})
        items = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            self._send("params", (run_id, items[i : i + _MAX_PARAMS_PER_BATCH]))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if not self.is_main:
            return
        from mlflow.entities import RunTag

        run_id = self._require_run("set_tags")
        flat = {safe_key(k): str(v)[:_MAX_TAG_VAL] for k, v in tags.items()}
        self._record({"t": "tags", "v": flat})
        items = [RunTag(k, v) for k, v in flat.items()]
        for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            self._send("tags", (run_id, items[i : i + _MAX_PARAMS_PER_BATCH]))

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record ``metrics`` (numbers, 0-d tensors/arrays) at ``step``: one journal line now, sent in
        batches by the background thread."""
        if not self.is_main:
            return
        from mlflow.entities import Metric

        self._require_run("log_metrics")
        ts = _now_ms()
        vals = {}
        for k, v in metrics.items():
            try:
                val = float(v.item() if hasattr(v, "item") else v)
            except (TypeError, ValueError):
                raise ScaletrainError(f"tracking: metric {k!r} has a non-numeric value {v!r:.100}") from None
            vals[safe_key(k)] = val
        self._record({"t": "m", "s": int(step), "ts": ts, "v": vals})
        self._buffer.extend(Metric(k, v, ts, int(step)) for k, v in vals.items())
        if len(self._buffer) >= self.flush_every or time.monotonic() - self._last_flush >= self.flush_secs:
            self._submit_buffer()

    def _submit_buffer(self) -> None:
        self._last_flush = time.monotonic()
        if not self.is_main or not self._buffer or self.run_id is None:
            return
        buf, self._buffer = self._buffer, []
        for i in range(0, len(buf), _MAX_METRICS_PER_BATCH):
            chunk = buf[i : i + _MAX_METRICS_PER_BATCH]
            self._send("metrics", chunk, size=len(chunk))

    def flush(self, timeout: float | None = None) -> bool:
        """Hand the buffered metrics to the sender and wait up to ``timeout`` seconds (default
        ``end_timeout``; 0: do not wait) for everything logged so far. Returns whether all of it reached
        the store (False: it is still queued, and in the journal)."""
        self._submit_buffer()
        if self._sender is None:
            return True
        return self._sender.wait(timeout=self.end_timeout if timeout is None else timeout)

    @property
    def pending(self) -> int:
        """Metric values logged but not yet written to the store."""
        return len(self._buffer) + (self._sender.in_flight if self._sender is not None else 0)

    @property
    def server_failing(self) -> bool:
        return bool(self._sender is not None and self._sender.failing)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Upload a file or a directory (recursively) to the run's artifacts (in the background)."""
        if not self.is_main:
            return
        run_id = self._require_run("log_artifact")
        p = Path(path)
        if not p.exists():
            raise ScaletrainError(f"tracking: log_artifact: {p} does not exist")
        self._submit_buffer()
        self._record({"t": "artifact", "path": str(p.resolve()), "dir": artifact_path})
        self._send("artifact", (run_id, str(p), artifact_path))

    def log_checkpoint(self, ckpt_dir: str | os.PathLike, step: int) -> None:
        """Add a written checkpoint to the run's ``checkpoints.json`` artifact (every checkpoint of the job,
        resumed sessions included: ``step``, ``path``, ``time``, and ``exists``, false once ``keep_last``
        pruned it). Written in ``local_dir/artifacts`` and uploaded in the background: never waits."""
        if not self.is_main or self.run_id is None:
            return
        dest = self._local_artifact(CHECKPOINTS_FILE)
        entries = []
        if dest is not None and dest.is_file():
            try:
                entries = json.loads(dest.read_text(encoding="utf-8")).get("checkpoints", [])
            except (ValueError, AttributeError):
                entries = []  # a damaged list is rebuilt from this checkpoint on
        path = str(Path(ckpt_dir).resolve())
        entries = [e for e in entries if e.get("path") != path]
        entries.append({"step": int(step), "path": path, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        for e in entries:
            e["exists"] = Path(e["path"]).is_dir()
        data = {"run_id": self.run_id, "checkpoints": entries}
        if dest is None:
            self._send("dict", (self.run_id, data, CHECKPOINTS_FILE))
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

    def log_dict(self, data: Mapping[str, Any] | Sequence, artifact_file: str) -> None:
        """Store ``data`` as a JSON (``.json``) or YAML (``.yaml``/``.yml``) artifact."""
        if not self.is_main:
            return
        run_id = self._require_run("log_dict")
        dest = self._local_artifact(artifact_file)
        if dest is None:
            self._send("dict", (run_id, data, artifact_file))
            return
        if artifact_file.endswith((".yaml", ".yml")):
            import yaml

            text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
        else:
            text = json.dumps(data, indent=2, ensure_ascii=False)
        self.log_text(text, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        if not self.is_main:
            return
        run_id = self._require_run("log_text")
        dest = self._local_artifact(artifact_file)
        if dest is None:
            self._send("text", (run_id, text, artifact_file))
            return
        dest.write_text(text, encoding="utf-8")
        self.log_artifact(dest, str(Path(artifact_file).parent) if Path(artifact_file).parent != Path(".") else None)


# ----------------------------------------------------------------------------------------------
# evaluations: one nested run each (scaletrain.eval.records explains the design)


@dataclass
class EvaluationLogged:
    """Where :func:`log_evaluation` wrote."""

    uri: str
    experiment_id: str
    parent_run_id: str
    parent_run_name: str
    run_id: str  # the evaluation's nested run
    run_name: str
    metric_keys: list[str]
    replaced: list[str]  # earlier nested runs of the same evaluation, now deleted
    headline: bool  # the training run's own metrics were updated
    headline_kept: str | None = None  # else: the evaluation (name) whose numbers the training run keeps


def evaluation_runs(client, experiment_id: str, parent_run_id: str, name: str | None = None) -> list:
    """The nested evaluation runs of a training run (named ``name``, when given), newest first."""
    filt = f"tags.mlflow.parentRunId = '{parent_run_id}' and tags.`scaletrain.kind` = 'evaluation'"
    if name is not None:
        filt += f" and tags.`scaletrain.eval.name` = '{name}'"
    return client.search_runs([experiment_id], filter_string=filt, max_results=1000,
                              order_by=["attributes.start_time DESC"])


def _headline_step(client, run_id: str, metric: str) -> int | None:
    hist = client.get_metric_history(run_id, safe_key(metric))
    return max(m.step for m in hist) if hist else None


def _nested_run(client, experiment_id: str, parent, name: str, tags: Mapping[str, str], metrics: list,
                artifact_dir) -> str:
    """Create the nested run, fill it and mark it FINISHED (FAILED if filling it failed)."""
    from mlflow.entities import Param

    run = client.create_run(experiment_id, run_name=name,
                            tags={**{safe_key(k): str(v)[:_MAX_TAG_VAL] for k, v in tags.items()},
                                  "mlflow.parentRunId": parent.info.run_id})
    rid = run.info.run_id
    try:
        params = [Param(safe_key(k), str(v)[:_MAX_PARAM_VAL]) for k, v in tags.items() if k != "scaletrain.kind"]
        for i in range(0, len(params), _MAX_PARAMS_PER_BATCH):
            client.log_batch(rid, params=params[i : i + _MAX_PARAMS_PER_BATCH])
        for i in range(0, len(metrics), _MAX_METRICS_PER_BATCH):
            client.log_batch(rid, metrics=metrics[i : i + _MAX_METRICS_PER_BATCH])
        if artifact_dir is not None and Path(artifact_dir).is_dir():
            client.log_artifacts(rid, str(artifact_dir))
    except BaseException:
        client.set_terminated(rid, status="FAILED")
        raise
    client.set_terminated(rid, status="FINISHED")
    return rid


def log_evaluation(uri: str | None, parent_run_id: str, name: str, *, tags: Mapping[str, str],
                   metrics: Mapping[str, float], step: int, artifact_dir: str | os.PathLike | None = None,
                   headline: bool = False, headline_tag: str = "", headline_metric: str = "",
                   project_dir: str | os.PathLike = ".") -> EvaluationLogged:
    """Record one evaluation in MLflow as a run nested under the training run ``parent_run_id`` (same
    store and experiment), named ``name``, tagged (and with params) ``tags``, with ``metrics`` at ``step``
    and the files of ``artifact_dir``. An earlier nested run of the same name (the same evaluation run
    again) is deleted once the new one is complete; no other record is touched.

    With ``headline`` (the run's full evaluation) the training run gets ``metrics`` too, and the tags
    ``headline_tag`` = ``name``, ``<headline_tag>.run_id``, ``<headline_tag>.step``, unless its
    ``headline_metric`` already holds a later step (the full evaluation of a later checkpoint stays).
    The training run's status is left as it is."""
    from mlflow.entities import Metric, RunTag
    from mlflow.exceptions import MlflowException

    resolved = resolve_tracking_uri(uri, project_dir)
    _fast_failing_http(resolved)
    client = _client(resolved)
    try:
        parent = client.get_run(parent_run_id)
    except MlflowException as e:
        raise ScaletrainError(f"tracking: training run {parent_run_id} not found in {resolved} "
                              f"({e.message.splitlines()[0]})") from None
    eid = parent.info.experiment_id
    earlier = [r.info.run_id for r in evaluation_runs(client, eid, parent_run_id, name)]
    ts = _now_ms()
    ms = [Metric(safe_key(k), float(v), ts, int(step)) for k, v in metrics.items()]
    rid = _nested_run(client, eid, parent, name, tags, ms, artifact_dir)
    for old in earlier:
        client.delete_run(old)
    kept = None
    if headline:
        latest = _headline_step(client, parent_run_id, headline_metric) if headline_metric else None
        if latest is not None and latest > int(step):
            kept = parent.data.tags.get(headline_tag, f"an evaluation of step {latest}")
        else:
            hs = [RunTag(headline_tag, name), RunTag(f"{headline_tag}.run_id", rid),
                  RunTag(f"{headline_tag}.step", str(int(step)))]
            for i in range(0, len(ms), _MAX_METRICS_PER_BATCH):
                client.log_batch(parent_run_id, metrics=ms[i : i + _MAX_METRICS_PER_BATCH])
            client.log_batch(parent_run_id, tags=hs)
    return EvaluationLogged(resolved, eid, parent_run_id, parent.info.run_name or "", rid, name,
                            sorted(m.key for m in ms), earlier, headline and kept is None, kept)


# ----------------------------------------------------------------------------------------------
# sync: upload what the server missed


@dataclass
class SyncReport:
    run_id: str
    metrics_sent: int
    metrics_present: int
    artifacts: int
    status: str | None  # the status applied, None if nothing to apply


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
    _fast_failing_http(target)
    client = _client(target)
    by_run: dict[str, dict] = {}
    cur = info["run_id"]
    for rec in read_journal(tdir / JOURNAL):
        t = rec.get("t")
        if t in ("start", "resume"):
            cur = rec["run_id"]
        r = by_run.setdefault(cur, {"m": [], "params": {}, "tags": {}, "artifacts": [], "last": None})
        if t == "m":
            r["m"].extend((k, v, rec["ts"], rec["s"]) for k, v in rec["v"].items())
        elif t == "params":
            r["params"].update(rec["v"])
        elif t == "tags":
            r["tags"].update(rec["v"])
        elif t == "artifact":
            r["artifacts"].append((rec["path"], rec.get("dir")))
        if t in ("start", "resume", "end"):
            r["last"] = rec
    for sys_journal in sorted((tdir / "system").glob(f"*/{JOURNAL}")):  # scaletrain.system_metrics, per node
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


def _sync_one(client, run_id: str, r: dict) -> SyncReport:
    from mlflow.entities import Metric, Param, RunTag

    run = client.get_run(run_id)
    missing, present = [], 0
    keys = sorted({m[0] for m in r["m"]})
    for key in keys:
        have = {(m.step, m.timestamp) for m in client.get_metric_history(run_id, key)}
        for k, v, ts, s in (m for m in r["m"] if m[0] == key):
            if (s, ts) in have:
                present += 1
            else:
                have.add((s, ts))
                missing.append(Metric(k, v, ts, s))
    for i in range(0, len(missing), _MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=missing[i : i + _MAX_METRICS_PER_BATCH])
    params = [Param(k, v) for k, v in r["params"].items() if k not in run.data.params]
    for i in range(0, len(params), _MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=params[i : i + _MAX_PARAMS_PER_BATCH])
    tags = [RunTag(k, v) for k, v in r["tags"].items() if run.data.tags.get(k) != v]
    for i in range(0, len(tags), _MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, tags=tags[i : i + _MAX_PARAMS_PER_BATCH])
    n_art = 0
    for path, adir in r["artifacts"]:
        p = Path(path)
        if not p.exists():
            log.warning("tracking sync: artifact %s is gone, skipped", p)
            continue
        (client.log_artifacts if p.is_dir() else client.log_artifact)(run_id, str(p), adir)
        n_art += 1
    applied = None
    last = r["last"]
    if last is not None and last["t"] == "end" and run.info.status != last["status"]:
        client.set_terminated(run_id, status=last["status"], end_time=last["ts"])
        applied = last["status"]
    return SyncReport(run_id, len(missing), present, n_art, applied)
