from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient

from scaletrain import tracking as T
from scaletrain.errors import ScaletrainError
from scaletrain.models.config import ModelConfig


@pytest.fixture(scope="module")
def template_db(tmp_path_factory):
    """An initialised empty MLflow SQLite store; copying it saves the ~1.5 s schema migration per test."""
    d = tmp_path_factory.mktemp("template")
    MlflowClient(tracking_uri=db_uri(d))
    return d / "mlruns.db"


def seed(template: Path, d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, d / "mlruns.db")
    return d


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path, template_db):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # nothing may land in the working directory
    yield
    assert list(cwd.iterdir()) == []


def db_uri(d: Path) -> str:
    return f"sqlite:///{d.resolve() / 'mlruns.db'}"


def test_flatten_params_and_safe_keys():
    cfg = {"model": ModelConfig(d_model=64), "optim": {"lr": 5e-4, "betas": (0.9, 0.98)}, "data": {"langs": ["de", "en"],
           "path": Path("/x/y"), "empty": {}}, "note": "n" * 7000, "seed": None}
    flat = T.flatten_params(cfg)
    assert flat["model.d_model"] == "64" and flat["model.arch"] == "transformer" and flat["model.pre_ln"] == "False"
    assert flat["optim.lr"] == "0.0005" and flat["optim.betas"] == "[0.9, 0.98]"
    assert flat["data.langs"] == "['de', 'en']" and flat["data.path"] == "/x/y" and flat["data.empty"] == "{}"
    assert len(flat["note"]) == 6000 and flat["note"].endswith("...")
    assert flat["seed"] == "None"
    assert T.safe_key("valid/bleu_avg/xx->en") == "valid/bleu_avg/xx-en"
    assert T.safe_key("a//b/../c?") == "a/b/_/c_"
    assert T.safe_key("/lead/") == "lead"


def test_default_store_in_project_dir_params_metrics_artifacts(tmp_path):
    proj = tmp_path / "proj"  # does not exist yet: the store is created there
    tr = T.Tracker(None, "exp1", "run-a", True, proj, flush_every=10_000, flush_secs=1e9)
    assert tr.uri == db_uri(proj)
    cfg = {"model": {"d_model": 512, "arch": "moce"}, "optim": {"lr": 5e-4}}
    run_id = tr.start(params=cfg, tags={"variant": "ada-msha"})
    for step in range(10):
        tr.log_metrics({"train/loss": 10.0 - step, "train/lr": step * 1e-4}, step=step)
    assert tr.pending == 20
    c = MlflowClient(tracking_uri=db_uri(proj))
    assert c.get_metric_history(run_id, "train/loss") == []  # buffered, nothing written yet
    tr.flush()
    assert tr.pending == 0
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    tr.log_artifact(f)
    tr.log_dict({"bleu": 12.5}, "eval/scores.json")
    tr.log_text("line\n", "eval/hyps.txt")
    tr.set_tags({"phase": "done"})
    tr.end()

    run = c.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run-a"
    assert run.data.params == {"model.d_model": "512", "model.arch": "moce", "optim.lr": "0.0005"}
    assert run.data.tags["variant"] == "ada-msha" and run.data.tags["phase"] == "done"
    hist = sorted((m.step, m.value) for m in c.get_metric_history(run_id, "train/loss"))
    assert hist == [(s, 10.0 - s) for s in range(10)]
    assert run.data.metrics["train/lr"] == pytest.approx(9e-4)
    arts = {a.path for a in c.list_artifacts(run_id)} | {a.path for a in c.list_artifacts(run_id, "eval")}
    assert {"notes.txt", "eval", "eval/scores.json", "eval/hyps.txt"} <= arts
    local = Path(c.download_artifacts(run_id, "eval/scores.json", str(tmp_path)))
    assert json.loads(local.read_text()) == {"bleu": 12.5}
    # artifacts live inside the project directory, not in the working directory
    assert (proj / "mlartifacts").is_dir() and (proj / "mlruns.db").is_file()
    assert run.info.artifact_uri.startswith((proj / "mlartifacts").resolve().as_uri())


