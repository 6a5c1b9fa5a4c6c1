"""System metrics per node: MLflow's monitors sampled on each node's local rank 0 into the one run; a
sampler that loses the server keeps sampling and its samples reach the run when the server is back (MLflow's
own SystemMetricsMonitor stops for good after one failed call); two "nodes" on one machine both report."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from tracking_server import Server  # tests/integration/tracking_server.py

from helpers import DIST_DRIVER, ROOT, free_port, launcher_env

from scaletrain.tracking import NodeSystemMetrics, node_layout

CPU = "cpu_utilization_percentage"


@pytest.mark.parametrize("env,expected", [
    ({"CROSS_RANK": "1", "CROSS_SIZE": "2", "LOCAL_SIZE": "4"}, (1, 2)),  # deepspeed launcher
    ({"GROUP_RANK": "3", "GROUP_WORLD_SIZE": "4"}, (3, 4)),  # torchrun / accelerate launch
    ({"LOCAL_WORLD_SIZE": "2"}, (1, 2)),  # rank 3 of 4, 2 per node
    ({}, (0, 1)),
])
def test_node_layout(env, expected):
    assert node_layout(3, 4, env) == expected


def _wait(pred, timeout=60.0, what=""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_sampler_survives_a_server_outage_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    server = Server(tmp_path / "server")
    server.start()
    try:
        c = MlflowClient(server.uri)
        rid = c.create_run(c.create_experiment("sys")).info.run_id
        step = {"now": 1}
        sm = NodeSystemMetrics(server.uri, rid, "node3", interval=0.2, step=lambda: step["now"], max_backoff=0.5)
        sm.start()
        key = f"system/node3/{CPU}"

        def steps():
            try:
                return {m.step for m in c.get_metric_history(rid, key)}
            except Exception:  # noqa: BLE001 - the server is down
                return set()

        _wait(lambda: 1 in steps(), what="samples before the outage")
        server.stop()
        step["now"] = 2
        n = sm.samples
        _wait(lambda: sm.samples >= n + 5, what="samples during the outage")  # sampling goes on
        server.start()
        step["now"] = 3
        _wait(lambda: {1, 2, 3} <= steps(), what="the backlog and new samples after the restart")
        assert sm.stop(timeout=30)
        run = c.get_run(rid)
        assert run.data.tags["node3.host"]
        assert {f"system/node3/{k}" for k in (CPU, "system_memory_usage_megabytes")} <= set(run.data.metrics)
    finally:
        server.stop()


@pytest.mark.slow
def test_two_nodes_report_system_metrics_on_the_one_run(django_shards, tmp_path):
    """Two `deepspeed` launchers (one rank each) with a hostfile on 127.0.0.1, as in test_multi_host (there on namespace hosts)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    env = launcher_env(tmp_path)  # MLFLOW_TRACKING_URI: a SQLite store in tmp_path
    out = tmp_path / "run"
    out.mkdir()
    overrides = ["model.d_model=32", "model.n_heads=2", "model.encoder_layers=1", "model.decoder_layers=1",
                 "model.ffn_dim=64", "model.max_positions=64", "data.max_bytes=40", "data.max_tokens=600",
                 "train.log_every=2", "train.valid_every=0", "train.save_every=0", "train.max_steps=6",
                 "engine.ds_config=zero1.json", "tracking.system_metrics_interval=0.5",
                 f"data.shards={django_shards}", f"train.out_dir={out}"]
    port, exe = str(free_port()), str(Path(sys.executable).with_name("deepspeed"))
    procs = [subprocess.Popen([exe, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(k), "--master_addr",
                               "127.0.0.1", "--master_port", port, "--no_local_rank", DIST_DRIVER, str(out), "small",
                               *overrides], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for k in (0, 1)]
    for p in procs:
        try:
            text, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, text[-4000:]
    res = [json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    assert res[0]["run_id"] == res[1]["run_id"]
    run = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(res[0]["run_id"])
    for node in ("node0", "node1"):  # both nodes' samples, on the one run
        assert f"system/{node}/{CPU}" in run.data.metrics and run.data.tags[f"{node}.host"], node
    assert run.data.tags["nodes"] == "2"


def test_samples_the_server_never_got_are_uploaded_by_tracking_sync(tmp_path):
    """A sampler whose server never answers (nothing listens on its port) journals every sample; the job
    ends with them undelivered; `tracking sync` puts them on the run, once."""
    from helpers import free_port

    from scaletrain.tracking import Tracker, read_journal, sync_run
    from scaletrain.tracking.journal import JOURNAL

    store = f"sqlite:///{tmp_path / 'mlruns.db'}"
    tr = Tracker(store, "sys-sync", "r", True, tmp_path, local_dir=tmp_path / "tracking")
    rid = tr.start()
    tr.end()
    step = {"now": 7}
    sm = NodeSystemMetrics(f"http://127.0.0.1:{free_port()}", rid, "node1", interval=0.1, step=lambda: step["now"],
                           max_backoff=0.2, journal_dir=tmp_path / "tracking" / "system" / "node1")
    sm.start()
    _wait(lambda: sm.samples >= 3, what="samples")
    step["now"] = 8
    assert not sm.stop(timeout=0.5)  # the server never answered
    c = MlflowClient(store)
    assert c.get_metric_history(rid, f"system/node1/{CPU}") == []
    (rep,) = sync_run(tmp_path)
    got = sorted((m.step, m.timestamp) for m in c.get_metric_history(rid, f"system/node1/{CPU}"))
    journal = read_journal(tmp_path / "tracking" / "system" / "node1" / JOURNAL)
    assert len(journal) == sm.samples >= 4  # every sample journaled, the last one (taken by stop) too
    # every journaled sample is on the run (two samples the loop and stop() took in the same millisecond are one
    # point of MLflow's history when their values are equal)
    assert set(got) == {(r["s"], r["ts"]) for r in journal} and {s for s, _ in got} == {7, 8}
    (again,) = sync_run(tmp_path)
    assert again.metrics_sent == 0  # nothing twice
