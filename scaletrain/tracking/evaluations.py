"""Evaluations in MLflow: each ``scaletrain evaluate`` is a run nested under the training run.

:func:`log_evaluation` records one evaluation as a run nested under the training run (same store and
experiment), named by what it evaluated (:mod:`scaletrain.tracking.records` says why); only the run's full
evaluation also writes the training run's own ``<split>/...`` metrics. These are one-shot writes from a
command that has already waited for its decoding, so they go to the store directly, not through the
background sender. :func:`evaluation_runs` lists a training run's evaluations (``scaletrain compare``).

An evaluation run also says what it read, as MLflow 3 expects: the corpus dataset as an input with the
evaluated split (``test``) as its context (the training run's own dataset when it evaluated the training
shards), the evaluated checkpoint's logged model as a model input, its scores linked to that model (so
``mlflow.search_logged_models`` ranks checkpoints by test BLEU too), and MLflow's source, git and user tags
with a description of the evaluation (:mod:`scaletrain.tracking.provenance`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from scaletrain.errors import ScaletrainError
from scaletrain.tracking.datasets import dataset_input, local_corpus_dataset
from scaletrain.tracking.journal import now_ms
from scaletrain.tracking.models import CHECKPOINT_TAG, STEP_TAG
from scaletrain.tracking.provenance import NOTE_TAG, source_tags
from scaletrain.tracking.records import TAG_PREFIX
from scaletrain.tracking.store import (MAX_METRICS_PER_BATCH, MAX_PARAM_VAL, MAX_PARAMS_PER_BATCH, MAX_TAG_VAL,
                                       fast_failing_http, resolve_tracking_uri, safe_key, tracking_client)

__all__ = ["EvaluationLogged", "evaluation_runs", "log_evaluation"]


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
                artifact_dir, inputs: tuple) -> str:
    """Create the nested run with ``inputs`` (dataset inputs, model inputs) and MLflow's source tags and
    description, fill it and mark it FINISHED (FAILED if filling it failed)."""
    from mlflow.entities import Param

    run = client.create_run(experiment_id, run_name=name,
                            tags={**{safe_key(k): str(v)[:MAX_TAG_VAL] for k, v in tags.items()},
                                  **source_tags("scaletrain evaluate"),
                                  NOTE_TAG: _note(name, tags, parent)[:MAX_TAG_VAL],
                                  "mlflow.parentRunId": parent.info.run_id})
    rid = run.info.run_id
    try:
        params = [Param(safe_key(k), str(v)[:MAX_PARAM_VAL]) for k, v in tags.items() if k != "scaletrain.kind"]
        for i in range(0, len(params), MAX_PARAMS_PER_BATCH):
            client.log_batch(rid, params=params[i : i + MAX_PARAMS_PER_BATCH])
        datasets, models = inputs
        if datasets or models:
            client.log_inputs(rid, datasets=datasets or None, models=models or None)
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            client.log_batch(rid, metrics=metrics[i : i + MAX_METRICS_PER_BATCH])
        if artifact_dir is not None and Path(artifact_dir).is_dir():
            client.log_artifacts(rid, str(artifact_dir))
    except BaseException:
        client.set_terminated(rid, status="FAILED")
        raise
    client.set_terminated(rid, status="FINISHED")
    return rid


def _dataset(parent, tags: Mapping[str, str]) -> dict | None:
    """The corpus the evaluation read, as a dataset: the training run's own input when it evaluated the training
    shards (the same dataset, now read as the evaluated split), else the shard directory's manifest (None:
    neither is known)."""
    if not tags.get(TAG_PREFIX + "shards_label"):
        for d in (parent.inputs.dataset_inputs if parent.inputs else []) or []:
            ds = d.dataset
            return {"name": ds.name, "digest": ds.digest, "source_type": ds.source_type, "source": ds.source,
                    "schema": ds.schema, "profile": ds.profile}
    shards = tags.get(TAG_PREFIX + "shards")
    return local_corpus_dataset(shards) if shards else None


def _checkpoint_model(client, parent, tags: Mapping[str, str]) -> str | None:
    """The logged model of the checkpoint evaluated (a ``step-N`` directory or the ``best`` copy of one: the
    training run's checkpoint model of that step), or None (an averaged or exported checkpoint, or a run
    without checkpoint models)."""
    step = tags.get(TAG_PREFIX + "step")
    if not step or tags.get(TAG_PREFIX + "checkpoint_label", "") not in ("", "best"):
        return None
    found = client.search_logged_models(
        [parent.info.experiment_id], max_results=10,
        filter_string=f"source_run_id = '{parent.info.run_id}' AND tags.`{STEP_TAG}` = '{int(step)}'")
    found = [m for m in found if m.tags.get(CHECKPOINT_TAG)]
    return found[0].model_id if found else None


def _note(name: str, tags: Mapping[str, str], parent) -> str:
    """The evaluation run's description (``mlflow.note.content``)."""
    import socket

    t = {k[len(TAG_PREFIX):]: v for k, v in tags.items() if k.startswith(TAG_PREFIX)}
    lines = (f"all {t.get('lines')} lines" if t.get("full") == "True"
             else f"the first {t.get('max_lines')} lines per direction")
    return (f"Evaluation `{name}` of checkpoint {t.get('checkpoint')} (step {t.get('step')}) of the training run "
            f"{parent.info.run_name or parent.info.run_id}: split {t.get('split')} of {t.get('shards')} ({lines}), "
            f"beam {t.get('beam')}, length penalty {t.get('lenpen')}, output length at most "
            f"{t.get('max_len_a')} x source + {t.get('max_len_b')}; BLEU and chrF by sacrebleu, beside a "
            f"copy-the-source baseline. Decoded on host {socket.gethostname()} by `scaletrain evaluate`.")


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
    from mlflow.entities import LoggedModelInput, Metric, RunTag
    from mlflow.exceptions import MlflowException

    resolved = resolve_tracking_uri(uri, project_dir)
    fast_failing_http(resolved)
    client = tracking_client(resolved)
    try:
        parent = client.get_run(parent_run_id)
    except MlflowException as e:
        raise ScaletrainError(f"tracking: training run {parent_run_id} not found in {resolved} "
                              f"({e.message.splitlines()[0]})") from None
    eid = parent.info.experiment_id
    earlier = [r.info.run_id for r in evaluation_runs(client, eid, parent_run_id, name)]
    ts = now_ms()
    dataset = _dataset(parent, tags)
    model_id = _checkpoint_model(client, parent, tags)
    link = {"model_id": model_id, "dataset_name": dataset["name"] if dataset else None,
            "dataset_digest": dataset["digest"] if dataset else None}
    ms = [Metric(safe_key(k), float(v), ts, int(step), **link) for k, v in metrics.items()]
    inputs = ([dataset_input(dataset, tags.get(TAG_PREFIX + "split") or "test")] if dataset else [],
              [LoggedModelInput(model_id)] if model_id else [])
    rid = _nested_run(client, eid, parent, name, tags, ms, artifact_dir, inputs)
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
            plain = [Metric(m.key, m.value, m.timestamp, m.step) for m in ms]  # the model has them from its evaluation
            for i in range(0, len(plain), MAX_METRICS_PER_BATCH):
                client.log_batch(parent_run_id, metrics=plain[i : i + MAX_METRICS_PER_BATCH])
            client.log_batch(parent_run_id, tags=hs)
    return EvaluationLogged(resolved, eid, parent_run_id, parent.info.run_name or "", rid, name,
                            sorted(m.key for m in ms), earlier, headline and kept is None, kept)
