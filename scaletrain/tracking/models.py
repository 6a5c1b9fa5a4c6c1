"""Checkpoints and exports as MLflow 3 *logged models*, and the Model Registry.

**Each checkpoint a training job writes is a logged model** of its run (``source_run_id``, and a run output
at the checkpoint's step), named ``<recipe>-step-<N>``, of type ``scaletrain-checkpoint``. It is an
*external* model (``mlflow.model.isExternal``, as ``mlflow.create_external_model`` makes them): the
checkpoint stays in the run directory, MLflow holds its description and an ``MLmodel`` file, not a copy of
its weights. Its tags:

* ``scaletrain.checkpoint`` (``step-0000200``: the key the tracker finds it by), ``.step``, ``.path`` (where
  the checkpoint is), ``.exists`` (``false`` once ``train.keep_last`` deleted it; where the kept best copy
  ``checkpoints/best`` holds it, ``.path`` names that copy instead);
* ``scaletrain.best`` = ``true`` on the best checkpoint of the run (``train.best_metric`` / ``best_mode``,
  else the lowest ``valid/nll``), ``false`` on those that were best before.

The validation metrics measured on its weights (those logged at its step) are linked to it by
``model_id``, with the corpus dataset's name and digest, so ``mlflow.search_logged_models(order_by=
[{"field_name": "metrics.valid/nll", "ascending": True}])`` ranks a run's checkpoints; an evaluation of a
checkpoint (``scaletrain evaluate``) links its scores to the checkpoint's model too.

The server makes a model's id, so the tracking journal names a checkpoint's model by its key and
:class:`ModelIds` finds it on the server (creating it once): replaying the journal (a resumed job, the
sender's retries after an outage, ``scaletrain tracking sync``) never makes a second model, never adds a
run output twice and never logs a linked metric twice. :func:`apply_record` performs one journal record of
the kinds ``inputs``, ``model``, ``model_tags`` and ``model_metrics``; the sender and ``sync`` both use it.

**The Model Registry**: :func:`register_export` makes an export (``scaletrain export --register NAME``) a
logged model of the run that trained it, with the exported files as its artifacts (what one deploys comes
from the registry: ``mlflow artifacts download -u models:/NAME/1``), and a new version of the registered
model ``NAME``.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

from scaletrain.errors import ScaletrainError

__all__ = ["BEST_TAG", "CHECKPOINT_TAG", "EXISTS_TAG", "PATH_TAG", "STEP_TAG", "CHECKPOINT_MODEL_TYPE",
           "EXPORT_MODEL_TYPE", "ModelIds", "apply_record", "model_name", "register_export", "MODEL_RECORDS"]

CHECKPOINT_TAG = "scaletrain.checkpoint"
STEP_TAG = "scaletrain.checkpoint.step"
PATH_TAG = "scaletrain.checkpoint.path"
EXISTS_TAG = "scaletrain.checkpoint.exists"
BEST_TAG = "scaletrain.best"
IS_EXTERNAL = "mlflow.model.isExternal"  # mlflow.utils.mlflow_tags.MLFLOW_MODEL_IS_EXTERNAL
CHECKPOINT_MODEL_TYPE = "scaletrain-checkpoint"
EXPORT_MODEL_TYPE = "scaletrain-export"
MODEL_RECORDS = ("inputs", "model", "model_tags", "model_metrics")  # journal kinds apply_record performs
_BAD_NAME = str.maketrans({c: "-" for c in "/:.%\"' "})  # characters MLflow refuses in a model name


def model_name(prefix: str, step: int, suffix: str = "") -> str:
    """``<prefix>-step-<step>[-<suffix>]`` with the characters MLflow refuses in a model name replaced."""
    return "-".join(p for p in (str(prefix).translate(_BAD_NAME), f"step-{int(step)}", suffix) if p)


def _mlmodel_dir(tmp: Path, model, metadata: Mapping[str, Any]) -> Path:
    """An ``MLmodel`` file describing ``model`` (a LoggedModel) in ``tmp``."""
    from mlflow.models import Model

    Model(artifact_path=model.artifact_location, model_uuid=model.model_id, model_id=model.model_id,
          run_id=model.source_run_id, metadata=dict(metadata)).save(str(tmp / "MLmodel"))
    return tmp


def _finalize(client, model, metadata: Mapping[str, Any], files: Path | None = None) -> None:
    """Upload the model's ``MLmodel`` (and ``files``: a file or a directory) and mark it READY."""
    from mlflow.entities import LoggedModelStatus

    with tempfile.TemporaryDirectory() as tmp:
        client.log_model_artifacts(model.model_id, str(_mlmodel_dir(Path(tmp), model, metadata)))
    if files is not None and files.is_dir():
        client.log_model_artifacts(model.model_id, str(files))
    elif files is not None:  # a file, and what travels beside it (model.safetensors + model.spm8000.model)
        for f in [files, *sorted(p for p in files.parent.glob(f"{files.stem}.*") if p != files and p.is_file()
                                 and not p.name.endswith(".tmp"))]:
            client.log_model_artifact(model.model_id, str(f))
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)


