"""The README's SLURM batch script, as a user runs it, on two namespace hosts (tests/netns_hosts.py).

The script is taken out of README.md by this module (the fenced bash block after "Under SLURM, one task per
node", and the srun command of the block after "... requeued on 2, trains on the same global batches"), so the
README and the test cannot drift. What the test changes in it, and nothing else:

- ``--recipe base`` -> ``--recipe small --no-eval`` + the tiny-model overrides below (the recipe arguments);
- ``--nproc 8`` -> ``--nproc 1`` and ``slots=8`` -> ``slots=1`` (one CPU rank per host instead of 8 GPUs).

SLURM itself is stood in for by two small scripts put first on PATH: ``srun`` runs its command once per node
of the allocation, each on its namespace host (its network stack, hostname, /etc/hosts) with SLURM_NODEID,
SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS set and the job's SLURM_* variables passed on, waits for all and
exits with the highest code of its tasks, 128 + signal for a killed one (as srun does: "srun will return the
highest exit code of all tasks run or the highest signal ...": Slurm 22.05's srun -N2 on two namespace hosts,
task 1 SIGKILLed and task 0 exiting 76, returned 137; with host 1's slurmd killed too, it returned only when
slurmctld set host 1 DOWN, the reason the README's nodes left requeue the job from their task and not the
batch script after srun: tests/real_slurm.py); ``scontrol show hostnames LIST`` expands a
nodelist, ``scontrol requeue ID`` records the requeue in a file. The batch script runs on node 0 with the job's
SLURM_JOB_ID, SLURM_JOB_NODELIST (compressed, ``name[0-1]``), SLURM_NNODES and SLURM_RESTART_COUNT.

(a) the README's block runs to the end on 2 hosts, exit 0, no requeue; (b) host 1 is SIGKILLed (all of it)
after a checkpoint: node 0's launch.sh exits 76 and its task calls ``scontrol requeue JOBID``, srun 137 (the
stand-in ``scontrol`` only records the requeue, where SLURM would end the job there); (c) the
requeued job (SLURM_RESTART_COUNT=1, the same job id) on 1 node resumes from the last checkpoint with the
same 2 batch slots per update (1 rank x grad_accum 2), finishes, exit 0, with the losses of (a).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import ROOT, launch_checkout, launcher_env, tiny_model

pytestmark = pytest.mark.slow
STEPS, SAVE_EVERY, PEER_TIMEOUT = 16, 3, 3
KILL_AT = 2 * SAVE_EVERY + 2  # host 1 is killed once node 0 logged this update (two after the 2nd checkpoint)

SRUN = r"""#!/bin/bash
# stand-in srun: one task per node of the allocation, each on its namespace host
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
pids=()
for i in "${!nodes[@]}"; do
  ns=$(awk -v n="${nodes[$i]}" '$1 == n {print $2}' "$SLURM_STANDIN_NODES")
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_NTASKS=${#nodes[@]} SLURM_STEP_NUM_NODES=${#nodes[@]} \
    ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec "$@"' "${nodes[$i]}" "$@" &
  pids+=($!)
done
rc=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"; c=$?
  if (( c > 128 )); then echo "srun: error: ${nodes[$i]}: task $i: Killed" >&2
  elif (( c != 0 )); then echo "srun: error: ${nodes[$i]}: task $i: Exited with exit code $c" >&2; fi
  (( c > rc )) && rc=$c
done
exit $rc
"""

SCONTROL = r"""#!/usr/bin/env python3
# stand-in scontrol: show hostnames LIST, requeue JOBID
import os, re, sys

args = sys.argv[1:]
if args[:2] == ["show", "hostnames"]:
    nodelist = args[2] if len(args) > 2 else os.environ["SLURM_JOB_NODELIST"]
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", nodelist):
        m = re.fullmatch(r"(.*)\[(.*)\]", part)
        if not m:
            print(part)
            continue
        for r in m.group(2).split(","):
            lo, _, hi = r.partition("-")
            for k in range(int(lo), int(hi or lo) + 1):
                print(f"{m.group(1)}{k:0{len(lo)}d}")
elif args[:1] == ["requeue"] and len(args) == 2:
    with open(os.environ["SLURM_STANDIN_LOG"], "a") as f:
        f.write(f"requeue {args[1]}\n")
else:
    sys.exit(f"scontrol stand-in: unsupported {args}")
"""


def _readme_blocks() -> tuple[str, str]:
    """The README's SLURM batch script and the srun command of its requeue-on-fewer-nodes block, verbatim."""
    text = (ROOT / "README.md").read_text()

    def block_after(marker: str) -> str:
        i = text.index(marker)
        m = re.compile(r"```bash\n(.*?)```", re.S).search(text, i)
        return m.group(1)

    return block_after("Under SLURM, one task per node"), block_after("requeued on 2, trains on the same global batches")


SRUN_CMD = re.compile(r'^srun bash -c ".*?[^\\]"', re.S | re.M)


def _sized(script: str, overrides: list[str]) -> str:
    """The test's substitutions (module docstring), each checked to hit what it replaces."""
    for old, new in (("--recipe base", "--recipe small --no-eval " + shlex.join(overrides)),
                     ("--nproc 8", "--nproc 1"), ("slots=8", "slots=1")):
        assert old in script, (old, script)
        script = script.replace(old, new)
    return script


def _overrides(shards: Path) -> list[str]:
    return [f"data.shards={shards}", *tiny_model(), "data.max_tokens=400", "data.max_bytes=40", "data.num_workers=0",
            f"train.max_steps={STEPS}", "train.log_every=1", "train.valid_every=0", f"train.save_every={SAVE_EVERY}",
            "train.keep_last=100", "optim.warmup_steps=2", "engine.precision=fp32", "engine.ds_config=zero1.json",
            "engine.threads=1", f"engine.peer_timeout_s={PEER_TIMEOUT}", "tracking.enabled=false"]


class Cluster:
    """The namespace hosts, the stand-in commands and one checkout (the shared filesystem the job runs in)."""

    def __init__(self, hosts, tmp: Path, shards: Path):
        self.hosts, self.tmp = hosts, tmp
        self.checkout = launch_checkout(tmp)
        self.bin = tmp / "slurm-bin"
        self.bin.mkdir()
        for name, body in (("srun", SRUN), ("scontrol", SCONTROL)):
            (self.bin / name).write_text(body)
            (self.bin / name).chmod(0o755)
        self.nodes = tmp / "nodes"
        self.nodes.write_text("".join(f"{h.hostname} {h.netns}\n" for h in hosts))
        self.log = tmp / "slurm.log"
        self.log.touch()
        self.overrides = _overrides(shards)
        job, self.requeue_srun = _readme_blocks()
        self.job = job
        assert len(SRUN_CMD.findall(job)) == 1 and len(SRUN_CMD.findall(self.requeue_srun)) == 1, (job, self.requeue_srun)

    def script(self, requeue_block: bool) -> Path:
        """The README's batch script (with its srun command replaced by the second block's when asked), sized."""
        text = self.job
        if requeue_block:
            text = SRUN_CMD.sub(lambda _: SRUN_CMD.search(self.requeue_srun).group(0), text)
        path = self.tmp / ("job-requeue.sh" if requeue_block else "job.sh")
        path.write_text(_sized(text, self.overrides))
        return path

    def submit(self, script: Path, job_id: int, nodes: int, restart: int, out: Path) -> subprocess.Popen:
        """Run ``script`` as SLURM runs a batch script: on the allocation's first node, in the submit directory."""
        prefix = self.hosts[0].hostname[:-1]  # stXXXX-node
        nodelist = f"{prefix}[0-{nodes - 1}]" if nodes > 1 else self.hosts[0].hostname
        env = {**launcher_env(self.tmp), "PATH": f"{self.bin}:{os.environ['PATH']}", "SLURM_JOB_ID": str(job_id),
               "SLURM_JOBID": str(job_id), "SLURM_JOB_NODELIST": nodelist, "SLURM_NNODES": str(nodes),
               "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_RESTART_COUNT": str(restart),
               "SLURM_STANDIN_NODES": str(self.nodes), "SLURM_STANDIN_LOG": str(self.log),
               "MPLCONFIGDIR": str(self.tmp / "mpl")}
        env.pop("SLURM_PROCID", None)
        env.pop("SLURM_NODEID", None)
        return self.hosts[0].popen(["bash", str(script)], cwd=self.checkout, env=env, stdout=out.open("w"),
                                   stderr=subprocess.STDOUT, start_new_session=True)


def _kill_host(host) -> None:
    pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout.split()
    for pid in map(int, pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait(p: subprocess.Popen, log: Path, hosts, timeout: float) -> int:
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for h in hosts:
            _kill_host(h)
        p.wait()
        raise AssertionError(f"the job ran past {timeout} s:\n{log.read_text()[-5000:]}")


def _logged(text: str) -> dict[int, str]:
    """The losses a job's log shows, per update, as printed."""
    return {int(s): x for s, x in re.findall(r"step +(\d+) \| loss ([0-9.]+)", text)}


def _losses(run: Path) -> dict[int, float]:
    return {s: x for s, x in json.loads((run / "train_summary.json").read_text())["train_loss"]}


@pytest.fixture(scope="module")
def cluster(netns_hosts, django_shards, tmp_path_factory):
    return Cluster(netns_hosts(2), tmp_path_factory.mktemp("slurm"), django_shards)


@pytest.fixture(scope="module")
def full_run(cluster):
    """(a): the README's batch script, job 101 on 2 nodes, to the end."""
    out = cluster.tmp / "job-101.out"
    t0 = time.monotonic()
    rc = _wait(cluster.submit(cluster.script(requeue_block=False), 101, 2, 0, out), out, cluster.hosts, 150)
    print(f"(a) 2 nodes, {STEPS} updates: {time.monotonic() - t0:.1f} s")
    return rc, out.read_text(), cluster.checkout / "runs" / "base-101"


@pytest.fixture(scope="module")
def lost_node(cluster):
    """(b): the batch script with the README's fixed-``--out`` srun command, job 202 on 2 nodes; all of host 1
    SIGKILLed two updates after the second checkpoint."""
    out = cluster.tmp / "job-202.out"
    run = cluster.checkout / "runs" / "base"
    t0 = time.monotonic()
    p = cluster.submit(cluster.script(requeue_block=True), 202, 2, 0, out)
    deadline = time.monotonic() + 120
    try:
        while not ((run / "checkpoints" / "latest").is_file() and f"step {KILL_AT:6d} | loss" in out.read_text()):
            assert p.poll() is None and time.monotonic() < deadline, out.read_text()[-5000:]
            time.sleep(0.05)
        _kill_host(cluster.hosts[1])
        t_kill = time.monotonic()
        rc = _wait(p, out, cluster.hosts, 60)
    finally:
        if p.poll() is None:
            for h in cluster.hosts:
                _kill_host(h)
            p.wait()
    print(f"(b) 2 nodes to update {KILL_AT}: {t_kill - t0:.1f} s; kill -> job exit {time.monotonic() - t_kill:.1f} s")
    return rc, out.read_text(), run


def test_a_the_readme_script_runs_to_the_end_on_two_nodes(cluster, full_run):
    rc, text, run = full_run
    assert rc == 0, text[-5000:]
    assert "training small: 2 ranks" in text, text[-3000:]
    assert json.loads((run / "train_summary.json").read_text())["steps"] == STEPS
    assert sorted(_losses(run)) == list(range(1, STEPS + 1))
    hostfile = cluster.checkout / "hosts.101"
    assert hostfile.read_text() == "".join(f"{h.hostname} slots=1\n" for h in cluster.hosts)
    assert "requeue" not in cluster.log.read_text()


def test_b_a_lost_node_requeues_the_job(cluster, full_run, lost_node):
    rc, text, run = lost_node
    assert "srun: error: " + cluster.hosts[1].hostname + ": task 1: Killed" in text, text[-5000:]
    assert "exit 76: retry" in text, text[-5000:]
    assert rc == 137, text[-5000:]  # srun's code: the killed task's, the highest
    assert cluster.log.read_text() == "requeue 202\n"
    # the updates before the kill are those of the uninterrupted job (a): the same 2 hosts, bitwise
    before, full = _logged(text), _logged(full_run[1])
    assert KILL_AT in before and {s: full[s] for s in before} == before, (before, full)
    # the checkpoints of every save_every updates up to the kill, nothing after (the survivor stopped). The loss
    # can interrupt the save of the last save point the survivor logged at any stage: before it wrote anything
    # (its first exchange with the lost node failed: no entry), or after (it stays step-N.partial); at the last
    # save point only, and `latest` never names it
    names = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    saved = sorted(int(n[5:]) for n in names if n[5:].isdigit())
    partial = [int(n[5:-len(".partial")]) for n in names if n.endswith(".partial")]
    due = list(range(SAVE_EVERY, max(before) + 1, SAVE_EVERY))
    assert len(saved) + len(partial) == len(names) and partial in ([], due[-1:]), names
    assert saved == due or (saved == due[:-1] and len(due) > 1), (names, max(before))
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{saved[-1]:07d}"


def test_c_the_requeued_job_resumes_on_one_node_with_the_same_global_batch(cluster, full_run, lost_node):
    _, text_b, run = lost_node
    assert cluster.log.read_text() == "requeue 202\n"
    ckpt = (run / "checkpoints" / "latest").read_text().strip()
    resumed_at = int(ckpt.rsplit("-", 1)[1])
    out = cluster.tmp / "job-202.requeue.out"
    t0 = time.monotonic()
    rc = _wait(cluster.submit(cluster.script(requeue_block=True), 202, 1, 1, out), out, cluster.hosts, 120)
    print(f"(c) requeued on 1 node, {STEPS - resumed_at} updates: {time.monotonic() - t0:.1f} s")
    text = out.read_text()
    assert rc == 0, text[-5000:]
    assert cluster.log.read_text() == "requeue 202\n"  # no second requeue
    assert (cluster.checkout / "hosts.202").read_text() == f"{cluster.hosts[0].hostname} slots=1\n"
    assert "training small: 1 ranks" in text, text[-3000:]
    assert re.search(rf"resumed from \S*runs/base/checkpoints/{ckpt} at step {resumed_at}\b", text), text[-3000:]
    assert "global batch kept at 2 batch slots per update: 1 data-parallel rank(s) x grad_accum 2" in text, text[-3000:]
    saved = json.loads((run / "checkpoints" / f"step-{STEPS:07d}" / "trainer_state.json").read_text())
    assert (saved["world_size"], saved["global_batch_slots"]) == (1, 2)
    # the same global batches as the uninterrupted 2-node job (a): its losses, update for update
    got, want = _losses(run), _losses(full_run[2])
    assert sorted(got) == list(range(resumed_at + 1, STEPS + 1)), sorted(got)
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in got)
    print(f"(c) resumed at {resumed_at}; largest relative loss difference from (a): {worst:.2e}")
    assert worst <= 1e-4, {s: (got[s], want[s]) for s in got}
