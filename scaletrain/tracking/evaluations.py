"""Evaluations in MLflow: each ``scaletrain evaluate`` is a run nested under the training run.

:func:`log_evaluation` records one evaluation as a run nested under the training run (same store and
experiment), named by what it evaluated (:mod:`scaletrain.tracking.records` says why); only the run's full
evaluation also writes the training run's own ``<split>/...`` metrics. These are one-shot writes from a
command that has already waited for its decoding, so they go to the store directly, not through the
background sender. :func:`evaluation_runs` lists a training run's evaluations (``scaletrain compare``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from scaletrain.errors import ScaletrainError
from scaletrain.tracking.journal import now_ms
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
                artifact_dir) -> str:
    """Create the nested run, fill it and mark it FINISHED (FAILED if filling it failed)."""
    from mlflow.entities import Param

    run = client.create_run(experiment_id, run_name=name,
                            tags={**{safe_key(k): str(v)[:MAX_TAG_VAL] for k, v in tags.items()},
                                  "mlflow.parentRunId": parent.info.run_id})
    rid = run.info.run_id
    try:
        params = [Param(safe_key(k), str(v)[:MAX_PARAM_VAL]) for k, v in tags.items() if k != "scaletrain.kind"]
        for i in range(0, len(params), MAX_PARAMS_PER_BATCH):
            client.log_batch(rid, params=params[i : i + MAX_PARAMS_PER_BATCH])
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            client.log_batch(rid, metrics=metrics[i : i + MAX_METRICS_PER_BATCH])
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
            for i in range(0, len(ms), MAX_METRICS_PER_BATCH):
                client.log_batch(parent_run_id, metrics=ms[i : i + MAX_METRICS_PER_BATCH])
            client.log_batch(parent_run_id, tags=hs)
    return EvaluationLogged(resolved, eid, parent_run_id, parent.info.run_name or "", rid, name,
                            sorted(m.key for m in ms), earlier, headline and kept is None, kept)
