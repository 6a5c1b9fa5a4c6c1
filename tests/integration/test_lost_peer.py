"""A rank that stops answering without closing its sockets (SIGSTOP, on one host) is found by the heartbeat
after ``engine.peer_timeout_s``, not after the collective timeout (10 min): rank 0 stops with one line and
exit 76 (retry). The lost-host cases across network-namespace hosts are in test_lost_host.py.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from helpers import deepspeed_cmd, launcher_env, start_slow_run, wait_for_log
from test_nonfinite import TINY

DRIVER = "tests/integration/lost_peer_driver.py"


@pytest.mark.slow
def test_a_rank_that_stops_answering_is_found_by_the_heartbeat_within_peer_timeout(django_shards, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    log = tmp_path / "hang.log"
    timeout_s = 4
    cmd = deepspeed_cmd(2, DRIVER, str(out), "small", f"data.shards={django_shards}", *TINY, f"train.out_dir={out}",
                        "train.max_steps=100000", "train.save_every=0", "train.valid_every=0",
                        f"engine.peer_timeout_s={timeout_s}")  # engine.collective_timeout_minutes: 10 (default)
    p = start_slow_run(cmd, launcher_env(tmp_path), log, 0.05)
    pid1 = None
    try:
        wait_for_log(p, log, "step      3 |")
        pid1 = int((out / "pid_rank1").read_text())
        os.kill(pid1, signal.SIGSTOP)
        t0 = time.time()
        wait_for_log(p, log, "scaletrain: error:", timeout=60)  # rank 0's line, then its exit
        took = time.time() - t0
        # The launcher polls its ranks as a set, in no fixed order: kill the stopped rank only once it has
        # taken rank 0's code ("Killing subprocess" follows), else it may report rank 1's -9 instead of 76.
        # Killing it then spares the 30 s the launcher gives a stopped rank to end after SIGTERM.
        wait_for_log(p, log, "Killing subprocess", timeout=60)
        os.kill(pid1, signal.SIGKILL)
        rc = p.wait(timeout=60)
    finally:
        if pid1 is not None:
            try:
                os.kill(pid1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    text = log.read_text()
    print(f"SIGSTOP of rank 1 (peer_timeout_s={timeout_s}): rank 0's line after {took:.1f} s, launcher exit {rc}")
    assert rc == 76 and timeout_s - 0.5 < took < timeout_s + 6, (rc, took, text[-3000:])
    line = next(ln for ln in text.splitlines() if "scaletrain: error:" in ln)
    assert line.startswith(f"scaletrain: error: lost {os.uname().nodename} (rank 1): no heartbeat for {timeout_s} s"), line
    assert "rank 0 on" in line and "exit 76: retry" in line and "no checkpoint was written yet" in line, line
