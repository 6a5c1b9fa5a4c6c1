"""A hung rank (SIGSTOP): the process group's timeout is engine.collective_timeout_minutes, so the
other rank's blocked all-reduce fails after that bound (not gloo's default 30 minutes) and it stops with one line
saying the peers on its host are alive but a collective timed out."""
from __future__ import annotations

import os
import signal
import time

import pytest

from helpers import deepspeed_cmd, launcher_env, start_slow_run, wait_for_log
from test_nonfinite import TINY

TIMEOUT_MIN = 0.1  # 6 s


@pytest.mark.slow
def test_a_hung_rank_makes_the_other_stop_after_the_collective_timeout(django_shards, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    log = tmp_path / "run.log"
    cmd = deepspeed_cmd(2, "tests/integration/slow_driver.py", str(out), "small", *TINY,
                        f"data.shards={django_shards}", f"train.out_dir={out}", "train.max_steps=100000",
                        "train.save_every=0", f"engine.collective_timeout_minutes={TIMEOUT_MIN}")
    p = start_slow_run(cmd, launcher_env(tmp_path), log, 0.1)
    pid1 = None
    try:
        wait_for_log(p, log, "step      3 |")
        pid1 = int((out / "pid_rank1").read_text())
        os.kill(pid1, signal.SIGSTOP)
        t0 = time.time()
        while "collective failed on rank 0" not in log.read_text() and time.time() - t0 < 90:
            time.sleep(0.2)
        took = time.time() - t0
    finally:
        if pid1 is not None:
            os.kill(pid1, signal.SIGCONT)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    text = log.read_text()
    assert TIMEOUT_MIN * 60 - 1 < took < TIMEOUT_MIN * 60 + 20, (took, text[-3000:])
    line = next(ln for ln in text.splitlines() if "collective failed on rank 0" in ln)
    assert "is alive: a peer is hung" in line and "engine.collective_timeout_minutes" in line, line
