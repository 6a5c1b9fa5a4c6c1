"""A lost host ends the job fast, named, with the retryable exit code 76, and nothing lost; the job then
continues on fewer hosts with the same global batches. On two hosts made of network namespaces
(tests/netns_hosts.py: each its own network stack, address, hostname and /etc/hosts; one filesystem):

- all of host 1 (its launcher and its rank) killed with SIGKILL while a checkpoint is being written: host 0
  stops within seconds with one line naming host 1 and its rank and the last good checkpoint, exit 76
  through its launcher; ``latest`` still names the previous checkpoint, which verifies; the partial one is
  never named. The same job then resumed on host 0 alone with ``engine.grad_accum=2`` gives the losses of
  the uninterrupted 2-rank run update for update (1e-5);
- host 1's link set down mid-step (a partition: no reset, half-open connections): both hosts stop within
  ``engine.peer_timeout_s`` (10 s here; default 60) plus a few seconds, exit 76, each with one line: host 0
  names host 1 and its rank, host 1 says rank 0's host (the rendezvous store) is unreachable;
- a run directory host 1 does not see (a tmpfs over it in host 1's mount namespace): both hosts stop before
  the first step with one line naming the host that cannot see it, exit 2, nothing written.
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

from helpers import DIST_DRIVER, ROOT, deepspeed_cmd, launcher_env, run
from test_nonfinite import TINY

from scaletrain.checkpoint.manager import latest_tag, verify_checkpoint

pytestmark = pytest.mark.slow
DRIVER = "tests/integration/lost_peer_driver.py"
PEER_TIMEOUT = 10
STEPS = 8
OVER = [*TINY, f"train.max_steps={STEPS}", "train.save_every=2", "train.keep_last=3", "train.resume=true",
        "optim.warmup_steps=2", "data.num_workers=0", "train.valid_every=0"]
DEEPSPEED = str(Path(sys.executable).with_name("deepspeed"))


def _close(a: list, b: list, rel=1e-5):
    assert [s for s, _ in a] == [s for s, _ in b]
    for (s, x), (_, y) in zip(a, b):
        assert abs(x - y) <= rel * abs(y), (s, x, y)


def _launcher(hosts, hostfile: Path, k: int, port: int, *args: str) -> list[str]:
    """Host k's DeepSpeed launcher: the hostfile names both hosts, ``--no_ssh --node_rank K``."""
    return [DEEPSPEED, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(k), "--master_addr", hosts[0].addr,
            "--master_port", str(port), "--no_local_rank", *args]


def _hostfile(hosts, tmp_path: Path) -> Path:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h.hostname} slots=1\n" for h in hosts))
    return hostfile


