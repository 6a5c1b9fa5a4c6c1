"""kill -9 of one rank of 2: the other rank stops within seconds with one line naming the
dead rank, the launcher exits non-zero, and re-running the same job resumes bit-identically to a run that was
never interrupted."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from helpers import DIST_DRIVER, deepspeed_cmd, launcher_env, run, start_slow_run, wait_for_log
from test_nonfinite import TINY

STEPS = 10
OVER = [*TINY, f"train.max_steps={STEPS}", "train.save_every=2", "train.keep_last=2", "train.resume=true"]


@pytest.mark.slow
def test_kill_9_of_a_rank_names_it_and_the_job_resumes_bit_identically(django_shards, tmp_path):
    env = launcher_env(tmp_path)
    common = ["small", f"data.shards={django_shards}", *OVER]
    ref = tmp_path / "ref"
    ref.mkdir()
    run(deepspeed_cmd(2, DIST_DRIVER, str(ref), *common, f"train.out_dir={ref}"), env)

    out = tmp_path / "run"
    out.mkdir()
    log = tmp_path / "crash.log"
    cmd = deepspeed_cmd(2, "tests/integration/slow_driver.py", str(out), *common, f"train.out_dir={out}")
    p = start_slow_run(cmd, env, log, 0.3)
    try:
        wait_for_log(p, log, "step      3 |")
        pid1 = int((out / "pid_rank1").read_text())
        os.kill(pid1, signal.SIGKILL)
        t0 = time.time()
        rc = p.wait(timeout=60)
        took = time.time() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc != 0 and took < 10, (rc, took, text[-3000:])
    assert f"rank 1 (pid {pid1} on " in text and "died; rank 0 stops" in text, text[-3000:]
    assert "re-run the same command to resume" in text
    assert (out / "checkpoints" / "latest").is_file() and not (out / "result_rank0.json").exists()

    run(deepspeed_cmd(2, DIST_DRIVER, str(out), *common, f"train.out_dir={out}"), env)  # the same job again
    for r in (0, 1):
        a, b = torch.load(ref / f"params_rank{r}.pt"), torch.load(out / f"params_rank{r}.pt")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
