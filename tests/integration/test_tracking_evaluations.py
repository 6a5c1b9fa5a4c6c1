"""Evaluation records against a real ``mlflow server`` (HTTP): each evaluation a run nested under the training
run with its files as artifacts; only the full evaluation writes the training run's own metrics, and not over
a later step's; the same evaluation again replaces only its own nested run; `compare` finds them all, and an
old record (scores left on the training run before evaluations were named) still shows."""
from __future__ import annotations

import pytest
from mlflow import MlflowClient
from mlflow.entities import ViewType
from tracking_server import Server  # tests/integration/tracking_server.py

from scaletrain import tracking as T
from scaletrain.tracking.compare import compare, load_runs
from scaletrain.tracking.records import EvalSpec, headline_tag


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    mp.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    s = Server(tmp_path_factory.mktemp("server"))
    s.start()
    yield s
    s.stop()
    mp.undo()


def _spec(step=4, full=True, beam=1, max_lines=0) -> EvalSpec:
    return EvalSpec("test", 100 if full else 20, max_lines, full, beam, 1.0, 4.0, 60, True, beam == 1, step,
                    f"runs/x/checkpoints/step-{step}", "", "shards/django", "")


def _log(server, rid, spec, bleu, files=None):
    return T.log_evaluation(server.uri, rid, spec.name, tags=spec.tags(), step=spec.step, artifact_dir=files,
                            metrics={"test/bleu/all": bleu, "test/chrf/all": 2 * bleu}, headline=spec.headline,
                            headline_tag=headline_tag("test"), headline_metric="test/bleu/all")


def test_evaluations_are_nested_runs_on_a_real_server(server, tmp_path):
    tr = T.Tracker(server.uri, "evals", T.default_run_name("small", "runs/x"), True, tmp_path)
    rid = tr.start()
    tr.log_metrics({"train/loss": 3.0}, step=8)
    tr.end("KILLED")
    c = MlflowClient(server.uri)
    files = tmp_path / "rec"
    files.mkdir()
    (files / "eval.json").write_text("{}")
    (files / "hyp.de-en.txt").write_text("a\n")
    full8 = _log(server, rid, _spec(step=8), 10.0, files)
    assert full8.headline and c.get_run(rid).data.metrics["test/bleu/all"] == 10.0
    assert {a.path for a in c.list_artifacts(full8.run_id)} == {"eval.json", "hyp.de-en.txt"}
    sub = _log(server, rid, _spec(step=8, full=False, beam=4, max_lines=5), 30.0)
    assert not sub.headline and c.get_run(rid).data.metrics["test/bleu/all"] == 10.0
    early = _log(server, rid, _spec(step=4), 5.0)  # the full evaluation of an earlier checkpoint
    assert not early.headline and early.headline_kept == _spec(step=8).name
    parent = c.get_run(rid)
    assert parent.data.metrics["test/bleu/all"] == 10.0 and parent.info.status == "KILLED"
    assert parent.data.tags[headline_tag("test")] == _spec(step=8).name
    assert parent.data.tags[headline_tag("test") + ".run_id"] == full8.run_id
    again = _log(server, rid, _spec(step=8, full=False, beam=4, max_lines=5), 31.0)
    assert again.replaced == [sub.run_id] and c.get_run(sub.run_id).info.lifecycle_stage == "deleted"
    deleted = c.search_runs([parent.info.experiment_id], run_view_type=ViewType.DELETED_ONLY)
    assert [r.info.run_id for r in deleted] == [sub.run_id]
    # an old record beside it: a run whose own test/* scores no full-evaluation tag explains
    old = T.Tracker(server.uri, "evals", "small", True, tmp_path)
    old_id = old.start()
    old.log_metrics({"test/bleu/all": 12.6, "test/chrf/all": 30.0}, step=1200)
    old.end()
    runs = load_runs(experiment="evals", uri=server.uri)  # nested evaluation runs are not runs of their own
    assert sorted(r.run_id for r in runs) == sorted([rid, old_id])
    new = next(r for r in runs if r.run_id == rid)
    assert sorted(e.name for e in new.evaluations) == sorted([_spec(step=8).name, _spec(step=4).name,
                                                              _spec(step=8, full=False, beam=4, max_lines=5).name])
    rows = dict(compare(runs).rows)
    by_run = {r.run_id: i for i, r in enumerate(runs)}
    assert rows["evaluation (test)"][by_run[rid]] == "test.full.beam1.lp1.0.step8"
    assert rows["test/bleu/all"][by_run[rid]] == 10.0
    assert rows["evaluation (test)"][by_run[old_id]] == "test (old record, settings not recorded)"
    assert rows["test/bleu/all"][by_run[old_id]] == 12.6
    assert new.label == f"small · runs/x · {rid[:6]}"