def test_host_1_killed_during_a_save_stops_host_0_with_exit_76_and_the_job_resumes_on_host_0_alone(
        netns_hosts, django_shards, tmp_path):
    hosts = netns_hosts(2)
    env = launcher_env(tmp_path)
    common = ["small", f"data.shards={django_shards}", *OVER]
    # the uninterrupted run: 2 ranks on one host (bitwise the same as 2 hosts x 1 rank: test_multi_host.py)
    ref = tmp_path / "ref"
    ref.mkdir()
    run(deepspeed_cmd(2, DIST_DRIVER, str(ref), *common, f"train.out_dir={ref}"), env)

    out = tmp_path / "run"
    out.mkdir()
    hostfile = _hostfile(hosts, tmp_path)
    logs = [tmp_path / f"host{k}.log" for k in (0, 1)]
    slow = {**env, "SAVE_PAUSE_STEP": "4", "SAVE_PAUSE_SECONDS": "3", "SLOW_STEP_SECONDS": "0.05"}
    procs = []
    for k, h in enumerate(hosts):  # each launcher in a session of its own: killpg ends all of a host
        with open(logs[k], "w") as f:
            procs.append(h.popen(_launcher(hosts, hostfile, k, 29541, DRIVER, str(out), *common,
                                           f"train.out_dir={out}"),
                                 env=slow, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
    p, log = procs[0], logs[0]
    try:
        deadline = time.time() + 180
        while not (out / "saving_rank1").exists():  # checkpoint 4's files written, its closing all-reduce not yet
            assert p.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
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
    # the kill comes during rank 0's 3 s pause inside the save; then the failed collective, and the heartbeat
    # confirms whose counters stopped (three intervals: 6 s at the default engine.peer_timeout_s=60)
    assert rc == 76 and took < 20, (rc, took, text[-3000:])
    line = next(ln for ln in text.splitlines() if "scaletrain: error:" in ln)
    assert line.startswith(f"scaletrain: error: lost {hosts[1].hostname} (rank 1): collective failed"), line
    assert f"rank 0 on {hosts[0].hostname} stops (exit 76: retry)" in line, line
    ckpts = out / "checkpoints"
    assert f"the last checkpoint, {ckpts / 'step-0000002'}, is intact" in line, line
    assert latest_tag(ckpts) == "step-0000002" and not (ckpts / "step-0000004").exists()
    verify_checkpoint(ckpts / "step-0000002")  # every file matches its index

    # back on host 0 alone: 1 rank x 2 micro-batches, from checkpoint 2 on
    r = hosts[0].run(deepspeed_cmd(1, DIST_DRIVER, str(out), *common, f"train.out_dir={out}", "engine.grad_accum=2"),
                     env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "the checkpoint was written by 2 rank(s), this run has 1" in r.stdout + r.stderr
    want = json.loads((ref / "result_rank0.json").read_text())
    got = json.loads((out / "result_rank0.json").read_text())
    assert got["steps"] == STEPS and got["world_size"] == 1 and got["tokens"] == want["tokens"]
    _close(got["train_loss"], want["train_loss"][2:])


def test_a_run_directory_host_1_does_not_see_stops_both_hosts_before_the_first_step_with_exit_2(
        netns_hosts, django_shards, tmp_path):
    """Host 1's launcher with a tmpfs over the runs directory in its own mount namespace (``ip netns exec``
    gives each command one; the mount stays inside it)."""
    hosts = netns_hosts(2)
    env = launcher_env(tmp_path)
    runs = tmp_path / "runs"
    runs.mkdir()
    out = runs / "job"  # not made yet: the token goes in runs/
    drv = tmp_path / "drv"
    drv.mkdir()
    hostfile = _hostfile(hosts, tmp_path)
    args = [DRIVER, str(drv), "small", f"data.shards={django_shards}", *OVER, f"train.out_dir={out}"]
    cmds = [_launcher(hosts, hostfile, 0, 29542, *args),
            ["sh", "-c", f'mount -t tmpfs scaletrain-test "{runs}" && exec "$@"', "sh",
             *_launcher(hosts, hostfile, 1, 29542, *args)]]
    t0 = time.time()
    procs = [h.popen(c, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                     start_new_session=True) for h, c in zip(hosts, cmds)]
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
    for text in texts:
        line = next(ln for ln in text.splitlines() if "scaletrain: error:" in ln)
        assert (f"train.out_dir {out} is not the same directory on every host: {hosts[1].hostname} (rank 1) "
                "cannot see a file") in line, line
        assert "step      1 |" not in text
    assert list(runs.iterdir()) == []  # the token removed, no run directory made


def test_a_host_whose_link_goes_down_stops_both_hosts_with_exit_76(netns_hosts, django_shards, tmp_path):
    hosts = netns_hosts(2)
    hostfile = _hostfile(hosts, tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    env = {**launcher_env(tmp_path), "SLOW_STEP_SECONDS": "0.05"}
    logs = [tmp_path / f"host{k}.log" for k in (0, 1)]
    procs = []
    for k, h in enumerate(hosts):
        with open(logs[k], "w") as f:
            procs.append(h.popen(
                _launcher(hosts, hostfile, k, 29531, DRIVER, str(out), "small", f"data.shards={django_shards}",
                          *TINY, f"train.out_dir={out}", "train.max_steps=100000", "train.save_every=0",
                          "train.valid_every=0", f"engine.peer_timeout_s={PEER_TIMEOUT}"),
                env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        deadline = time.time() + 180
        while "step      3 |" not in logs[0].read_text():
            assert all(p.poll() is None for p in procs) and time.time() < deadline, logs[0].read_text()[-3000:]
            time.sleep(0.1)
        subprocess.run(["ip", "netns", "exec", hosts[1].netns, "ip", "link", "set", hosts[1].iface, "down"], check=True)
        t0 = time.time()
        took = []
        for p in procs:
            p.wait(timeout=120)
            took.append(time.time() - t0)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        subprocess.run(["ip", "netns", "exec", hosts[1].netns, "ip", "link", "set", hosts[1].iface, "up"])
    texts = [lg.read_text() for lg in logs]
    print(f"link of host 1 down: exits {[p.returncode for p in procs]} after {[round(t, 1) for t in took]} s "
          f"(engine.peer_timeout_s={PEER_TIMEOUT})")
    assert [p.returncode for p in procs] == [76, 76], texts[0][-2000:] + texts[1][-2000:]
    assert all(t < PEER_TIMEOUT + 10 for t in took), took
    line0 = next(ln for ln in texts[0].splitlines() if "scaletrain: error:" in ln)
    assert line0.startswith(f"scaletrain: error: lost {hosts[1].hostname} (rank 1): no heartbeat for {PEER_TIMEOUT} s"), line0
    assert f"rank 0 on {hosts[0].hostname} stops (exit 76: retry)" in line0, line0
    line1 = next(ln for ln in texts[1].splitlines() if "scaletrain: error:" in ln)
    assert f"{hosts[0].hostname} (rank 0's host, which holds the rendezvous store) is unreachable" in line1, line1