class ModelIds:
    """The logged models of checkpoints of runs, by run and key (``step-0000200``): found on the server by
    their ``scaletrain.checkpoint`` tag, remembered, created when missing."""

    def __init__(self):
        self._ids: dict[tuple[str, str], str] = {}
        self._experiments: dict[str, str] = {}

    def experiment(self, client, run_id: str) -> str:
        if run_id not in self._experiments:
            self._experiments[run_id] = client.get_run(run_id).info.experiment_id
        return self._experiments[run_id]

    def find(self, client, run_id: str, key: str) -> str | None:
        """The id of the model of checkpoint ``key`` of ``run_id``, or None when the server has none."""
        if (run_id, key) in self._ids:
            return self._ids[(run_id, key)]
        found = client.search_logged_models(
            [self.experiment(client, run_id)], max_results=10,
            filter_string=f"source_run_id = '{run_id}' AND tags.`{CHECKPOINT_TAG}` = '{key}'")
        if not found:
            return None
        self._ids[(run_id, key)] = found[0].model_id
        return found[0].model_id

    def get(self, client, run_id: str, key: str) -> str:
        mid = self.find(client, run_id, key)
        if mid is None:  # a tags/metrics record comes after its model record: the model exists unless deleted
            from mlflow.exceptions import MlflowException

            raise MlflowException(f"no logged model for checkpoint {key} of run {run_id}",
                                  error_code="RESOURCE_DOES_NOT_EXIST")
        return mid

    def ensure(self, client, run_id: str, rec: Mapping[str, Any]) -> tuple[str, bool]:
        """The model of the checkpoint a ``model`` journal record describes, created (external, READY, a
        run output at its step) unless it exists; returns (model id, whether it was created now). Every
        step is checked first, so a record replayed after a failure half-way completes it."""
        from mlflow.entities import LoggedModelOutput, LoggedModelStatus

        key, step = rec["key"], int(rec["step"])
        mid = self.find(client, run_id, key)
        created = mid is None
        if created:
            model = client.create_logged_model(
                self.experiment(client, run_id), name=rec["name"], source_run_id=run_id,
                tags={**rec.get("tags", {}), CHECKPOINT_TAG: key, STEP_TAG: str(step), IS_EXTERNAL: "true"},
                params=rec.get("params") or None, model_type=CHECKPOINT_MODEL_TYPE)
            mid = self._ids[(run_id, key)] = model.model_id
        else:
            model = client.get_logged_model(mid)
        if model.status != LoggedModelStatus.READY:
            _finalize(client, model, {IS_EXTERNAL: True, "scaletrain": {"checkpoint": key, "step": step}})
        outputs = client.get_run(run_id).outputs
        if mid not in {o.model_id for o in (outputs.model_outputs if outputs else [])}:
            client.log_outputs(run_id, [LoggedModelOutput(mid, step)])
        return mid, created


def _model_metrics(client, run_id: str, mid: str, rec: Mapping[str, Any]) -> int:
    """Log a ``model_metrics`` record's values linked to model ``mid`` (those it does not have yet: matched by
    key, step and timestamp); returns how many were sent. The run gets the same points (key, step,
    timestamp, value) it has already, which MLflow stores once."""
    from mlflow.entities import Metric

    have = {(m.key, m.step, m.timestamp) for m in (client.get_logged_model(mid).metrics or [])}
    ds = rec.get("dataset") or {}
    step = int(rec["s"])
    new = [Metric(k, float(v), int(ts), step, model_id=mid, dataset_name=ds.get("name"),
                  dataset_digest=ds.get("digest"))
           for k, v, ts in rec["m"] if (k, step, int(ts)) not in have]
    if new:
        client.log_batch(run_id, metrics=new)
    return len(new)


