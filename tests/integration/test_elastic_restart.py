"""An elastic restart under torchrun keeps the run the user configured.

Two namespace hosts (tests/netns_hosts.py), ``./launch.sh --elastic 1:2 --rdzv_conf ...`` on each: one
torchrun agent per host, ``--nnodes=1:2 --max-restarts=3 --rdzv-backend=c10d`` with short rendezvous
timeouts, the same ``-m scaletrain train`` command on both (DeepSpeed ZeRO-2, fp32, tiny model). All of host 1 (its agent and its rank) is SIGKILLed after a
checkpoint; nobody acts: host 0's rank stops (exit 76), its agent restarts it at world size 1, the run
resumes from the last checkpoint with grad_accum re-derived (2 batch slots per update before and after)
and finishes, exit 0. Its losses after the restart equal, update for update, those of the same checkpoint
resumed by hand at 1 rank x ``engine.grad_accum=2``; at most ``train.save_every`` updates are redone; the
MLflow run is one run across the restart, with the restart recorded and no step logged twice. The test
prints the time from the kill to the first update after the restart and where it goes.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from helpers import ROOT, launch_checkout, launcher_env, tiny_model

pytestmark = pytest.mark.slow
STEPS, SAVE_EVERY, PEER_TIMEOUT = 60, 4, 3
RDZV_CONF = "join_timeout=30,last_call_timeout=2,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"


def _overrides(shards: Path, out: Path) -> list[str]:
    return [f"data.shards={shards}", *tiny_model(), "data.max_tokens=400", "data.max_bytes=40", "data.num_workers=0",
            f"train.out_dir={out}", f"train.max_steps={STEPS}", "train.log_every=1", "train.valid_every=0",
            f"train.save_every={SAVE_EVERY}", "train.keep_last=100", "optim.warmup_steps=2", "engine.precision=fp32",
            "engine.ds_config=zero2.json", "engine.threads=1", f"engine.peer_timeout_s={PEER_TIMEOUT}",
            "tracking.system_metrics=false", "tracking.progress=false"]


class _Log:
    """A process's merged output, each line with the monotonic time it arrived."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc):
        for line in proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def text(self) -> str:
        return "\n".join(ln for _, ln in self.lines)

    def first(self, pattern: str, after: float = 0.0) -> tuple[float, str]:
        for t, ln in self.lines:
            if t >= after and re.search(pattern, ln):
                return t, ln
        raise AssertionError(f"no line matching {pattern!r} after the kill:\n{self.text()[-4000:]}")


