"""The MLflow store: which one (URI resolution), a client for it, how requests to it fail, MLflow-safe names,
experiments and run names.

Tracking URI, first match wins: the ``uri`` argument (the config's ``tracking.uri``), the
``MLFLOW_TRACKING_URI`` environment variable, then a SQLite store inside the project directory,
``sqlite:///<project_dir>/mlruns.db``. MLflow 3.x refuses the file store (``./mlruns``) unless
``MLFLOW_ALLOW_FILE_STORE=true`` ("maintenance mode"), and SQLite is the backend it recommends for local
use, so that is the default. With a SQLite store, new experiments put their artifacts next to the
database, in ``<db dir>/mlartifacts`` (so ``<project_dir>/mlartifacts`` for the default store); MLflow's own
default would be ``./mlruns`` relative to the current working directory, wherever the job happened to start.

For HTTP stores, MLflow's own retries (7, backoff up to 120 s) are turned off in this process unless
``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` / ``MLFLOW_HTTP_REQUEST_TIMEOUT`` are set (:func:`fast_failing_http`):
the tracker's sender retries by itself.

Experiments the tracker creates or uses are tagged ``mlflow.experimentKind=custom_model_development``
(:data:`EXPERIMENT_KIND`), so MLflow 3's UI opens them on the training runs rather than the GenAI overview
(traces, token usage), which it shows for experiments of no kind.

Run names: the trainer names a run ``<recipe> · <out_dir> · <short id>`` (:func:`default_run_name`; the
``{run_id}`` field of a name becomes the first 6 hex digits of the run id when the run is created), so runs
of one recipe differ in MLflow's run list and in ``scaletrain compare``; a resumed run keeps its name.

Metric and parameter names are made MLflow-safe (:func:`safe_key`): ``->`` becomes ``-``
(``bleu/xx->en`` -> ``bleu/xx-en``), any other character outside ``[A-Za-z0-9_./ :-]`` becomes ``_``.
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Mapping

from scaletrain.errors import ScaletrainError

__all__ = ["DEFAULT_EXPERIMENT", "EXPERIMENT_KIND", "RUN_ID_FIELD", "MAX_PARAM_VAL", "MAX_KEY", "MAX_TAG_VAL", "MAX_METRICS_PER_BATCH",
           "MAX_PARAMS_PER_BATCH", "default_tracking_uri", "resolve_tracking_uri", "tracking_client",
           "fast_failing_http", "server_unreachable", "experiment_id", "create_run", "reopen_run", "default_run_name",
           "filled_run_name",
           "safe_key", "flatten_params"]

DEFAULT_EXPERIMENT = "scaletrain"
# MLflow's UI opens an experiment of this kind on its training runs (its runs table), not on the GenAI overview
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
RUN_ID_FIELD = "{run_id}"  # in a run name: replaced by the run id's first 6 hex digits when the run starts
# MLflow's limits (mlflow.utils.validation): a parameter value, a metric/param/tag key, a tag value, and the
# metrics / params (or tags) of one log_batch request
MAX_PARAM_VAL = 6000
MAX_KEY = 250
MAX_TAG_VAL = 8000
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
_BAD_KEY_CHARS = re.compile(r"[^\w./ :\-]")


def default_tracking_uri(project_dir) -> str:
    """The project's own SQLite store, ``sqlite:///<project_dir>/mlruns.db``."""
    return f"sqlite:///{Path(project_dir).resolve() / 'mlruns.db'}"


def resolve_tracking_uri(uri: str | None, project_dir) -> str:
    """``uri`` if given, else ``$MLFLOW_TRACKING_URI``, else the project's SQLite store."""
    if uri:
        return str(uri)
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return default_tracking_uri(project_dir)


