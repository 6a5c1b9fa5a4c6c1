"""The README's SLURM batch script under a real SLURM: slurmctld, one slurmd per namespace host, munge.

An on-demand check, not part of the suite (pytest collects only ``test_*.py``): it installs ``slurm-wlm`` and
``munge`` with apt when they are missing and starts system daemons as root (munged, slurmctld, slurmd), which
a test run must not do. tests/integration/test_slurm_script.py covers the same script in the suite with
stand-in ``srun``/``scontrol``; this check is what says the stand-ins behave as SLURM does.

    .venv/bin/python tests/real_slurm.py                  # cases a c b, report in results/real_slurm.md
    .venv/bin/python tests/real_slurm.py --cases b --report /tmp/r.md

What it sets up, all of it removed at the end (also on Ctrl-C or an error):
- 2 namespace hosts (tests/netns_hosts.py: their own network stack, hostname and /etc/hosts, addresses from
  198.18.0.0/15 inside the namespaces only);
- in a temporary directory: a munge key (root-owned, 0400) and one ``munged`` on its own socket; slurm.conf
  and cgroup.conf (``SLURM_CONF`` points the daemons and the commands at them; nothing under /etc is read
  or written); ``slurmctld`` in host 0's namespace, one ``slurmd -N NAME`` in each host's namespace.

No cgroup filesystem is needed: ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none`` and
cgroup.conf ``CgroupPlugin=cgroup/v1`` (slurmd 22.05 loads a cgroup plugin even then; without the line it
stops with ``No filesystem mounted on /sys/fs/cgroup`` or ``Hybrid mode is not supported``). sbatch gets
``--gpus-per-node=0`` (the README's ``--gpus-per-node=8`` on a machine with no GPUs is an invalid request)
and ``--nodes=1-2`` for the README's ``--nodes=2-4`` on this 2-node cluster; the script is the README's, extracted
and sized as the test does. slurm.conf sets ``SlurmdTimeout=60`` (SLURM's default 300 s would make (b) wait
5 minutes for host 1 to be set DOWN); everything else that times a requeue is at SLURM's defaults.

Cases (one line each on stdout, and the report):
(a) the README's script on 2 nodes to the end, exit 0;
(c) ``scontrol requeue JOBID`` while the job runs (a preemption): the ranks get SIGTERM, checkpoint and exit
    75; the requeued job (same id, SLURM_RESTART_COUNT=1) resumes from that checkpoint on 2 nodes, exit 0;
(b) host 1 lost (its slurmd, slurmstepd and ranks SIGKILLed) two updates after the second checkpoint:
    node 0's launch.sh exits 76 and its task runs the script's ``scontrol requeue`` (slurmctld's log then has
    no "requeue job ... due to failure of node": SLURM did not requeue it itself); SLURM sets host 1 DOWN
    (``SlurmdTimeout``) and the requeued job runs on host 0 alone, from the last checkpoint with the same
    global batch ("global batch kept at 2 batch slots per update"), exit 0.

``--srun-opts=OPTS`` puts OPTS after each ``srun`` of the script and ``--srun-wait`` bounds how long (b) waits
for the job to leave RUNNING: how srun options were compared (docs/OPERATIONS.md#slurm).
"""
from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent / "integration")]
import netns_hosts  # noqa: E402
from helpers import TEST_LANGS, launch_checkout, launcher_env  # noqa: E402
from test_slurm_script import KILL_AT, STEPS, SRUN_CMD, _overrides, _readme_blocks, _sized  # noqa: E402

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol")
SLURMD_TIMEOUT = 60  # s without an answer before slurmctld sets a node DOWN (SLURM's default: 300; (b) waits for it)


