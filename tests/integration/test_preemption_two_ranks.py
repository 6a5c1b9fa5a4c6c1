"""Preemption on 2 ranks under the deepspeed launcher: SIGTERM to the job's process
group (what a cluster scheduler sends) -> both ranks stop at the same step boundary, a checkpoint of that
step is written, the MLflow run ends KILLED, OUT/preempted.json names it, all processes exit well before
the launcher's 30 s SIGKILL; the same command again resumes from that step."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from helpers import DIST_DRIVER, ROOT, deepspeed_cmd, launcher_env
from test_engine_replay import TINY

OVER = [*TINY, "train.log_every=1", "tracking.enabled=true", "train.save_every=0", "optim.warmup_steps=4"]


@pytest.mark.slow
def test_sigterm_to_the_process_group_checkpoints_and_resumes(django_shards, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    env = launcher_env(tmp_path)
    log = tmp_path / "first.log"
    cmd = deepspeed_cmd(2, DIST_DRIVER, str(out), "small", f"data.shards={django_shards}",
                        f"train.out_dir={out}", "train.max_steps=100000", *OVER)
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 240
        while "step      3 |" not in log.read_text():
            assert p.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        os.killpg(p.pid, signal.SIGTERM)
        t0 = time.time()
        p.wait(timeout=60)
        # The deepspeed launcher exits on SIGTERM without waiting for its ranks: rank 0 finishes on its own
        # (checkpoint, preempted.json, run ended KILLED) within the grace period; wait for its last file.
        from mlflow.tracking import MlflowClient

        def run_status():
            if not (out / "preempted.json").is_file():
                return None
            run_id = json.loads((out / "tracking" / "run.json").read_text())["run_id"]
            return MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(run_id).info.status
        while run_status() != "KILLED" and time.time() - t0 < 60:
            time.sleep(0.25)
        took = time.time() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    text = log.read_text()
    assert took < 25, (took, text[-3000:])
    marker = json.loads((out / "preempted.json").read_text())
    step = marker["step"]
    assert marker["signal"] == "SIGTERM" and step >= 3
    ck = out / "checkpoints"
    assert (ck / "latest").read_text().strip() == f"step-{step:07d}" and (ck / f"step-{step:07d}" / "index.json").is_file()
    state = json.loads((ck / f"step-{step:07d}" / "trainer_state.json").read_text())
    assert MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(state["run_id"]).info.status == "KILLED"
    # the same command (a larger max_steps here, to finish quickly) resumes from the preemption checkpoint
    cmd2 = deepspeed_cmd(2, DIST_DRIVER, str(out), "small", f"data.shards={django_shards}",
                         f"train.out_dir={out}", f"train.max_steps={step + 2}", *OVER)
    p2 = subprocess.run(cmd2, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p2.returncode == 0, p2.stdout[-3000:] + p2.stderr[-3000:]
    assert f"resumed from {ck / f'step-{step:07d}'} at step {step}" in p2.stdout + p2.stderr
    res = json.loads((out / "result_rank0.json").read_text())
    assert res["steps"] == step + 2 and not res["preempted"] and not (out / "preempted.json").exists()