def tracking_client(uri: str):
    """An ``MlflowClient`` for the store at ``uri`` (mlflow is imported here, not at module import)."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def fast_failing_http(uri: str) -> None:
    """MLflow's HTTP client retries a failed request 7 times with backoff up to 120 s; our senders retry
    by themselves, so requests made in this process fail fast (unless the user set these variables).
    Call it before the first request to an ``http(s)://`` store; other stores are left alone."""
    if uri.startswith(("http://", "https://")):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def server_unreachable(uri: str, timeout: float = 5.0) -> str | None:
    """Why an ``http(s)://`` tracking server does not answer its ``/health`` endpoint within ``timeout``
    seconds (one phrase), or None (answers, or a local store). MLflow's own client would retry for
    minutes before failing."""
    if not uri.startswith(("http://", "https://")):
        return None
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout) as r:
            return None if r.status == 200 else f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return f"{type(reason).__name__}: {reason}"


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


def experiment_id(client, name: str, uri: str, project_dir) -> str:
    """The id of experiment ``name`` in the store at ``uri``, created (its artifacts placed as the module
    docstring says) when missing; a deleted one is an error naming what to do. The experiment is marked as
    model training (:data:`EXPERIMENT_KIND`), unless someone chose its kind (the UI's guesses, ``..._inferred``,
    are replaced)."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        return client.create_experiment(name, artifact_location=_artifact_location(uri, project_dir),
                                        tags=dict([EXPERIMENT_KIND]))
    if exp.lifecycle_stage == "deleted":
        raise ScaletrainError(
            f"tracking: experiment {name!r} is deleted in {uri}; restore it "
            "(mlflow experiments restore) or choose another tracking.experiment"
        )
    kind = exp.tags.get(EXPERIMENT_KIND[0], "")
    if not kind or kind.endswith("_inferred") or kind == "no_inferred_type":  # the UI's guesses are replaced
        client.set_experiment_tag(exp.experiment_id, *EXPERIMENT_KIND)
    return exp.experiment_id


def create_run(client, experiment: str, run_name: str | None, tags: Mapping[str, Any]) -> tuple[str, str]:
    """Create a run in experiment id ``experiment`` named ``run_name`` (its ``{run_id}`` field filled in as
    soon as the id is known) with ``tags``; returns (run id, name)."""
    run = client.create_run(experiment, run_name=run_name, tags={k: str(v) for k, v in tags.items()})
    run_id, name = run.info.run_id, run.info.run_name
    if name and RUN_ID_FIELD in name:  # the short id is known only now
        name = name.replace(RUN_ID_FIELD, run_id[:6])[:MAX_KEY]
        client.update_run(run_id, name=name)
    return run_id, name


def reopen_run(client, run_id: str, uri: str) -> tuple[str, str, str]:
    """An existing run, marked RUNNING again: (run id, its name, filled in as :func:`filled_run_name`
    does, experiment id). A run the store at ``uri`` does not have is a :class:`ScaletrainError`."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        raise ScaletrainError(
            f"tracking: cannot resume run {run_id!r}: not found in {uri} ({e.message.splitlines()[0]})"
        ) from None
    name = filled_run_name(client, run.info.run_id)
    if run.info.status != "RUNNING":
        client.update_run(run.info.run_id, status="RUNNING")
    return run.info.run_id, name, run.info.experiment_id


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


def filled_run_name(client, run_id: str) -> str:
    """The run's name, with a ``{run_id}`` field still in it (on the server) filled in. The trainer renames its
    run right after creating it; in one of many runs the server was seen to keep the name it was created with,
    so the end of a job and a resume check it once more."""
    name = client.get_run(run_id).info.run_name or ""
    if RUN_ID_FIELD in name:
        name = name.replace(RUN_ID_FIELD, run_id[:6])[:MAX_KEY]
        client.update_run(run_id, name=name)
    return name


def safe_key(key: str) -> str:
    """An MLflow-valid metric/param name (see the module docstring)."""
    k = str(key).replace("->", "-")
    k = _BAD_KEY_CHARS.sub("_", k)
    k = re.sub(r"/{2,}", "/", k).strip("/")
    parts = [p if p not in (".", "..") else "_" for p in k.split("/")]
    k = "/".join(parts) or "_"
    return k[:MAX_KEY]


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
        if len(s) > MAX_PARAM_VAL:
            s = s[: MAX_PARAM_VAL - 3] + "..."
        out[safe_key(pre)] = s

    rec(_plain(config), prefix)
    return out
