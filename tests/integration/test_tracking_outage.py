"""Outage tolerance against a real ``mlflow server`` process: the server is killed mid-run, training goes
on at its own speed, nothing is lost, and the backlog reaches the server once it is back (by the sender
thread on its own, or by ``scaletrain tracking sync``), each value exactly once."""
from __future__ import annotations

import json
import logging
import time

import pytest
from mlflow import MlflowClient
from tracking_server import Server, _free_port  # tests/integration/tracking_server.py

from helpers import assert_toy_checkpoint_models, log_toy_checkpoints

from scaletrain import tracking as T
from scaletrain.errors import ScaletrainError

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env")  # trains in this process

TINY = ["model.d_model=32", "model.n_heads=2", "model.encoder_layers=1", "model.decoder_layers=1", "model.ffn_dim=64",
        "model.dropout=0.0", "model.max_positions=64", "data.max_bytes=40", "data.max_tokens=600", "train.log_every=1",
        "train.valid_every=0", "train.valid_max_batches=1", "train.save_every=0"]


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # what Tracker would set for itself; set here so the test process's environment is restored afterwards
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    s = Server(tmp_path / "server")
    s.start()
    yield s
    s.stop()


def _history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_sender_retries_and_delivers_backlog_once_when_server_returns(server, tmp_path, caplog):
    tr = T.Tracker(server.uri, "outage", "r", True, tmp_path, flush_every=1, local_dir=tmp_path / "tracking",
                   max_backoff=1.0, end_timeout=60)
    rid = tr.start(params={"a": 1}, tags={"t": "x"})
    for s in range(5):
        tr.log_metrics({"loss": float(s)}, step=s)
    assert tr.flush(timeout=60)
    server.stop()
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        t0 = time.monotonic()
        for s in range(5, 40):
            tr.log_metrics({"loss": float(s)}, step=s)
        tr.set_tags({"phase": "outage"})
        ds = log_toy_checkpoints(tr, tmp_path / "ckpt")
        assert time.monotonic() - t0 < 2.0  # logging never waits for the network
        assert not tr.flush(timeout=3)  # the server is down: not delivered, and flush gave up in time
        assert tr.server_failing and tr.pending > 0
        server.start()
        assert tr.flush(timeout=60)  # the sender delivers the backlog by itself
        assert tr.end("FINISHED")
    warnings = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1, warnings  # one warning for the whole outage, not one per retry
    c = MlflowClient(server.uri)
    assert _history(c, rid, "loss") == [(s, float(s)) for s in range(40)]  # each step exactly once
    run = c.get_run(rid)
    assert run.info.status == "FINISHED" and run.data.tags["phase"] == "outage" and run.data.params == {"a": "1"}
    # the journal holds everything, and syncing it again adds nothing
    rec = [r for r in T.read_journal(tmp_path / "tracking" / "journal.jsonl") if r["t"] == "m" and "loss" in r["v"]]
    assert [r["s"] for r in rec] == list(range(40))
    assert_toy_checkpoint_models(c, rid, ds)  # the sender delivered the dataset and the models by itself
    (rep,) = T.sync_run(tmp_path)
    assert rep.metrics_sent == 0 and rep.metrics_present == 40 + 2 and rep.status is None  # loss, valid/nll
    assert (rep.datasets, rep.models, rep.model_updates) == (0, 0, 0)
    assert _history(c, rid, "loss") == [(s, float(s)) for s in range(40)]


