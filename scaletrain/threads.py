"""How many CPU threads torch uses in this process: one rule for training, evaluate and translate.

    n, why = plan_threads(cores=CpuBudget.detect(), local_ranks=2)        # pure: tested with injected facts
    apply_threads(requested=None, local_ranks=None, inference=False)  # sets torch, logs once

The rule, first match wins:

1. an explicit request: ``--threads N`` or ``engine.threads: N`` (N >= 1);
2. ``OMP_NUM_THREADS`` set by the user (``launch.sh`` passes the user's value on as
   ``SCALETRAIN_USER_OMP_NUM_THREADS``, so a value a launcher put there for its ranks is not mistaken for one);
3. otherwise the cores this process may run on (``os.sched_getaffinity``, capped by a cgroup CPU quota:
   v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``) divided by the ranks on this node
   (``LOCAL_WORLD_SIZE``, DeepSpeed's ``LOCAL_SIZE``), at least 1; for ``evaluate``/``translate`` (one process,
   short parallel regions) further capped by the cores that are idle right now (``/proc/stat`` sampled over
   0.2 s): with one of two cores busy, two OpenMP threads wait on each other at every barrier for a whole
   scheduler slice (measured: evaluate 3.9 sentences/s at the default 2 threads vs 100 at 1).

Never more threads than usable cores: a request above that is capped and the log line says so. Written here
(not left to torch's default of all cores) because neither torch nor the launchers look at affinity, quotas
and ranks together.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("scaletrain")

USER_OMP_ENV = "SCALETRAIN_USER_OMP_NUM_THREADS"
_applied: list[tuple[int, str]] = []  # what apply_threads set last (logged once per distinct value)


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use: the affinity set and the cgroup quota in cores (None: no quota)."""

    cpus: tuple[int, ...]
    quota: float | None = None

    @property
    def cores(self) -> int:
        n = len(self.cpus) or 1
        if self.quota is not None and self.quota > 0:
            n = min(n, max(1, math.floor(self.quota + 1e-9)))
        return n

    @classmethod
    def detect(cls, cgroup_root: str | Path = "/sys/fs/cgroup") -> "CpuBudget":
        try:
            cpus = tuple(sorted(os.sched_getaffinity(0)))
        except (AttributeError, OSError):  # not Linux
            cpus = tuple(range(os.cpu_count() or 1))
        return cls(cpus, cgroup_quota(Path(cgroup_root)))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_cgroup_dirs(root: Path) -> list[Path]:
    """Candidate directories of this process's cgroup (from /proc/self/cgroup), then the root itself."""
    out = []
    text = _read(Path("/proc/self/cgroup")) or ""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[2].startswith("/"):
            ctrl = parts[1]
            sub = parts[2].lstrip("/")
            if ctrl == "":  # v2
                out.append(root / sub)
            elif "cpu" in ctrl.split(","):
                for name in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
                    out.append(root / name / sub)
    return out + [root, root / "cpu,cpuacct", root / "cpu"]


def _quota_at(d: Path) -> float | None:
    """The quota set in one cgroup directory (v2 ``cpu.max`` or v1 CFS files), None if none or unlimited."""
    v2 = _read(d / "cpu.max")
    if v2:
        q, _, period = v2.partition(" ")
        try:
            return None if q == "max" else int(q) / int(period or 100000)
        except ValueError:
            return None
    q, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
    try:
        return None if q is None or not period or int(q) <= 0 else int(q) / int(period)
    except ValueError:
        return None


def cgroup_quota(root: Path) -> float | None:
    """The CPU quota in cores of this process's cgroup: the smallest quota on the way from its directory up
    to ``root`` (a parent's limit binds its children); None if unlimited or unreadable."""
    found = []
    for d in _own_cgroup_dirs(root):
        while True:
            q = _quota_at(d)
            if q is not None:
                found.append(q)
            if d == root or root not in d.parents:
                break
            d = d.parent
    return min(found) if found else None