def test_metrics_are_flushed_in_batches(tmp_path, template_db):
    seed(template_db, tmp_path)
    tr = T.Tracker(None, "exp", None, True, tmp_path, flush_every=5, flush_secs=1e9)
    rid = tr.start()
    tr.log_metrics({"a": 1, "b": 2}, step=0)
    tr.log_metrics({"a": 1, "b": 2}, step=1)
    assert tr.pending == 4
    tr.log_metrics({"a": 3, "b": 4}, step=2)  # reaches 6 >= 5 -> handed to the sender
    assert tr.flush(timeout=60) and tr.pending == 0
    c = MlflowClient(tracking_uri=db_uri(tmp_path))
    assert len(c.get_metric_history(rid, "a")) == 3
    # more than MLflow's 1000-per-request limit in one flush
    tr.flush_every = 10_000
    tr.log_metrics({f"m/{i}": float(i) for i in range(1100)}, step=3)
    tr.end()
    m = c.get_run(rid).data.metrics
    assert m["m/0"] == 0.0 and m["m/1099"] == 1099.0 and len([k for k in m if k.startswith("m/")]) == 1100
    # time-based flush
    tr2 = T.Tracker(None, "exp", None, True, tmp_path, flush_every=10_000, flush_secs=0.0)
    rid2 = tr2.start()
    tr2.log_metrics({"x": 1.0}, step=0)
    assert tr2.outbox.sender.wait(timeout=60) and tr2.pending == 0 and c.get_run(rid2).data.metrics["x"] == 1.0
    with pytest.raises(ScaletrainError, match="non-numeric"):
        tr2.log_metrics({"x": "abc"}, step=1)
    tr2.end()


def test_non_main_rank_writes_nothing(tmp_path):
    proj = tmp_path / "proj"
    tr = T.Tracker(None, "exp", "r", False, proj)
    assert tr.start(params={"a": 1}, tags={"b": 2}) is None
    tr.log_metrics({"loss": 1.0}, step=1)
    tr.log_params({"c": 3})
    tr.set_tags({"d": 4})
    tr.log_artifact(tmp_path / "does-not-exist")  # not even validated: no-op
    tr.log_dict({"a": 1}, "a.json")
    tr.log_text("t", "t.txt")
    tr.flush()
    tr.end("FAILED")
    assert tr.sync_run_id() is None  # no process group: identity
    assert tr.pending == 0
    assert not proj.exists()
    with pytest.raises(ScaletrainError, match="main process"):
        tr.client


def test_env_var_respected_and_explicit_uri_wins(tmp_path, monkeypatch, template_db):
    env_dir = seed(template_db, tmp_path / "envstore")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", db_uri(env_dir))
    proj = tmp_path / "proj"
    tr = T.Tracker(None, "exp", None, True, proj)
    assert tr.uri == db_uri(env_dir)
    rid = tr.start(params={"x": 1})
    tr.end()
    run = MlflowClient(tracking_uri=db_uri(env_dir)).get_run(rid)
    assert run.data.params == {"x": "1"}
    assert not proj.exists()  # neither the store nor the artifacts land in the project directory
    assert run.info.artifact_uri.startswith((env_dir / "mlartifacts").resolve().as_uri())
    explicit = tmp_path / "explicit"
    explicit.mkdir()
    assert T.Tracker(db_uri(explicit), "exp", None, True, proj).uri == db_uri(explicit)


def test_resume_and_status(tmp_path, template_db):
    seed(template_db, tmp_path)
    tr = T.Tracker(None, "exp", "first", True, tmp_path)
    rid = tr.start()
    tr.log_metrics({"loss": 3.0}, step=1)
    tr.end("KILLED")
    c = MlflowClient(tracking_uri=db_uri(tmp_path))
    assert c.get_run(rid).info.status == "KILLED"
    tr2 = T.Tracker(None, "exp", None, True, tmp_path)
    assert tr2.resume(rid) == rid
    assert c.get_run(rid).info.status == "RUNNING"
    tr2.log_metrics({"loss": 2.0}, step=2)
    tr2.end()
    assert sorted(m.step for m in c.get_metric_history(rid, "loss")) == [1, 2]
    assert c.get_run(rid).info.status == "FINISHED"
    with pytest.raises(ScaletrainError, match="cannot resume run"):
        T.Tracker(None, "exp", None, True, tmp_path).resume("0" * 32)
    with pytest.raises(ScaletrainError, match="before start"):
        T.Tracker(None, "exp", None, True, tmp_path).log_metrics({"a": 1}, 0)
    with pytest.raises(ScaletrainError, match="FINISHED, FAILED or KILLED"):
        tr3 = T.Tracker(None, "exp", None, True, tmp_path)
        tr3.start()
        tr3.end("DONE")


