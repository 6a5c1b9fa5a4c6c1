"""SIGTERM to the bare ``deepspeed`` runner alone (a container runtime's SIGTERM to PID 1 when
the user runs ``deepspeed ... -m scaletrain train`` as the container command). The runner does not forward it on
one node and dies, leaving DeepSpeed's launch.py and the ranks behind; the ranks notice their launcher chain broke
(scaletrain.train.preemption.LauncherWatch), checkpoint at the next step boundary, write preempted.json and exit,
well before a container's usual 30 s kill."""
from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from helpers import deepspeed_cmd, launcher_env, start_slow_run, wait_for_log
from test_nonfinite import TINY


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_sigterm_to_the_runner_alone_checkpoints_and_the_ranks_exit(django_shards, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    log = tmp_path / "run.log"
    cmd = deepspeed_cmd(2, "tests/integration/slow_driver.py", str(out), "small", *TINY,
                        f"data.shards={django_shards}", f"train.out_dir={out}", "train.max_steps=100000",
                        "train.save_every=0", runner=True)
    p = start_slow_run(cmd, launcher_env(tmp_path), log, 0.2)
    try:
        wait_for_log(p, log, "step      3 |")
        pids = [int((out / f"pid_rank{r}").read_text()) for r in (0, 1)]
        p.send_signal(signal.SIGTERM)  # the runner only, not its process group
        t0 = time.time()
        p.wait(timeout=30)
        while any(_alive(pid) for pid in pids) and time.time() - t0 < 60:
            time.sleep(0.2)
        took = time.time() - t0
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # whatever is left of the job (nothing, when it works)
        except ProcessLookupError:
            pass
    text = log.read_text()
    assert took < 20, (took, text[-3000:])
    assert "the deepspeed runner (pid" in text and "treating it as SIGTERM" in text
    marker = json.loads((out / "preempted.json").read_text())
    step = marker["step"]
    assert marker["signal"] == "SIGTERM" and step >= 3
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{step:07d}"