def idle_cores(cpus: tuple[int, ...], seconds: float = 0.2, stat: str = "/proc/stat") -> float | None:
    """How many of ``cpus`` were idle over ``seconds`` (sum of per-CPU idle fractions); this process's own CPU
    time in the window counts as idle (it is ours to use). None where /proc/stat is unreadable."""
    def sample():
        text = _read(Path(stat))
        if not text:
            return None
        rows = {}
        for line in text.splitlines():
            name, *vals = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                v = [int(x) for x in vals[:8]]
                rows[int(name[3:])] = (v[3] + v[4], sum(v))  # idle + iowait, total (jiffies)
        return rows

    a, t0 = sample(), os.times()
    if not a:
        return None
    time.sleep(seconds)
    b, t1 = sample(), os.times()
    if not b:
        return None
    idle = total = 0
    for c, (i0, s0) in a.items():
        if c in b:
            idle += b[c][0] - i0
            total += b[c][1] - s0
    if total <= 0:
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    mine = ((t1.user - t0.user) + (t1.system - t0.system)) * hz
    per_cpu = total / max(1, len(a))
    return min(len(a), (idle + mine) / per_cpu)


def local_ranks_from_env(env=None) -> int:
    """Ranks on this node: torchrun / Accelerate set LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE."""
    env = os.environ if env is None else env
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        try:
            n = int(env.get(key) or 0)
        except ValueError:
            n = 0
        if n > 0:
            return n
    return 1


def user_omp_threads(env=None) -> int | None:
    """OMP_NUM_THREADS as the user set it (launch.sh hands it on in SCALETRAIN_USER_OMP_NUM_THREADS, '' = unset)."""
    env = os.environ if env is None else env
    raw = env[USER_OMP_ENV] if USER_OMP_ENV in env else env.get("OMP_NUM_THREADS", "")
    try:
        n = int(str(raw).strip() or 0)
    except ValueError:
        return None
    return n if n > 0 else None


def plan_threads(budget: CpuBudget, local_ranks: int = 1, requested: int | None = None,
                 omp: int | None = None, idle: float | None = None) -> tuple[int, str]:
    """The thread count and a short reason (the rule of the module docstring; every fact injected)."""
    cores = budget.cores
    quota = f", cgroup quota {budget.quota:g}" if budget.quota else ""
    where = f"{cores} usable core(s) (affinity {len(budget.cpus)}{quota})"
    for n, source in ((requested, "requested"), (omp, "OMP_NUM_THREADS")):
        if n:
            if n > cores:
                return cores, f"{source} {n} capped to {where}"
            return n, f"{source} {n}"
    ranks = max(1, local_ranks)
    n = max(1, cores // ranks)
    why = f"{where} / {ranks} rank(s) on this node"
    if idle is not None and n > 1:
        free = max(1, int(idle + 0.3))  # a core counts as free when >= 70% idle
        if free < n:
            return free, f"{why}, {idle:.1f} idle now"
    return n, why


def apply_threads(requested: int | None = None, local_ranks: int | None = None, inference: bool = False,
                  cuda: bool | None = None, announce: bool = True) -> int:
    """Set torch's intra-op threads by :func:`plan_threads` and log the choice once (rank 0's logger level
    decides who prints it; ``announce=False``: at debug level, for a filter like ``translate`` whose stderr
    carries only errors). ``inference``: cap by the cores idle now (evaluate, translate). With a GPU the
    CPU threads only feed it: only an explicit request or OMP_NUM_THREADS changes torch's default."""
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    omp = user_omp_threads()
    if cuda and not (requested or omp):
        return torch.get_num_threads()
    budget = CpuBudget.detect()
    idle = None
    if inference and not (requested or omp) and budget.cores > 1:
        idle = idle_cores(budget.cpus)
    n, why = plan_threads(budget, local_ranks_from_env() if local_ranks is None else local_ranks,
                          requested=requested, omp=omp, idle=idle)
    torch.set_num_threads(n)
    if not cuda:
        torch.set_flush_denormal(True)  # denormals wreck fp32 CPU throughput (32 vs 748 tokens/s measured)
    if (n, why) not in _applied:
        _applied.append((n, why))
        log.log(logging.INFO if announce else logging.DEBUG, "threads %d: %s", n, why)
    return n
