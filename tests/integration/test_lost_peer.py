"""A lost peer ends the job fast, named, with the retryable exit code 76, and nothing lost; the job then
continues on fewer ranks with the same global batches.

On one host (loopback; the same cases across network-namespace hosts are in the multi-host tests):
- a "host" (one of two DeepSpeed launchers with a hostfile, ``--no_ssh``, as on two machines) killed with
  its rank (SIGKILL) while a checkpoint is being written: the survivor stops within seconds with one line
  naming the rank and its host, the last good checkpoint, exit 76 through its launcher;
  ``latest`` still names the previous checkpoint, which verifies; the partial one is never named;
- the same job resumed on 1 rank with ``engine.grad_accum=2`` gives the losses of the uninterrupted 2-rank
  run update for update (1e-5);
- a rank that stops answering without closing its sockets (SIGSTOP: as a host cut off from the network)
  is found by the heartbeat after ``engine.peer_timeout_s``, not after the collective timeout (10 min).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import DIST_DRIVER, ROOT, deepspeed_cmd, free_port, launcher_env, run, start_slow_run, wait_for_log
from test_nonfinite import TINY

from scaletrain.checkpoint.manager import latest_tag, verify_checkpoint

STEPS = 8
DRIVER = "tests/integration/lost_peer_driver.py"
OVER = [*TINY, f"train.max_steps={STEPS}", "train.save_every=2", "train.keep_last=3", "train.resume=true",
        "optim.warmup_steps=2", "data.num_workers=0", "train.valid_every=0"]


def _close(a: list, b: list, rel=1e-5):
    assert [s for s, _ in a] == [s for s, _ in b]
    for (s, x), (_, y) in zip(a, b):
        assert abs(x - y) <= rel * abs(y), (s, x, y)


def _wait_file(p, path, log, timeout=120):
    deadline = time.time() + timeout
    while not path.exists():
        assert p.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


@pytest.mark.slow
def test_a_rank_killed_during_a_save_stops_the_job_with_exit_76_and_it_resumes_on_one_rank(django_shards, tmp_path):
    env = launcher_env(tmp_path)
    common = ["small", f"data.shards={django_shards}", *OVER]
    ref = tmp_path / "ref"
    ref.mkdir()
    run(deepspeed_cmd(2, DIST_DRIVER, str(ref), *common, f"train.out_dir={ref}"), env)

    out = tmp_path / "run"
    out.mkdir()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    port, exe = str(free_port()), str(Path(sys.executable).with_name("deepspeed"))
    logs = [tmp_path / f"node{k}.log" for k in (0, 1)]
    slow = {**env, "SAVE_PAUSE_STEP": "4", "SAVE_PAUSE_SECONDS": "3", "SLOW_STEP_SECONDS": "0.05"}
    procs = []
    for k in (0, 1):  # one launcher per "host", each in a session of its own (killpg ends a whole host)
        with open(logs[k], "w") as f:
            procs.append(subprocess.Popen(
                [exe, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(k), "--master_addr", "127.0.0.1",
                 "--master_port", port, "--no_local_rank", DRIVER, str(out), *common, f"train.out_dir={out}"],
                env=slow, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
    p, log = procs[0], logs[0]
    try:
        _wait_file(p, out / "saving_rank1", log)  # checkpoint 4's files written, its closing all-reduce not yet
        pid1 = int((out / "pid_rank1").read_text())
        os.killpg(procs[1].pid, signal.SIGKILL)  # all of host 1: its launcher and its rank
        t0 = time.time()
        rc = p.wait(timeout=60)
        took = time.time() - t0
    finally:
        for q in procs:
            if q.poll() is None:
                os.killpg(q.pid, signal.SIGKILL)
            q.wait()
    text = log.read_text()
    print(f"SIGKILL of host 1 during a save: host 0's launcher exit {rc} after {took:.1f} s")
    assert rc == 76 and took < 15, (rc, took, text[-3000:])
    line = next(ln for ln in text.splitlines() if "scaletrain: error:" in ln and "rank 0 stops" in ln)
    assert f"rank 1 (pid {pid1} on " in line and "exit 76: retry" in line, line
    ckpts = out / "checkpoints"
    assert f"the last checkpoint, {ckpts / 'step-0000002'}, is intact" in line, line
    assert latest_tag(ckpts) == "step-0000002" and not (ckpts / "step-0000004").exists()
    verify_checkpoint(ckpts / "step-0000002")  # every file matches its index

    # back on fewer ranks: 1 rank x 2 micro-batches, from checkpoint 2 on
    r = run(deepspeed_cmd(1, DIST_DRIVER, str(out), *common, f"train.out_dir={out}", "engine.grad_accum=2"), env)
    assert "the checkpoint was written by 2 rank(s), this run has 1" in r.stdout + r.stderr
    want = json.loads((ref / "result_rank0.json").read_text())
    got = json.loads((out / "result_rank0.json").read_text())
    assert got["steps"] == STEPS and got["world_size"] == 1 and got["tokens"] == want["tokens"]
    _close(got["train_loss"], want["train_loss"][2:])


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


@pytest.mark.slow
def test_a_run_directory_one_host_does_not_see_stops_before_the_first_step_with_exit_2(django_shards, tmp_path):
    """Host 1's launcher in a mount namespace of its own with a tmpfs over the runs directory (root only)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a mount namespace with a tmpfs")
    env = launcher_env(tmp_path)
    runs = tmp_path / "runs"
    runs.mkdir()
    out = runs / "job"  # not made yet: the token goes in runs/
    drv = tmp_path / "drv"
    drv.mkdir()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    port, exe = str(free_port()), str(Path(sys.executable).with_name("deepspeed"))
    args = ["--hostfile", str(hostfile), "--no_ssh", "--master_addr", "127.0.0.1", "--master_port", port,
            "--no_local_rank", DRIVER, str(drv), "small", f"data.shards={django_shards}", *OVER,
            f"train.out_dir={out}"]
    cmds = [[exe, "--node_rank", "0", *args],
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f'mount -t tmpfs scaletrain-test "{runs}" && exec "$@"', "sh", exe, "--node_rank", "1", *args]]
    t0 = time.time()
    procs = [subprocess.Popen(c, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for c in cmds]
    texts = []
    try:
        for q in procs:
            texts.append(q.communicate(timeout=240)[0])
    finally:
        for q in procs:
            if q.poll() is None:
                os.killpg(q.pid, signal.SIGKILL)
                q.wait()
    took = time.time() - t0
    print(f"run directory not shared: launchers exit {[q.returncode for q in procs]} after {took:.1f} s")
    assert [q.returncode for q in procs] == [2, 2], texts[0][-3000:] + texts[1][-3000:]
    host = os.uname().nodename
    for text in texts:
        line = next(ln for ln in text.splitlines() if "scaletrain: error:" in ln)
        assert f"train.out_dir {out} is not the same directory on every host: {host} (rank 1) cannot see a file" \
            in line, line
        assert "step      1 |" not in text
    assert list(runs.iterdir()) == []  # the token removed, no run directory made