def _kill_host(host, proc: subprocess.Popen) -> None:
    """SIGKILL every process of ``host`` (its network namespace): torchrun starts its workers in sessions of
    their own, so the agent's process group is not the whole host."""
    pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout.split()
    for pid in [proc.pid, *map(int, pids)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _stop(hosts, procs) -> None:
    for h, p in zip(hosts, procs):
        _kill_host(h, p)
        p.wait()


def test_a_lost_host_restarts_on_the_survivor_with_the_same_global_batch(netns_hosts, django_shards, tmp_path):
    hosts = netns_hosts(2)
    out = tmp_path / "run"
    env = {**launcher_env(tmp_path), "LOGLEVEL": "INFO"}  # the agent's own lines: its restart and rendezvous
    # the README's short form on each host; it runs the torchrun command below (asserted)
    cmd = ["bash", "./launch.sh", "--elastic", "1:2", "--nproc", "1", "--no-eval", "--out", str(out),
           "--master_addr", hosts[0].addr, "--master_port", "29541", "--rdzv_conf", RDZV_CONF,
           *_overrides(django_shards, out)]
    torchrun = (f"torchrun --nnodes=1:2 --nproc-per-node=1 --max-restarts=3 --rdzv-backend=c10d "
                f"--rdzv-endpoint={hosts[0].addr}:29541 --rdzv-id=run --rdzv-conf={RDZV_CONF} -m scaletrain train "
                "--config small data.shards=")
    checkout = launch_checkout(tmp_path)
    t_start = time.monotonic()
    procs, logs = [], []
    for h in (hosts[1], hosts[0]):  # host 1 first: it waits for host 0's store, both join the first round
        procs.insert(0, h.popen(cmd, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True))
        logs.insert(0, _Log(procs[0]))
    try:
        latest = out / "checkpoints" / "latest"
        deadline = time.monotonic() + 120
        kill_at = f"step {2 * SAVE_EVERY + 2:6d} | loss"  # mid-run: two updates after the second checkpoint
        while not (latest.is_file() and kill_at in logs[0].text()):
            assert procs[0].poll() is None and time.monotonic() < deadline, logs[0].text()[-4000:]
            time.sleep(0.02)
        _kill_host(hosts[1], procs[1])  # all of host 1: its agent and its rank
        t_kill = time.monotonic()
        rc0 = procs[0].wait(timeout=90)
        t_end = time.monotonic()
    finally:
        _stop(hosts, procs)
        for k, lg in enumerate(logs):
            lg.thread.join(timeout=5)
            (tmp_path / f"host{k}.log").write_text(lg.text())
    text = logs[0].text()
    assert rc0 == 0, text[-5000:]
    assert f"== elastic (1:2 nodes): {torchrun}" in text, text[:3000]
    before = text[:text.index("scaletrain: error:")] if "scaletrain: error:" in text else text
    assert "training small: 2 ranks" in before, before[-3000:]
    step_killed = max(int(m) for m in re.findall(r"step +(\d+) \| loss", before))

    # where the time went: the rank's line (lost peer), the agent's restart, its rendezvous, the first update
    t_err, err = logs[0].first(r"scaletrain: error: ", t_kill)
    assert "exit 76: retry" in err, err
    t_restart, _ = logs[0].first(r"[Rr]estart", t_err)
    t_rdzv, _ = logs[0].first(r"Rendezvous complete|rendezvous.*complete", t_restart)
    t_first, first = logs[0].first(r"step +\d+ \| loss", t_rdzv)
    resumed = re.search(r"resumed from (\S+) at step (\d+)", text[text.index("scaletrain: error:"):])
    assert resumed, text[-4000:]
    ckpt, resumed_step = Path(resumed.group(1)), int(resumed.group(2))
    redone = step_killed - resumed_step
    print(f"kill of host 1 at update {step_killed} -> first update after the restart: {t_first - t_kill:.1f} s "
          f"(detection {t_err - t_kill:.1f} s, agent {t_restart - t_err:.1f} s, rendezvous {t_rdzv - t_restart:.1f} s, "
          f"start-up and resume {t_first - t_rdzv:.1f} s); resumed at {resumed_step}, {redone} update(s) redone; "
          f"job {t_end - t_start:.1f} s")
    assert 0 <= redone <= SAVE_EVERY, (step_killed, resumed_step)
    assert int(re.search(r"step +(\d+)", first).group(1)) == resumed_step + 1, first

    # the same global batch: 2 slots (2 ranks x 1), then 2 (1 rank x grad_accum 2); no regroup
    after = text[text.index("scaletrain: error:"):]
    assert "training small: 1 ranks" in after, after[-3000:]
    assert "global batch kept at 2 batch slots per update: 1 data-parallel rank(s) x grad_accum 2" in after, after
    assert "batch slots per update (data-parallel size x grad_accum)" not in text  # the stream's regroup line
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == STEPS
    saved = json.loads((out / "checkpoints" / f"step-{STEPS:07d}" / "trainer_state.json").read_text())
    assert (saved["world_size"], saved["global_batch_slots"]) == (1, 2)

    # one MLflow run across the restart: the restart recorded, every step's metrics once
    from mlflow.tracking import MlflowClient

    run_id = json.loads((ckpt / "trainer_state.json").read_text())["run_id"]  # the first attempt's run
    assert summary["run_id"] == run_id and f"MLflow run {run_id}" in after
    note = f"world size 2 -> 1, resumed at step {resumed_step}, {redone} update(s) redone (elastic restart 1)"
    assert f"restart 1 of MLflow run {run_id}: {note}" in after, after[-3000:]
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    tags = client.get_run(run_id).data.tags
    assert (tags["restarts"], tags["restart.1"]) == ("1", note), tags
    logged = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    assert sorted(logged) == list(range(1, STEPS + 1)), logged

    # the same checkpoint resumed by hand: 1 rank x engine.grad_accum=2
    hand = tmp_path / "hand"
    shutil.copytree(ckpt, hand / "checkpoints" / ckpt.name)
    (hand / "checkpoints" / "latest").write_text(ckpt.name)
    t0 = time.monotonic()
    r = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-m", "scaletrain", "train", "--config", "small",
                        *_overrides(django_shards, hand), "engine.grad_accum=2", "tracking.enabled=false"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    print(f"hand resume from {ckpt.name}: {time.monotonic() - t0:.1f} s")
    want = json.loads((hand / "train_summary.json").read_text())["train_loss"]
    got = summary["train_loss"]
    assert [s for s, _ in got] == [s for s, _ in want] == list(range(resumed_step + 1, STEPS + 1))
    for (s, x), (_, y) in zip(got, want):
        assert abs(x - y) <= 1e-5 * abs(y), (s, x, y)