def test_training_survives_server_kill_and_sync_uploads_the_rest(server, django_shards, tmp_path, capsys):
    from scaletrain.cli import main
    from scaletrain.config import load_config
    from scaletrain.train import Trainer

    out = tmp_path / "run"
    steps, kill_at = 24, 8
    cfg = load_config("small", [*TINY, f"data.shards={django_shards}", f"train.out_dir={out}",
                                f"train.max_steps={steps}", f"tracking.uri={server.uri}", "tracking.experiment=outage",
                                "tracking.end_timeout=2", "train.valid_every=8", "train.save_every=8", "train.keep_last=1"])
    trainer = Trainer(cfg)
    trainer.tracker.flush_every = 1  # send every step: the outage interrupts real traffic
    step_times: list[float] = []
    after_step = trainer.logger.after_step

    def after_step_with_outage(*args):
        after_step(*args)
        step_times.append(time.monotonic())
        if trainer.state.step == kill_at:
            assert trainer.tracker.flush(timeout=60)  # steps 1..kill_at reached the server
            server.stop()

    trainer.logger.after_step = after_step_with_outage
    res = trainer.fit()
    t0 = time.monotonic()
    trainer.close("FINISHED")
    closing = time.monotonic() - t0
    assert res.steps == steps and trainer.tracker.server_failing
    assert closing < 2 + 3  # end() waited tracking.end_timeout, not MLflow's minutes of retries
    before = [b - a for a, b in zip(step_times[1:kill_at], step_times[2:kill_at])]
    after = [b - a for a, b in zip(step_times[kill_at:], step_times[kill_at + 1:])]
    assert max(after) < 10 * max(before) + 1.0, (before, after)  # no step waits for the dead server
    journal = T.read_journal(out / "tracking" / "journal.jsonl")
    logged = sorted(r["s"] for r in journal if r["t"] == "m" and "train/loss" in r["v"])
    assert logged == list(range(1, steps + 1))
    assert journal[-1]["t"] == "end" and journal[-1]["status"] == "FINISHED"

    t0 = time.monotonic()
    assert main(["tracking", "sync", str(out)]) == 2  # still down: one line, fast, nothing lost
    assert time.monotonic() - t0 < 30 and "nothing is lost" in capsys.readouterr().err
    server.start()
    c = MlflowClient(server.uri)
    rid = json.loads((out / "tracking" / "run.json").read_text())["run_id"]
    assert c.get_run(rid).info.status == "RUNNING"  # the end never reached the server
    assert max(s for s, _ in _history(c, rid, "train/loss")) < steps
    assert main(["tracking", "sync", str(out)]) == 0
    assert main(["tracking", "sync", str(out)]) == 0  # idempotent
    loss = _history(c, rid, "train/loss")
    assert [s for s, _ in loss] == list(range(1, steps + 1))  # every logged step exactly once
    assert loss == sorted((r["s"], r["v"]["train/loss"]) for r in journal if r["t"] == "m" and "train/loss" in r["v"])
    run = c.get_run(rid)
    assert run.info.status == "FINISHED" and run.data.metrics["train/steps"] == steps
    assert "config.yaml" in {a.path for a in c.list_artifacts(rid)}
    # the checkpoints written during the outage (steps 8, 16, 24) are logged models now, each once, with its
    # validation nll linked, the two keep_last deleted marked, the best one tagged
    models = c.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{rid}'",
                                    order_by=[{"field_name": "metrics.valid/nll", "ascending": True}])
    nll = dict(_history(c, rid, "valid/nll"))
    assert [s for s, _ in _history(c, rid, "valid/nll")] == [0, 8, 16, 24]  # each validation once
    by_step = {int(m.tags["scaletrain.checkpoint.step"]): m for m in models}
    assert sorted(by_step) == [8, 16, 24] and len(models) == 3
    assert {s: m.tags["scaletrain.checkpoint.exists"] for s, m in by_step.items()} == {8: "false", 16: "false",
                                                                                      24: "true"}
    assert {s: [(x.key, x.step, x.value) for x in m.metrics] for s, m in by_step.items()} == {
        s: [("valid/nll", s, nll[s])] for s in by_step}
    assert [m.tags["scaletrain.best"] for m in models] == ["true"] + ["false"] * (len(models) - 1)
    assert models[0].metrics[0].value == min(nll[s] for s in by_step)
    assert [d.dataset.name for d in run.inputs.dataset_inputs] == [run.data.tags["corpus"]]
    (rep,) = T.sync_run(out)  # a third sync: nothing at all
    assert (rep.metrics_sent, rep.datasets, rep.models, rep.model_updates) == (0, 0, 0, 0)


def test_unreachable_server_fails_fast_at_start_and_is_waited_for_at_resume(server, tmp_path):
    """A new job whose server does not answer stops in seconds with one line (nothing logged yet, instead
    of minutes of MLflow retries); a resumed job (its run exists) trains on and its metrics reach the
    server once it is back."""
    dead = T.Tracker(f"http://127.0.0.1:{_free_port()}", "outage", "r", True, tmp_path, local_dir=tmp_path / "dead")
    t0 = time.monotonic()
    with pytest.raises(ScaletrainError, match="unreachable at the start of the job"):
        dead.start(params={"a": 1})
    assert time.monotonic() - t0 < 15
    first = T.Tracker(server.uri, "outage", "r", True, tmp_path, flush_every=1, local_dir=tmp_path / "a",
                      max_backoff=1.0, end_timeout=60)
    rid = first.start(params={"a": 1})
    first.log_metrics({"loss": 0.0}, step=0)
    assert first.end("KILLED")  # preempted
    server.stop()
    again = T.Tracker(server.uri, "outage", "r", True, tmp_path, flush_every=1, local_dir=tmp_path / "b",
                      max_backoff=1.0, end_timeout=60)
    t0 = time.monotonic()
    assert again.resume(rid) == rid
    for s in range(1, 6):
        again.log_metrics({"loss": float(s)}, step=s)
    assert time.monotonic() - t0 < 15  # neither the resume nor the logging waited for the server
    server.start()
    assert again.end("FINISHED")
    client = MlflowClient(server.uri)
    assert _history(client, rid, "loss") == [(s, float(s)) for s in range(6)]
    assert client.get_run(rid).info.status == "FINISHED"