def test_run_names_carry_recipe_out_dir_and_short_id(tmp_path, template_db):
    seed(template_db, tmp_path)
    assert T.default_run_name("small", "runs/small-20261126-1412") == "small · runs/small-20261126-1412 · {run_id}"
    assert T.default_run_name("small", tmp_path / "runs" / "a", cwd=tmp_path) == "small · runs/a · {run_id}"
    far = Path("/data") / ("x" * 60) / "runs" / "small-1"
    assert T.default_run_name("small", far, cwd=tmp_path) == "small · .../runs/small-1 · {run_id}"
    names = []
    for out in ("runs/a", "runs/b"):
        tr = T.Tracker(None, "exp", T.default_run_name("small", out), True, tmp_path, local_dir=tmp_path / out)
        rid = tr.start()
        tr.end()
        names.append(MlflowClient(tracking_uri=db_uri(tmp_path)).get_run(rid).info.run_name)
        assert names[-1] == f"small · {out} · {rid[:6]}" == tr.run_name
        assert json.loads((tmp_path / out / "run.json").read_text())["run_name"] == names[-1]
    tr2 = T.Tracker(None, "exp", T.default_run_name("small", "runs/other"), True, tmp_path)
    tr2.resume(rid)  # a resumed run keeps its name
    tr2.end()
    assert MlflowClient(tracking_uri=db_uri(tmp_path)).get_run(rid).info.run_name == names[-1] == tr2.run_name
    # a run whose server-side name kept the field gets it filled in at its end (and at a resume)
    c = MlflowClient(tracking_uri=db_uri(tmp_path))
    tr4 = T.Tracker(None, "exp", "small · runs/c · {run_id}", True, tmp_path)
    rid4 = tr4.start()
    c.update_run(rid4, name="small · runs/c · {run_id}")
    tr4.end()
    assert c.get_run(rid4).info.run_name == f"small · runs/c · {rid4[:6]}"
    c.update_run(rid4, name="small · runs/c · {run_id}")
    tr5 = T.Tracker(None, "exp", None, True, tmp_path)
    tr5.resume(rid4)
    assert c.get_run(rid4).info.run_name == f"small · runs/c · {rid4[:6]}" == tr5.run_name
    tr5.end()
    tr3 = T.Tracker(None, "exp", "plain {name}", True, tmp_path)  # a name without the field is left alone
    rid3 = tr3.start()
    tr3.end()
    assert MlflowClient(tracking_uri=db_uri(tmp_path)).get_run(rid3).info.run_name == "plain {name}"


def test_context_manager_marks_failed_and_flushes(tmp_path, template_db):
    seed(template_db, tmp_path)
    with pytest.raises(RuntimeError):
        with T.Tracker(None, "exp", None, True, tmp_path, flush_every=10_000, flush_secs=1e9) as tr:
            rid = tr.start()
            tr.log_metrics({"loss": 1.5}, step=7)
            raise RuntimeError("boom")
    run = MlflowClient(tracking_uri=db_uri(tmp_path)).get_run(rid)
    assert run.info.status == "FAILED" and run.data.metrics["loss"] == 1.5


def test_steps_logged_before_a_restart_are_not_logged_again(tmp_path, template_db, caplog):
    """A job resumed at step 2 after a crash that had logged steps 0-4 (the local journal says so) trains steps 3-4
    again: their metrics are dropped, step 5 on is logged; every step's metric is in the run once."""
    seed(template_db, tmp_path)
    local = tmp_path / "out" / "tracking"
    tr = T.Tracker(None, "exp", None, True, tmp_path, local_dir=local, flush_every=10_000, flush_secs=1e9)
    rid = tr.start()
    for s in range(5):
        tr.log_metrics({"loss": float(s)}, step=s)
    tr.flush(timeout=60)  # the crash: the journal holds steps 0-4
    again = T.Tracker(None, "exp", None, True, tmp_path, local_dir=local, flush_every=10_000, flush_secs=1e9)
    again.resume(rid)
    with caplog.at_level("INFO", logger="scaletrain"):
        again.replaying_until(local / T.JOURNAL, resumed_step=2)
    assert again.replay_until == 4 and "steps 3-4 were logged before the restart" in caplog.text
    for s in range(3, 7):
        again.log_metrics({"loss": 10.0 + s}, step=s)
    again.end()
    tr.end()
    got = [(m.step, m.value) for m in MlflowClient(tracking_uri=db_uri(tmp_path)).get_metric_history(rid, "loss")]
    assert sorted(got) == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 15.0), (6, 16.0)]
