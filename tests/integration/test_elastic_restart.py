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

Then host 1 comes back (growing back): once host 0 has trained a few updates alone, the same command is
started on host 1 again. Host 0's agent sees the waiting node and restarts its worker group (SIGTERM: the
rank checkpoints at the next step boundary and exits 75), both agents meet in a new round and the job goes
on at world size 2 from that checkpoint (2 ranks x grad_accum 1: the same 2 batch slots per update), nothing
redone, and ends with exit 0 on both hosts. Its losses after the grow-back equal those of the same
checkpoint resumed by hand at 2 ranks x ``engine.grad_accum=1``; the MLflow run records both restarts. This
needs ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torchrun (``launch.sh --elastic`` sets it): with torch's
shared store the new round's rendezvous times out. While host 1 starts, host 0's rank is paused (SIGSTOP,
SIGCONT once host 0's agent has seen the new node): the run's steps take milliseconds here, and a run
this short would otherwise end before a second Python process has started on a loaded 2-core machine.
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

from helpers import ROOT, deepspeed_cmd, launch_checkout, launcher_env, tiny_model

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

    def find(self, pattern: str, after: float = 0.0) -> tuple[float, str] | None:
        for t, ln in list(self.lines):
            if t >= after and re.search(pattern, ln):
                return t, ln
        return None

    def first(self, pattern: str, after: float = 0.0) -> tuple[float, str]:
        found = self.find(pattern, after)
        if found is None:
            raise AssertionError(f"no line matching {pattern!r} after the kill:\n{self.text()[-4000:]}")
        return found

    def wait_for(self, pattern: str, after: float, proc: subprocess.Popen, timeout: float) -> tuple[float, str]:
        """The first line matching ``pattern`` that arrived at or after ``after``, waiting for it while
        ``proc`` runs (at most ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while (found := self.find(pattern, after)) is None:
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"no line matching {pattern!r} (exit {proc.poll()}):\n{self.text()[-4000:]}"
            time.sleep(0.02)
        return found


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


def _rank_pid(host) -> int:
    """The pid of the one rank on ``host``: the child of its torchrun agent."""
    import psutil

    for pid in subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout.split():
        try:
            proc = psutil.Process(int(pid))
            if "torchrun" in " ".join(proc.cmdline()[:2]):
                return next(c.pid for c in proc.children() if "scaletrain" in " ".join(c.cmdline()))
        except (psutil.Error, StopIteration):
            continue
    raise AssertionError(f"no rank under a torchrun agent on {host.hostname}")


def _hand_resume(ckpt: Path, out: Path, shards: Path, env: dict, nproc: int) -> subprocess.Popen:
    """``ckpt`` copied into a run directory of its own and resumed by hand at ``nproc`` rank(s) x
    ``engine.grad_accum`` = 2 / ``nproc`` (the run's 2 batch slots), MLflow off; started, not waited for."""
    shutil.copytree(ckpt, out / "checkpoints" / ckpt.name)
    (out / "checkpoints" / "latest").write_text(ckpt.name)
    args = ["train", "--config", "small", *_overrides(shards, out), f"engine.grad_accum={2 // nproc}",
            "tracking.enabled=false"]
    cmd = ([str(ROOT / ".venv" / "bin" / "python"), "-m", "scaletrain", *args] if nproc == 1
           else deepspeed_cmd(nproc, "scaletrain", *args))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_lost_host_restarts_on_the_survivor_and_grows_back_with_the_same_global_batch(netns_hosts, django_shards,
                                                                                       tmp_path):
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

    def start(h) -> tuple[subprocess.Popen, _Log]:
        proc = h.popen(cmd, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       start_new_session=True)
        return proc, _Log(proc)

    t_start = time.monotonic()
    procs, logs = [None, None], [None, None]
    procs[1], logs[1] = start(hosts[1])  # host 1 first: it waits for host 0's store, both join the first round
    procs[0], logs[0] = start(hosts[0])
    first_logs, paused = [], None
    try:
        latest = out / "checkpoints" / "latest"
        deadline = time.monotonic() + 120
        kill_at = f"step {2 * SAVE_EVERY + 2:6d} | loss"  # mid-run: two updates after the second checkpoint
        while not (latest.is_file() and kill_at in logs[0].text()):
            assert procs[0].poll() is None and time.monotonic() < deadline, logs[0].text()[-4000:]
            time.sleep(0.02)
        _kill_host(hosts[1], procs[1])  # all of host 1: its agent and its rank
        t_kill = time.monotonic()
        procs[1].wait()
        logs[1].thread.join(timeout=5)
        first_logs.append(logs[1])

        # growing back: host 0 trains a few updates alone (3 past the one killed), its rank is paused while
        # host 1 starts (the run would end first otherwise), and goes on once host 0's agent saw the new node
        t_err, _ = logs[0].wait_for(r"scaletrain: error: ", t_kill, procs[0], 60)
        logs[0].wait_for(rf"step +{2 * SAVE_EVERY + 5} \| loss", t_err, procs[0], 90)
        paused = _rank_pid(hosts[0])
        os.kill(paused, signal.SIGSTOP)
        t_join = time.monotonic()
        procs[1], logs[1] = start(hosts[1])  # the same command again
        t_seen, _ = logs[0].wait_for(r"Detected \d+ new nodes", t_join, procs[0], 90)
        os.kill(paused, signal.SIGCONT)
        paused = None
        rc0 = procs[0].wait(timeout=150)
        rc1 = procs[1].wait(timeout=30)
        t_end = time.monotonic()
    finally:
        if paused is not None:
            os.kill(paused, signal.SIGCONT)
        _stop(hosts, procs)
        for k, lg in enumerate(logs):
            lg.thread.join(timeout=5)
            (tmp_path / f"host{k}.log").write_text(lg.text())
        if first_logs:
            (tmp_path / "host1-first.log").write_text(first_logs[0].text())
    text = logs[0].text()
    assert rc0 == 0 and rc1 == 0, (rc0, rc1, text[-5000:], logs[1].text()[-3000:])
    assert f"== elastic (1:2 nodes): {torchrun}" in text, text[:3000]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in text  # launch.sh set it: no rank-0 line about it
    before = text[:text.index("scaletrain: error:")]
    assert "training small: 2 ranks" in before, before[-3000:]
    step_killed = max(int(m) for m in re.findall(r"step +(\d+) \| loss", before))

    # where the time went: the rank's line (lost peer), the agent's restart, its rendezvous, the first update
    assert "exit 76: retry" in logs[0].first(r"scaletrain: error: ", t_kill)[1]
    t_restart, _ = logs[0].first(r"[Rr]estart", t_err)
    t_rdzv, _ = logs[0].first(r"Rendezvous complete|rendezvous.*complete", t_restart)
    t_first, first = logs[0].first(r"step +\d+ \| loss", t_rdzv)
    alone = text[text.index("scaletrain: error:"):]
    resumed = re.search(r"resumed from (\S+) at step (\d+)", alone)
    assert resumed, text[-4000:]
    ckpt, resumed_step = Path(resumed.group(1)), int(resumed.group(2))
    redone = step_killed - resumed_step
    print(f"kill of host 1 at update {step_killed} -> first update after the restart: {t_first - t_kill:.1f} s "
          f"(detection {t_err - t_kill:.1f} s, agent {t_restart - t_err:.1f} s, rendezvous {t_rdzv - t_restart:.1f} s, "
          f"start-up and resume {t_first - t_rdzv:.1f} s); resumed at {resumed_step}, {redone} update(s) redone")
    assert 0 <= redone <= SAVE_EVERY, (step_killed, resumed_step)
    assert int(re.search(r"step +(\d+)", first).group(1)) == resumed_step + 1, first

    # the grow-back: the agent's SIGTERM, the rank's checkpoint at the next step boundary, world size 2 from it
    preempted = re.search(r"preempted \(SIGTERM\) at step (\d+)", alone)
    assert preempted, alone[-4000:]
    step_grown = int(preempted.group(1))
    grown = alone[preempted.start():] + "\n" + logs[1].text()  # rank 0's lines may be on either host
    regrown = re.search(r"resumed from (\S+) at step (\d+)", grown)
    assert regrown and int(regrown.group(2)) == step_grown, grown[-4000:]
    ckpt2 = Path(regrown.group(1))
    assert ckpt2.name == f"step-{step_grown:07d}"
    trained_alone = [int(s) for s in re.findall(r"step +(\d+) \| loss", alone[:preempted.start()])]
    assert max(trained_alone) == step_grown > step_killed  # the last update alone is the one checkpointed
    t_seen_rdzv, _ = logs[0].first(r"Rendezvous complete|rendezvous.*complete", t_seen)
    t_grown = min(found[0] for lg in logs if (found := lg.find(r"step +\d+ \| loss", t_seen_rdzv)))
    print(f"host 1 started again at update {step_grown} (host 0 paused) -> first update at world size 2: "
          f"{t_grown - t_join:.1f} s (host 1's start until host 0's agent saw it {t_seen - t_join:.1f} s, the "
          f"rank's checkpoint and the rendezvous {t_seen_rdzv - t_seen:.1f} s, start-up and resume "
          f"{t_grown - t_seen_rdzv:.1f} s); 0 updates redone; job {t_end - t_start:.1f} s")
    assert t_grown - t_join <= 120
    assert "training small: 2 ranks" in grown, grown[-3000:]
    assert "training done; the summary and the commands to try next are on node 0" in logs[1].text()

    # the same global batch in every segment: 2 slots (2 ranks x 1), 2 (1 rank x grad_accum 2), 2 (2 x 1)
    assert "training small: 1 ranks" in alone, alone[-3000:]
    assert "global batch kept at 2 batch slots per update: 1 data-parallel rank(s) x grad_accum 2" in alone, alone
    assert "global batch kept at 2 batch slots per update: 2 data-parallel rank(s) x grad_accum 1" in grown, grown
    assert "batch slots per update (data-parallel size x grad_accum)" not in text + logs[1].text()  # no regroup
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == STEPS and not summary.get("preempted")
    saved = json.loads((out / "checkpoints" / f"step-{STEPS:07d}" / "trainer_state.json").read_text())
    assert (saved["world_size"], saved["global_batch_slots"]) == (2, 2)
    assert not (out / "preempted.json").exists()

    # one MLflow run across both restarts: each recorded, every step's metrics once
    from mlflow.tracking import MlflowClient

    run_id = json.loads((ckpt / "trainer_state.json").read_text())["run_id"]  # the first attempt's run
    assert summary["run_id"] == run_id and f"MLflow run {run_id}" in alone
    note1 = f"world size 2 -> 1, resumed at step {resumed_step}, {redone} update(s) redone (elastic restart 1)"
    note2 = f"world size 1 -> 2, resumed at step {step_grown}, 0 update(s) redone (elastic restart: a node joined)"
    assert f"restart 1 of MLflow run {run_id}: {note1}" in alone, alone[-3000:]
    assert f"restart 2 of MLflow run {run_id}: {note2}" in grown, grown[-3000:]
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert (run.data.tags["restarts"], run.data.tags["restart.1"], run.data.tags["restart.2"]) == ("2", note1, note2)
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1)), [m.step for m in history]
    logged = {m.step: m.value for m in history}

    # the same checkpoints resumed by hand: the first restart's at 1 rank x engine.grad_accum=2, the grow-back's
    # at 2 ranks x engine.grad_accum=1 (both at once)
    t0 = time.monotonic()
    hands = [_hand_resume(ckpt, tmp_path / "hand1", django_shards, env, 1),
             _hand_resume(ckpt2, tmp_path / "hand2", django_shards, env, 2)]
    outs = [h.communicate(timeout=240)[0] for h in hands]
    for h, o in zip(hands, outs):
        assert h.returncode == 0, o[-4000:]
    print(f"hand resumes from {ckpt.name} (1 rank) and {ckpt2.name} (2 ranks): {time.monotonic() - t0:.1f} s")
    want1 = dict(json.loads((tmp_path / "hand1" / "train_summary.json").read_text())["train_loss"])
    want2 = json.loads((tmp_path / "hand2" / "train_summary.json").read_text())["train_loss"]
    assert "training small: 2 ranks" in outs[1], outs[1][-3000:]
    # alone: the updates after the kill (those before it were logged by the first attempt)
    diffs1 = [abs(logged[s] - want1[s]) / abs(want1[s]) for s in range(step_killed + 1, step_grown + 1)]
    got = summary["train_loss"]  # the last attempt's: after the grow-back
    assert [s for s, _ in got] == [s for s, _ in want2] == list(range(step_grown + 1, STEPS + 1))
    diffs2 = [abs(x - y) / abs(y) for (_, x), (_, y) in zip(got, want2)]
    print(f"losses vs the hand resumes: alone (steps {step_killed + 1}-{step_grown}) max rel. diff "
          f"{max(diffs1):.1e}, after the grow-back (steps {step_grown + 1}-{STEPS}) {max(diffs2):.1e}")
    assert max(diffs1) <= 1e-5 and max(diffs2) <= 1e-5, (diffs1, diffs2)
