"""Process environment for the engines: launcher variables, process-group start, CPU threads, and
what a surviving rank says when a peer died (:class:`Peers`).

Nothing is compiled at start-up: DeepSpeed's communication backend (``deepspeed/comm/torch.py``,
``TorchBackend.__init__``) JIT-builds its shared-memory all-reduce op (``ShareMemCommBuilder``) with gcc
on a CPU accelerator whenever ``deepspeed.ops.__compatible_ops__`` says the op is compatible, and reading
that table probes every op (more gcc runs). The op serves only ``inference_all_reduce`` (tensor-parallel
inference), which we never call; training all-reduces go through ``torch.distributed``.
:func:`skip_unused_deepspeed_ops` puts a table in its place that answers False for that op and probes
any other op only when asked. The build cost 85 s on an idle 2-core CPU and 2.5-4 min on a busy one, at
every start with an empty extensions cache (a fresh clone, a new TORCH_EXTENSIONS_DIR).

Crashed ranks: the process group starts with ``engine.collective_timeout_minutes`` (gloo and NCCL), so
a rank blocked on a dead or hung peer fails within that bound instead of torch's default (30 min gloo,
10 min NCCL); a peer that died outright closes its sockets and the blocked collective fails at once.
Every rank records all ranks' (host, pid) at start; when a collective fails, each surviving rank looks
up which peers on its host are gone and stops with one line naming them (``rank 1 (pid 123 on host)
died``). Peers on other hosts cannot be checked from here: the line names them as candidates.
"""
from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_dist_env() -> None:
    """A plain `python -m scaletrain train` is a world of one: give it the env a launcher would."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
        )


def collective_timeout(cfg) -> timedelta:
    """``engine.collective_timeout_minutes`` for the default process group AND every group created later:
    DeepSpeed makes its data-parallel groups with ``new_group(ranks)``, which takes torch's module default
    (30 min gloo, 10 min NCCL), not the default group's timeout; so the module defaults are set too."""
    import torch.distributed.distributed_c10d as c10d

    t = timedelta(minutes=float(cfg.engine.collective_timeout_minutes))
    c10d.default_pg_timeout = t
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):
        c10d.default_pg_nccl_timeout = t
    return t


def init_deepspeed_distributed(backend: str, timeout: timedelta | None = None) -> None:
    """``deepspeed.init_distributed``, then remove DeepSpeed's shared-memory allreduce file.

    With every rank on one host, DeepSpeed's CPU backend maps a 66 MB segment per rank named
    ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` and never
    unlinks it: each run leaves its segments in RAM (/dev/shm) until reboot (we found 243 of them,
    16 GB, after a few days of test runs). Every rank maps every peer's segment inside
    ``init_distributed``, so after a barrier the names can go; the mappings live on until exit.
    """
    import deepspeed

    skip_unused_deepspeed_ops()
    kw = {"timeout": timeout} if timeout is not None else {}
    deepspeed.init_distributed(dist_backend=backend, verbose=False, **kw)
    if torch.cuda.is_available() or not dist.is_initialized():
        return
    dist.barrier()
    name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), dist.get_rank()
    )
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:  # not all ranks local, or another DeepSpeed build
        pass


UNUSED_DEEPSPEED_OPS = ("deepspeed_shm_comm",)  # ShareMemCommBuilder.NAME: inference_all_reduce only


class _LazyCompatibleOps(dict):
    """``deepspeed.ops.__compatible_ops__``, probed one op at a time on first look-up (DeepSpeed probes
    every op, compiling test programs, on first access); the ops in ``skip`` are never probed or built."""

    def __init__(self, skip, known=None):
        super().__init__(known or {})
        self.update({name: False for name in skip})

    def __missing__(self, name):
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
        from deepspeed.ops.op_builder.builder import probe_is_compatible

        builder = ALL_OPS.get(name)
        ok = bool(builder is not None and probe_is_compatible(builder))
        self[name] = ok
        return ok

    def get(self, name, default=None):
        try:
            return self[name]
        except (KeyError, ImportError):
            return default


def skip_unused_deepspeed_ops(skip=UNUSED_DEEPSPEED_OPS) -> None:
    """Before DeepSpeed's communication backend starts: mark the ops we never use as incompatible, so it
    does not JIT-build them (gcc) at start-up. Safe to call more than once."""
    import deepspeed.ops as ops

    table = vars(ops).get("__compatible_ops__")  # DeepSpeed < 0.19 computes it at import
    if isinstance(table, _LazyCompatibleOps):
        return
    ops.__compatible_ops__ = _LazyCompatibleOps(skip, known=table)


def configure_threads(cfg) -> int:
    """The rank's torch threads (:func:`scaletrain.threads.apply_threads`: ``engine.threads``, else the user's
    OMP_NUM_THREADS, else usable cores / ranks on this node; a single-node launch without LOCAL_* variables
    counts WORLD_SIZE ranks)."""
    from scaletrain.threads import apply_threads, local_ranks_from_env

    local = local_ranks_from_env()
    if "LOCAL_WORLD_SIZE" not in os.environ and "LOCAL_SIZE" not in os.environ:
        local = max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))
    return apply_threads(requested=cfg.engine.threads or None, local_ranks=local)


class Peers:
    """Every rank's (host, pid), gathered once at start (collective); :meth:`explain` turns a failed
    collective into one line naming the dead peer(s)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        me = (socket.gethostname(), os.getpid())
        self.table: list[tuple[str, int]] = [me]
        if world_size > 1 and dist.is_initialized():
            self.table = [None] * world_size  # type: ignore[list-item]
            dist.all_gather_object(self.table, me)

    def dead(self) -> list[int]:
        """Ranks on this host whose process is gone (or a zombie waiting for the launcher to reap it)."""
        import psutil

        host = socket.gethostname()
        out = []
        for r, (h, pid) in enumerate(self.table):
            if r == self.rank or h != host:
                continue
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    out.append(r)
            except psutil.NoSuchProcess:
                out.append(r)
        return out

    def explain(self, e: BaseException):
        """A :class:`ScaletrainError` for a collective that failed because a peer died or hung, else None
        (not a collective failure: the caller re-raises the original)."""
        from scaletrain.errors import ScaletrainError

        if self.world_size == 1 or not isinstance(e, RuntimeError):
            return None
        dead = self.dead()
        deadline = time.monotonic() + 3.0  # a killed peer's sockets close while its process is still exiting
        while not dead and time.monotonic() < deadline:
            time.sleep(0.1)
            dead = self.dead()
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        resume = "re-run the same command to resume from the last checkpoint"
        if dead:
            who = ", ".join(f"rank {r} (pid {self.table[r][1]} on {self.table[r][0]})" for r in dead)
            return ScaletrainError(f"{who} died; rank {self.rank} stops ({first}); see the dead rank's own output "
                                   f"for its cause, then {resume}")
        text = str(e).lower()
        if not any(w in text for w in ("gloo", "nccl", "timed out", "timeout", "connection", "peer", "socket",
                                       "broken pipe")):
            return None
        host = socket.gethostname()
        remote = [r for r, (h, _) in enumerate(self.table) if h != host]
        where = (f"no rank on {host} died; the failed peer is one of ranks {remote} on other hosts" if remote else
                 f"every rank on {host} is alive: a peer is hung or the network failed")
        return ScaletrainError(f"collective failed on rank {self.rank} ({first}); {where}; a hung peer fails after "
                               f"engine.collective_timeout_minutes; {resume}")
