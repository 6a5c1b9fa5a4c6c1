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

The second test: Accelerate DDP with expert parallelism (``engine.backend=accelerate engine.accelerate=ddp``
appended to the same ``launch.sh --elastic`` command, as the README documents; a tiny MoE model, 4 experts,
``moe.ep_size=2``), 2 hosts x 2 ranks, all of host 1 killed after a checkpoint, no grow-back: world size
4 -> 2, which ep_size 2 still divides. The checkpoint holds 2 expert shards (EP ranks 0 and 1, each written by
the first rank of its expert-data-parallel group of 2); after the restart each of the 2 ranks takes its own.
Host 0 ends with exit 0; 4 batch slots per update before and after (4 ranks x 1, then 2 x grad_accum 2); the
losses after the restart equal those of the same checkpoint resumed by hand at 2 ranks x ``engine.grad_accum=2``
(the same backend and ep_size), and the redone updates' losses equal those the 4 ranks logged before the kill;
at most ``train.save_every`` updates redone; one MLflow run with the restart tag.
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


def _overrides(shards: Path, out: Path, steps: int = STEPS) -> list[str]:
    return [f"data.shards={shards}", *tiny_model(), "data.max_tokens=400", "data.max_bytes=40", "data.num_workers=0",
            f"train.out_dir={out}", f"train.max_steps={steps}", "train.log_every=1", "train.valid_every=0",
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


def _hand_resume(ckpt: Path, out: Path, shards: Path, env: dict, nproc: int, slots: int = 2, extra: tuple = (),
                 steps: int = STEPS) -> subprocess.Popen:
    """``ckpt`` copied into a run directory of its own and resumed by hand at ``nproc`` rank(s) x
    ``engine.grad_accum`` = ``slots`` / ``nproc`` (the run's batch slots), MLflow off, the run's ``extra``
    overrides appended; started, not waited for. Either engine's ranks take their places from the launcher's
    environment (as under torchrun), so several ranks start under the light launcher of :func:`deepspeed_cmd`."""
    shutil.copytree(ckpt, out / "checkpoints" / ckpt.name)
    (out / "checkpoints" / "latest").write_text(ckpt.name)
    args = ["train", "--config", "small", *_overrides(shards, out, steps), f"engine.grad_accum={slots // nproc}",
            "tracking.enabled=false", *extra]
    cmd = ([str(ROOT / ".venv" / "bin" / "python"), "-m", "scaletrain", *args] if nproc == 1
           else deepspeed_cmd(nproc, "scaletrain", *args))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _restarted(log: _Log, t_kill: float, world: int) -> tuple[str, str, int, Path, int]:
    """Host 0's log of a job at ``world`` ranks whose host 1 was killed at ``t_kill``: ``(before, after,
    step_killed, ckpt, resumed_step)``, the text before and from the ranks' error line, the last update logged
    before it, the checkpoint the restart resumed and its step. Asserts the exit 76, the first update after the
    restart (the one after the checkpoint), at most ``train.save_every`` updates redone, and prints where the
    time from the kill to that update went."""
    text = log.text()
    before, after = text[:text.index("scaletrain: error:")], text[text.index("scaletrain: error:"):]
    assert f"training small: {world} ranks" in before, before[-3000:]
    step_killed = max(int(m) for m in re.findall(r"step +(\d+) \| loss", before))
    # where the time went: the rank's line (lost peer), the agent's restart, its rendezvous, the first update
    t_err, err = log.first(r"scaletrain: error: ", t_kill)
    assert "exit 76: retry" in err, err
    t_restart, _ = log.first(r"[Rr]estart", t_err)
    t_rdzv, _ = log.first(r"Rendezvous complete|rendezvous.*complete", t_restart)
    t_first, first = log.first(r"step +\d+ \| loss", t_rdzv)
    resumed = re.search(r"resumed from (\S+) at step (\d+)", after)
    assert resumed, text[-4000:]
    ckpt, resumed_step = Path(resumed.group(1)), int(resumed.group(2))
    redone = step_killed - resumed_step
    print(f"kill of host 1 at update {step_killed} -> first update after the restart: {t_first - t_kill:.1f} s "
          f"(detection {t_err - t_kill:.1f} s, agent {t_restart - t_err:.1f} s, rendezvous {t_rdzv - t_restart:.1f} s, "
          f"start-up and resume {t_first - t_rdzv:.1f} s); resumed at {resumed_step}, {redone} update(s) redone")
    assert 0 <= redone <= SAVE_EVERY, (step_killed, resumed_step)
    assert int(re.search(r"step +(\d+)", first).group(1)) == resumed_step + 1, first
    return before, after, step_killed, ckpt, resumed_step


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
    _, alone, step_killed, ckpt, resumed_step = _restarted(logs[0], t_kill, 2)
    redone = step_killed - resumed_step

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


MOE_STEPS = 24
MOE_EP = ("engine.backend=accelerate", "engine.accelerate=ddp", "moe.num_experts=4", "moe.every=1", "moe.top_k=2",
          "moe.ffn_dim=32", "moe.ep_size=2")


def test_accelerate_ddp_with_expert_parallelism_restarts_on_the_survivor_with_its_experts(netns_hosts,
                                                                                         django_shards, tmp_path):
    """Accelerate DDP, MoE at ``moe.ep_size=2``, 2 hosts x 2 ranks; all of host 1 killed after a checkpoint:
    world size 4 -> 2, ep_size 2 still divides it; host 0's agent restarts the job alone (shrink only)."""
    hosts = netns_hosts(2)
    out = tmp_path / "run"
    env = {**launcher_env(tmp_path), "LOGLEVEL": "INFO"}
    # the documented form: launch.sh --elastic with the backend override appended (the same torchrun command)
    cmd = ["bash", "./launch.sh", "--elastic", "1:2", "--nproc", "2", "--no-eval", "--out", str(out),
           "--master_addr", hosts[0].addr, "--master_port", "29542", "--rdzv_conf", RDZV_CONF,
           *_overrides(django_shards, out, MOE_STEPS), *MOE_EP]
    checkout = launch_checkout(tmp_path)
    procs, logs = [], []
    t_start = time.monotonic()
    for h in (hosts[1], hosts[0]):  # host 1 first: it waits for host 0's store, both join the first round
        p = h.popen(cmd, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    start_new_session=True)
        procs.insert(0, p)
        logs.insert(0, _Log(p))
    try:
        latest = out / "checkpoints" / "latest"
        deadline = time.monotonic() + 180
        kill_at = f"step {2 * SAVE_EVERY + 2:6d} | loss"  # two updates after the second checkpoint
        while not (latest.is_file() and kill_at in logs[0].text()):
            assert procs[0].poll() is None and time.monotonic() < deadline, logs[0].text()[-4000:]
            time.sleep(0.02)
        _kill_host(hosts[1], procs[1])  # all of host 1: its agent and both its ranks
        t_kill = time.monotonic()
        procs[1].wait()
        rc0 = procs[0].wait(timeout=180)  # nobody acts
        t_end = time.monotonic()
    finally:
        _stop(hosts, procs)
        for k, lg in enumerate(logs):
            lg.thread.join(timeout=5)
            (tmp_path / f"host{k}.log").write_text(lg.text())
    text = logs[0].text()
    assert rc0 == 0, text[-5000:]
    assert "--nproc-per-node=2 --max-restarts=3" in text and "engine.backend=accelerate" in text, text[:3000]
    assert "per node with accelerate (ddp) -> " in text, text[:3000]  # launch.sh names the engine the ranks run
    before, after, step_killed, ckpt, resumed_step = _restarted(logs[0], t_kill, 4)
    redone = step_killed - resumed_step
    print(f"Accelerate DDP, MoE ep_size=2, world 4 -> 2: job {t_end - t_start:.1f} s, host 1 killed at "
          f"{t_kill - t_start:.1f} s")

    # the experts: 2 EP ranks x 2 expert-data-parallel before (ep000/ep001 written by the first rank of each EDP
    # group), 2 EP ranks x 1 after, each rank's from its shard
    assert sorted(f.name for f in ckpt.glob("expert_shard_ep*.pt")) == ["expert_shard_ep000_of_002.pt",
                                                                         "expert_shard_ep001_of_002.pt"]
    assert json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == 4
    # the same global batch: 4 slots (4 ranks x 1), then 4 (2 ranks x grad_accum 2)
    assert "training small: 2 ranks" in after, after[-3000:]
    assert "global batch kept at 4 batch slots per update: 2 data-parallel rank(s) x grad_accum 2" in after, after
    assert "batch slots per update (data-parallel size x grad_accum)" not in text  # no regroup
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == MOE_STEPS and not summary.get("preempted")
    saved = json.loads((out / "checkpoints" / f"step-{MOE_STEPS:07d}" / "trainer_state.json").read_text())
    assert (saved["world_size"], saved["global_batch_slots"]) == (2, 4)

    # one MLflow run, the restart recorded, every step's metrics once
    from mlflow.tracking import MlflowClient

    run_id = json.loads((ckpt / "trainer_state.json").read_text())["run_id"]
    note = f"world size 4 -> 2, resumed at step {resumed_step}, {redone} update(s) redone (elastic restart 1)"
    assert summary["run_id"] == run_id and f"restart 1 of MLflow run {run_id}: {note}" in after, after[-3000:]
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert (run.data.tags["restarts"], run.data.tags["restart.1"]) == ("1", note)
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, MOE_STEPS + 1)), [m.step for m in history]

    # the same checkpoint resumed by hand at 2 ranks x engine.grad_accum=2, Accelerate DDP, ep_size 2
    t0 = time.monotonic()
    hand = _hand_resume(ckpt, tmp_path / "hand", django_shards, env, 2, slots=4, extra=MOE_EP, steps=MOE_STEPS)
    o = hand.communicate(timeout=240)[0]
    assert hand.returncode == 0, o[-4000:]
    print(f"hand resume from {ckpt.name} (2 ranks x grad_accum 2): {time.monotonic() - t0:.1f} s")
    assert "training small: 2 ranks" in o, o[-3000:]
    want = json.loads((tmp_path / "hand" / "train_summary.json").read_text())["train_loss"]
    got = summary["train_loss"]  # the restarted attempt's
    assert [s for s, _ in got] == [s for s, _ in want] == list(range(resumed_step + 1, MOE_STEPS + 1))
    diffs = [abs(x - y) / abs(y) for (_, x), (_, y) in zip(got, want)]
    # the updates redone after the restart read the global batches the 4 ranks read before the kill: their losses
    # are those the first attempt logged (the journal's records before its "resume" record). The hand resume runs
    # the same resume code, so this is what sees each rank's experts come back (measured: equal to the last bit;
    # with every rank given EP rank 0's experts, tests/mutations.py elastic-experts-own-shard, they part at once)
    from scaletrain.tracking.journal import read_journal

    records = read_journal(out / "tracking" / "journal.jsonl")
    first_attempt = records[:next(i for i, r in enumerate(records) if r["t"] == "resume")]
    logged = {r["s"]: r["v"]["train/loss"] for r in first_attempt if r["t"] == "m" and "train/loss" in r["v"]}
    got = dict(got)
    redo = [abs(got[s] - logged[s]) / abs(logged[s]) for s in range(resumed_step + 1, step_killed + 1)]
    print(f"losses vs the hand resume (steps {resumed_step + 1}-{MOE_STEPS}): max rel. diff {max(diffs):.1e}; "
          f"the {redone} redone update(s) vs the 4-rank attempt: {max(redo, default=0):.1e}")
    assert max(diffs) <= 1e-5, diffs
    assert len(redo) == redone and max(redo, default=0) <= 1e-5, redo
