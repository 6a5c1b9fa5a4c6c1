"""The background sender without a server process: an outage (the store raising connection errors) is
retried with backoff behind one warning; memory stays bounded in a long outage (the journal keeps what
was shed); sync uploads exactly what is missing."""
from __future__ import annotations

import logging
import threading
import time

from mlflow import MlflowClient

from scaletrain import tracking as T

from helpers import assert_toy_checkpoint_models, log_toy_checkpoints


def _flaky(tr):
    real, down = tr.outbox.sender._execute, threading.Event()
    down.set()

    def execute(kind, payload):
        if down.is_set():
            raise ConnectionError("connection refused")
        real(kind, payload)

    tr.outbox.sender._execute = execute
    return down


def test_long_outage_bounded_memory_and_sync_fills_the_gap(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    run_dir = tmp_path / "run"
    tr = T.Tracker(uri, "e", "r", True, tmp_path, flush_every=1, local_dir=run_dir / "tracking", max_backoff=0.05,
                   max_queued=10, end_timeout=60)
    rid = tr.start()
    down = _flaky(tr)
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        t0 = time.monotonic()
        for s in range(50):
            tr.log_metrics({"loss": float(s)}, step=s)
        assert time.monotonic() - t0 < 2.0
        time.sleep(0.3)  # several retries
        assert tr.server_failing and tr.pending <= 11 and tr.outbox.sender.dropped >= 39  # capped in memory
        down.clear()
        assert tr.end() is False  # the run ended, but some values are only in the journal
        assert not tr.outbox.sender.is_alive()
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in m for m in msgs) == 1
    assert sum("kept only in the run directory" in m for m in msgs) == 1
    assert any("tracking sync" in m and str(run_dir) in m for m in msgs)
    c = MlflowClient(uri)
    sent = len(c.get_metric_history(rid, "loss"))
    assert 0 < sent < 50 and c.get_run(rid).info.status == "FINISHED"
    (rep,) = T.sync_run(run_dir)
    assert rep.metrics_sent == 50 - sent and rep.metrics_present == sent
    assert sorted((m.step, m.value) for m in c.get_metric_history(rid, "loss")) == [(s, float(s)) for s in range(50)]


def _run_while_down(tmp_path, monkeypatch):
    """(a tracker whose run was created in ``tmp_path/mlruns.db`` and whose sender finds the store down from
    then on, its run id, the store's URI); the run's directory is ``tmp_path/run``."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    tr = T.Tracker(uri, "e", "r", True, tmp_path, flush_every=1, local_dir=tmp_path / "run" / "tracking",
                   max_backoff=0.05)
    rid = tr.start()
    _flaky(tr)
    return tr, rid, uri


def test_end_status_waits_in_the_journal_when_the_store_stays_down(tmp_path, monkeypatch):
    tr, rid, uri = _run_while_down(tmp_path, monkeypatch)
    tr.log_metrics({"loss": 1.0}, step=1)
    t0 = time.monotonic()
    assert tr.end("KILLED", timeout=0.5) is False
    assert time.monotonic() - t0 < 2.0
    assert not tr.outbox.sender.is_alive()  # ended and joined: nothing of tracking is left running at exit
    c = MlflowClient(uri)
    assert c.get_run(rid).info.status == "RUNNING"
    (rep,) = T.sync_run(tmp_path / "run")
    assert rep.status == "KILLED" and rep.metrics_sent == 1 and c.get_run(rid).info.status == "KILLED"
    (rep,) = T.sync_run(tmp_path / "run")
    assert rep.status is None and rep.metrics_sent == 0


def test_sync_brings_datasets_and_checkpoint_models_the_store_missed(tmp_path, monkeypatch):
    """The store is down from the start of the run to its end: `tracking sync` brings the dataset input, the
    checkpoints' logged models, their tags, linked metrics and the end status; run again, it sends nothing."""
    tr, rid, uri = _run_while_down(tmp_path, monkeypatch)
    ds = log_toy_checkpoints(tr, tmp_path / "ckpt")
    assert tr.end("FINISHED", timeout=0.5) is False
    c = MlflowClient(uri)
    run = c.get_run(rid)
    assert not run.inputs.dataset_inputs and c.search_logged_models([run.info.experiment_id]) == []
    (rep,) = T.sync_run(tmp_path / "run")
    assert (rep.datasets, rep.models, rep.status, rep.metrics_sent) == (1, 2, "FINISHED", 2)
    assert rep.model_updates == 2 + 3  # a linked value per model; exists=false on step 10, best on step 20 and 10
    assert_toy_checkpoint_models(c, rid, ds)
    (rep,) = T.sync_run(tmp_path / "run")
    assert (rep.datasets, rep.models, rep.model_updates, rep.metrics_sent, rep.status) == (0, 0, 0, 0, None)
    assert_toy_checkpoint_models(c, rid, ds)