def apply_record(client, run_id: str, rec: Mapping[str, Any], models: ModelIds) -> int:
    """Perform one journal record of a kind in :data:`MODEL_RECORDS` for run ``run_id``, idempotently;
    returns how many things it sent (datasets, a new model, tags, metric values)."""
    from scaletrain.tracking.datasets import dataset_input

    kind = rec["t"]
    if kind == "inputs":
        have = {(d.dataset.name, d.dataset.digest) for d in (client.get_run(run_id).inputs.dataset_inputs or [])}
        todo = [dataset_input(d["dataset"], d["context"]) for d in rec["datasets"]
                if (d["dataset"]["name"], d["dataset"]["digest"]) not in have]
        if todo:
            client.log_inputs(run_id, datasets=todo)
        return len(todo)
    if kind == "model":
        return int(models.ensure(client, run_id, rec)[1])
    if kind == "model_tags":
        mid = models.get(client, run_id, rec["key"])
        have = client.get_logged_model(mid).tags
        todo = {k: str(v) for k, v in rec["v"].items() if have.get(k) != str(v)}
        if todo:
            client.set_logged_model_tags(mid, todo)
        return len(todo)
    if kind == "model_metrics":
        return _model_metrics(client, run_id, models.get(client, run_id, rec["key"]), rec)
    raise AssertionError(kind)


def _export_experiment(client, run_id: str | None, experiment: str, uri: str, project_dir) -> tuple[str | None, str]:
    """(the training run's id if the store has it, the experiment the export's model goes to: the run's, else
    ``experiment``, created when missing)."""
    from mlflow.exceptions import MlflowException

    from scaletrain.tracking.store import experiment_id

    if run_id:
        try:
            return run_id, client.get_run(run_id).info.experiment_id
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
    return None, experiment_id(client, experiment, uri, project_dir)


def register_export(uri: str, name: str, files: str | os.PathLike, *, run_id: str | None, experiment: str,
                    step: int | None, fmt: str, checkpoint: str | os.PathLike, model_prefix: str,
                    project_dir: str | os.PathLike = "."):
    """Register the export ``files`` (a file or a directory) in the store at ``uri`` as a new version of the
    registered model ``name``: a logged model of the training run ``run_id`` (in its experiment; without a run
    the store knows, in ``experiment``) holding the files, ``models:/<model id>`` the version's source.
    Returns the ``ModelVersion``; a store that fails is one :class:`ScaletrainError` line."""
    from mlflow.exceptions import MlflowException

    from scaletrain.tracking.store import fast_failing_http, server_unreachable, tracking_client

    files = Path(files)
    fast_failing_http(uri)
    if why := server_unreachable(uri):
        raise ScaletrainError(f"export --register: tracking server {uri} is unreachable ({why}); the export is "
                              f"written at {files}: start the server and run the command again")
    client = tracking_client(uri)
    try:
        return _register(client, name, files, run_id=run_id, experiment=experiment, step=step, fmt=fmt,
                         checkpoint=Path(checkpoint), model_prefix=model_prefix, uri=uri, project_dir=project_dir)
    except MlflowException as e:
        raise ScaletrainError(f"export --register {name}: {uri} refused it ({e.message.splitlines()[0]}); the "
                              f"export is written at {files}") from None


def _register(client, name: str, files: Path, *, run_id, experiment, step, fmt, checkpoint: Path, model_prefix, uri,
              project_dir):
    from mlflow.exceptions import MlflowException

    run_id, eid = _export_experiment(client, run_id, experiment, uri, project_dir)
    tags = {"scaletrain.export.format": fmt, PATH_TAG: str(checkpoint.resolve()),
            "scaletrain.export.path": str(files.resolve())}
    if step is not None:
        tags[STEP_TAG] = str(step)
    model = client.create_logged_model(eid, name=model_name(model_prefix, step or 0, fmt), source_run_id=run_id,
                                       tags=tags, model_type=EXPORT_MODEL_TYPE,
                                       params={"format": fmt, "step": str(step), "checkpoint": checkpoint.name})
    _finalize(client, model, {"scaletrain": {"format": fmt, "step": step, "checkpoint": str(checkpoint)}}, files)
    description = (f"`scaletrain export --format {fmt}` of checkpoint {checkpoint} (step {step})"
                   + (f" of run {run_id}" if run_id else ""))
    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            raise
    with _default_store(uri):
        return client.create_model_version(name, source=f"models:/{model.model_id}", run_id=run_id,
                                           model_id=model.model_id, tags=tags, description=description)


@contextlib.contextmanager
def _default_store(uri: str):
    """``uri`` as MLflow's default store for a while: a local registry resolves a version's ``models:/<id>``
    source with the default client, not the one it was called through (a TODO in MLflow's SQL registry)."""
    import mlflow

    env = os.environ.get("MLFLOW_TRACKING_URI")
    before = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)  # None: unset, which also removes the environment variable
        if env is not None:
            os.environ["MLFLOW_TRACKING_URI"] = env