def ensure_installed() -> None:
    missing = [b for b in BINARIES if not (shutil.which(b) or Path("/usr/sbin", b).exists())]
    if not missing:
        return
    print(f"installing slurm-wlm munge (missing: {' '.join(missing)})", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "slurm-wlm", "munge"]
    if subprocess.run(cmd, env=env).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, check=True)
        subprocess.run(cmd, env=env, check=True)


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class Slurm:
    """munged, slurmctld and the slurmds of ``hosts``, configured in ``tmp``; ``close()`` stops them."""

    def __init__(self, hosts, tmp: Path, slurmd_timeout: int = SLURMD_TIMEOUT):
        self.hosts, self.tmp = hosts, tmp
        self.procs: list[subprocess.Popen] = []
        self.logs = tmp / "log"
        self.logs.mkdir()
        etc = tmp / "etc"
        etc.mkdir()
        os.chmod(tmp, 0o755)  # the socket's and the spool's parents: slurmstepd and munge check them
        munge = tmp / "munge"
        munge.mkdir(mode=0o755)
        key = munge / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self.socket = munge / "munge.socket"
        self._start(["munged", "--foreground", f"--key-file={key}", f"--socket={self.socket}",
                     f"--pid-file={munge}/munged.pid", f"--log-file={self.logs}/munged.log",
                     f"--seed-file={munge}/munged.seed"], "munged")
        self._wait(lambda: self.socket.exists(), 10, "munged's socket")
        (tmp / "state").mkdir()
        (tmp / "spool").mkdir(mode=0o755)
        nodes = "\n".join(f"NodeName={h.hostname} NodeAddr={h.addr} CPUs=1 RealMemory=1000 State=UNKNOWN"
                          for h in hosts)
        (etc / "slurm.conf").write_text(f"""\
ClusterName=realslurm
SlurmctldHost={hosts[0].hostname}({hosts[0].addr})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool/%n
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd-%n.pid
SlurmctldLogFile={self.logs}/slurmctld.log
SlurmdLogFile={self.logs}/slurmd-%n.log
SlurmctldDebug=debug
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/linear
SchedulerType=sched/builtin
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdTimeout={slurmd_timeout}
SlurmdParameters=config_overrides
PlugStackConfig={etc}/plugstack.conf
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        (etc / "plugstack.conf").write_text("")
        (etc / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        self.env = {**os.environ, "SLURM_CONF": str(etc / "slurm.conf")}
        self._start(hosts[0].command([_sbin("slurmctld"), "-D", "-i"]), "slurmctld")
        for h in hosts:
            self.start_slurmd(h)
        self._wait(lambda: self.node_states() == {h.hostname: "idle" for h in hosts}, 60,
                   "every node idle in sinfo")

    def _start(self, cmd: list[str], name: str) -> subprocess.Popen:
        if cmd[0] == "munged":
            cmd = [_sbin("munged"), *cmd[1:]]
        log = (self.logs / f"{name}.stdout").open("a")
        p = subprocess.Popen(cmd, env=getattr(self, "env", os.environ), stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs.append(p)
        return p

    def start_slurmd(self, h) -> None:
        self._start(h.command([_sbin("slurmd"), "-D", "-N", h.hostname]), f"slurmd-{h.hostname}")

    def _wait(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{' '.join(p.args[-4:])} exited {p.returncode} while waiting for {what}; "
                                       f"logs in {self.logs}:\n{self.log_tails()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {timeout} s; logs in {self.logs}:\n{self.log_tails()}")
            time.sleep(0.5)

    def log_tails(self, n: int = 15) -> str:
        out = []
        for f in sorted(self.logs.iterdir()):
            lines = f.read_text(errors="replace").splitlines()[-n:]
            out.append(f"== {f.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def cmd(self, *args: str, check: bool = True) -> str:
        """A SLURM command (sbatch, scontrol, sinfo...) run on host 0 (the controller's network)."""
        r = self.hosts[0].run(list(args), env=self.env, capture_output=True, text=True)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def node_states(self) -> dict[str, str]:
        out = self.cmd("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return dict(line.split() for line in out.splitlines() if line.strip())

    def job(self, job_id: int) -> dict[str, str]:
        out = self.cmd("scontrol", "show", "job", "-o", str(job_id), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def close(self) -> None:
        for h in self.hosts:  # slurmstepd and the jobs' processes as well as the slurmds and slurmctld
            kill_host(h)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def kill_host(host) -> None:
    """SIGKILL every process in ``host``'s network namespace: the host is lost."""
    pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout.split()
    for pid in map(int, pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Check:
    def __init__(self, slurm: Slurm, tmp: Path, shards: Path):
        self.slurm, self.tmp, self.shards = slurm, tmp, shards
        self.job_text, self.requeue_srun = _readme_blocks()
        assert len(SRUN_CMD.findall(self.job_text)) == 1 and len(SRUN_CMD.findall(self.requeue_srun)) == 1
        self.lines: list[str] = []
        self.srun_opts = ""
        self.srun_wait = 100.0
        self.notes: list[str] = []

    def script(self, where: Path, requeue_block: bool) -> Path:
        text = self.job_text
        if requeue_block:
            text = SRUN_CMD.sub(lambda _: SRUN_CMD.search(self.requeue_srun).group(0), text)
        if self.srun_opts:  # --srun-opts: an experiment on srun's options, the README's script otherwise
            text = re.sub(r"^srun ", f"srun {self.srun_opts} ", text, flags=re.M)
        path = where / "job.sh"
        path.write_text(_sized(text, _overrides(self.shards)))
        return path

    def submit(self, name: str, nodes: str, requeue_block: bool) -> tuple[int, Path]:
        d = self.tmp / name
        d.mkdir()
        checkout = launch_checkout(d)
        script = self.script(d, requeue_block)
        env = {**launcher_env(d), "MPLCONFIGDIR": str(d / "mpl")}
        env.pop("SLURM_JOB_ID", None)
        out = self.slurm.hosts[0].run(
            ["sbatch", "--parsable", f"--nodes={nodes}", "--gpus-per-node=0", f"--chdir={checkout}",
             f"--output={checkout}/slurm-%j.out", "--open-mode=append", f"--job-name=real-{name}", str(script)],
            env={**env, "SLURM_CONF": self.slurm.env["SLURM_CONF"]}, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch: exit {out.returncode}: {out.stderr.strip()}")
        return int(out.stdout.strip().split(";")[0]), checkout

    def wait(self, job_id: int, pred, timeout: float, what: str) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            j = self.slurm.job(job_id)
            if pred(j):
                return j
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: no {what} after {timeout} s: {j}\n{self.slurm.log_tails()}")
            time.sleep(0.25)

    def record(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)

    @staticmethod
    def output(checkout: Path, job_id: int) -> str:
        f = checkout / f"slurm-{job_id}.out"
        return f.read_text(errors="replace") if f.exists() else ""

    def wait_for_update(self, job_id: int, checkout: Path, run: Path, step: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        logged = f"step {step:6d} | loss"
        while not ((run / "checkpoints" / "latest").is_file() and logged in self.output(checkout, job_id)):
            j = self.slurm.job(job_id)
            if j.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING") or time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} {j.get('JobState')} before update {step}:\n"
                                     f"{self.output(checkout, job_id)[-4000:]}")
            time.sleep(0.1)

    def case_a(self) -> None:
        t0 = time.monotonic()
        job_id, checkout = self.submit("a", "1-2", requeue_block=False)
        j = self.wait(job_id, lambda j: j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                             "NODE_FAIL", "OUT_OF_MEMORY"), 300, "end")
        text = self.output(checkout, job_id)
        ok = j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0" and "training small: 2 ranks" in text \
            and f"step {STEPS:6d} | loss" in text
        self.record(f"(a) 2 nodes, {STEPS} updates: job {job_id} {j['JobState']} exit {j['ExitCode']} "
                    f"in {time.monotonic() - t0:.1f} s (submit to end) -> {'ok' if ok else 'FAILED'}")
        if not ok:
            raise AssertionError(text[-4000:])


    def case_c(self) -> None:
        """A preemption: ``scontrol requeue`` from outside while the job runs on 2 nodes."""
        t0 = time.monotonic()
        job_id, checkout = self.submit("c", "1-2", requeue_block=True)
        run = checkout / "runs" / "base"
        self.wait_for_update(job_id, checkout, run, KILL_AT, 240)
        t_req = time.monotonic()
        self.slurm.cmd("scontrol", "requeue", str(job_id))
        self.wait(job_id, lambda j: j.get("Restarts") == "1" and j.get("JobState") == "PENDING", 120,
                  "requeued job pending")
        first = self.output(checkout, job_id)  # the first run's output, all of it: its processes are gone
        pre = re.search(r"preempted \(SIG\w+\) at step (\d+)", first)
        j = self.wait(job_id, lambda j: j.get("JobState") == "RUNNING", 300, "second start")
        t_start = time.monotonic()
        j = self.wait(job_id, lambda j: j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"),
                      300, "end")
        t_end = time.monotonic()
        text = self.output(checkout, job_id)
        second = text[len(first):]
        m = re.search(r"resumed from \S*runs/base/checkpoints/(step-(\d+)) at step (\d+)", second)
        ok = (j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0" and m is not None and pre is not None
              and m.group(3) == pre.group(1) and "exit 75" in first
              and "training small: 2 ranks" in second and f"step {STEPS:6d} | loss" in second)
        self.record(f"(c) scontrol requeue at update >= {KILL_AT} ({t_req - t0:.1f} s after submit): the ranks "
                    f"checkpointed at update {pre.group(1) if pre else '?'} (SIGTERM, exit 75: "
                    f"{'exit 75' in first}), requeued job started {t_start - t_req:.1f} s after the requeue, "
                    f"resumed at "
                    f"{m.group(3) if m else '?'}, ended {j['JobState']} exit {j['ExitCode']} "
                    f"{t_end - t_req:.1f} s after the requeue -> {'ok' if ok else 'FAILED'}")
        self.notes.append("(c) first run's last lines:\n" + "\n".join(first.splitlines()[-8:]))
        if not ok:
            raise AssertionError(text[-6000:])

    def case_b(self) -> None:
        """Host 1 lost two updates after the second checkpoint; the script's requeue line; the requeued job on
        host 0 alone."""
        slurm = self.slurm
        t0 = time.monotonic()
        job_id, checkout = self.submit("b", "1-2", requeue_block=True)
        run = checkout / "runs" / "base"
        self.wait_for_update(job_id, checkout, run, KILL_AT, 240)
        assert self.slurm.job(job_id).get("NumNodes") == "2", self.slurm.job(job_id)
        kill_host(slurm.hosts[1])
        t_kill = time.monotonic()
        t76 = t_ret = t_down = None
        j_ret: dict[str, str] = {}
        deadline = t_kill + self.srun_wait
        while t_ret is None:
            now = time.monotonic()
            if t76 is None and "exit 76" in self.output(checkout, job_id):
                t76 = now
            j = slurm.job(job_id)
            if t_down is None and slurm.node_states().get(slurm.hosts[1].hostname, "").startswith("down"):
                t_down = now
            if j.get("Restarts") == "1" or j.get("JobState") != "RUNNING":
                t_ret, j_ret = now, j
            elif now > deadline:
                break
            time.sleep(0.25)
        killed_at = max(map(int, re.findall(r"step +(\d+) \| loss", self.output(checkout, job_id))))
        if t_ret is None:
            first = self.output(checkout, job_id)
            ps = subprocess.run(["ip", "netns", "pids", slurm.hosts[0].netns], capture_output=True, text=True)
            procs = subprocess.run(["ps", "-o", "pid,etime,args", "-p", ",".join(ps.stdout.split())],
                                   capture_output=True, text=True).stdout
            self.record(f"(b) host 1 killed after update {killed_at}: node 0 exit 76 "
                        f"{'%.1f s' % (t76 - t_kill) if t76 else 'never'} after the kill; the job still RUNNING "
                        f"{self.srun_wait} s after the kill (srun has not returned) -> FAILED")
            raise AssertionError(f"{first[-3000:]}\n== host 0's processes:\n{procs}\n{slurm.log_tails()}")
        print(f"    (b) so far: node 0 exit 76 {t76 - t_kill if t76 else float('nan'):.1f} s, job "
              f"{j_ret.get('JobState')} (restarts {j_ret.get('Restarts')}, reason {j_ret.get('Reason')}) "
              f"{t_ret - t_kill:.1f} s after the kill; host 1 down "
              f"{'%.1f s' % (t_down - t_kill) if t_down else 'not yet'}", flush=True)
        while t_down is None:
            if slurm.node_states().get(slurm.hosts[1].hostname, "").startswith("down"):
                t_down = time.monotonic()
            elif time.monotonic() > t_kill + 600:
                raise AssertionError(f"host 1 not DOWN 600 s after the kill: {slurm.node_states()}")
            time.sleep(0.25)
        self.wait(job_id, lambda j: j.get("JobState") == "PENDING" and j.get("Restarts") == "1", 120,
                  "requeued job pending")
        first = self.output(checkout, job_id)  # the first run's output, all of it: its processes are gone
        self.wait(job_id, lambda j: j.get("JobState") == "RUNNING" and j.get("Restarts") == "1", 600,
                  "second start")
        t_start = time.monotonic()
        j2 = slurm.job(job_id)
        ctld = (slurm.logs / "slurmctld.log").read_text()
        req_lines = [l for l in ctld.splitlines()
                     if re.search(r"_job_requeue_op|[Rr]equeu(e|ing) job|setting DOWN|Allocate", l)]
        # who requeued: the script (a job's own `scontrol requeue`), or slurmctld when it set host 1 DOWN
        by_ctld = any("due to failure of node" in l for l in req_lines)
        j = self.wait(job_id, lambda j: j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"),
                      300, "end")
        t_end = time.monotonic()
        text = self.output(checkout, job_id)
        second = text[len(first):]
        m = re.search(r"resumed from \S*runs/base/checkpoints/(step-(\d+)) at step (\d+)", second)
        kept = "global batch kept at 2 batch slots per update: 1 data-parallel rank(s) x grad_accum 2" in second
        ok = (t76 is not None and not by_ctld and j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0"
              and j2.get("NumNodes") == "1" and m is not None and kept and "training small: 1 ranks" in second
              and f"step {STEPS:6d} | loss" in second)
        self.record(f"(b) host 1 killed after update {killed_at} ({t_kill - t0:.1f} s after submit): node 0 exit 76 "
                    f"{t76 - t_kill if t76 else float('nan'):.1f} s after the kill, job requeued "
                    f"{t_ret - t_kill:.1f} s after ({'by slurmctld, host 1 DOWN' if by_ctld else 'by the script'}); "
                    f"host 1 DOWN "
                    f"{'%.1f s' % (t_down - t_kill) if t_down else 'later'}; requeued job started on "
                    f"{j2.get('NumNodes')} node(s) {t_start - t_kill:.1f} s after the kill, resumed at "
                    f"{m.group(3) if m else '?'}, global batch kept: {kept}; ended {j['JobState']} exit "
                    f"{j['ExitCode']} {t_end - t_kill:.1f} s after the kill -> {'ok' if ok else 'FAILED'}")
        self.notes.append("(b) slurmctld's log, the requeue, host 1 DOWN, the allocations:\n" + "\n".join(req_lines))
        self.notes.append("(b) first run's last lines:\n" + "\n".join(first.splitlines()[-8:]))
        if not ok:
            raise AssertionError(text[-6000:])


def write_report(path: Path, check: Check, slurm: Slurm, failed: BaseException | None) -> None:
    import platform

    version = subprocess.run([_sbin("slurmctld"), "-V"], capture_output=True, text=True).stdout.strip()
    conf = Path(slurm.env["SLURM_CONF"]).read_text()
    keep = [l for l in conf.splitlines() if l.split("=")[0] in (
        "ProctrackType", "TaskPlugin", "SelectType", "SlurmdTimeout", "ReturnToService")]
    text = [f"# The README's SLURM script under a real SLURM ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
            "", f"{version}, {platform.node()}, 2 namespace hosts; `{' '.join(sys.argv)}`", "",
            "slurm.conf (the settings that matter here): " + ", ".join(f"`{l}`" for l in keep)
            + "; cgroup.conf `CgroupPlugin=cgroup/v1`; KillWait and AuthInfo's cred_expire at their defaults "
            "(30 s, 120 s).", "", *[f"- {l}" for l in check.lines]]
    if failed is not None:
        text += ["", "FAILED:", "```", str(failed)[-4000:], "```"]
    for n in check.notes:
        text += ["", "```", n, "```"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(text) + "\n")
    print(f"report: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="acb", help="which cases, in this order (default: acb)")
    ap.add_argument("--report", default="results/real_slurm.md", help="where the report goes "
                    "(default: results/real_slurm.md, not tracked)")
    ap.add_argument("--srun-opts", default="", help="an experiment: options put after each srun of the script")
    ap.add_argument("--srun-wait", type=float, default=100, help="(b): how long srun may take to return after "
                    "the kill (s)")
    ap.add_argument("--slurmd-timeout", type=int, default=SLURMD_TIMEOUT, help="slurm.conf SlurmdTimeout (s)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, job outputs)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("real_slurm: needs root (network namespaces, system daemons)")
    reason = netns_hosts.unavailable_reason()
    if reason:
        sys.exit(f"real_slurm: {reason}")
    ensure_installed()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, f: sys.exit(128 + s))
    tmp = Path(tempfile.mkdtemp(prefix="real-slurm-"))
    hosts = slurm = None
    try:
        from scaletrain.prepare import prepare_gettext

        shards = tmp / "shards" / "django5"
        prepare_gettext(package="django", langs=TEST_LANGS, out=shards, progress=False)
        hosts = netns_hosts.make_hosts(2)
        t0 = time.monotonic()
        slurm = Slurm(hosts, tmp, args.slurmd_timeout)
        check = Check(slurm, tmp, shards)
        check.srun_opts, check.srun_wait = args.srun_opts, args.srun_wait
        check.record(f"SLURM up: munged, slurmctld, 2 slurmd in {time.monotonic() - t0:.1f} s ({tmp})")
        failed = None
        try:
            for c in args.cases:
                getattr(check, f"case_{c}")()
        except AssertionError as e:
            failed = e
        write_report(Path(args.report), check, slurm, failed)
        if failed is not None:
            raise failed
    finally:
        if slurm is not None:
            slurm.close()
        if hosts is not None:
            hosts.close()
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
