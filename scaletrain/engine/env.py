"""Process environment for the engine: launcher variables, the collective timeout, CPU threads, the start of
an Accelerate run (:func:`start_accelerator`), and what a surviving rank says when a peer died
(:class:`Peers`). DeepSpeed's own start-up (``init_distributed`` without compiling its unused ops) is in
``deepspeed_internals.py``.

Crashed ranks: the process group starts with ``engine.collective_timeout_minutes`` (gloo and NCCL), so
a rank blocked on a dead or hung peer fails within that bound instead of torch's default (30 min gloo,
10 min NCCL); a peer that died outright closes its sockets and the blocked collective fails at once.
Every rank records all ranks' (host, pid) at start; when a collective fails, each surviving rank looks
up which peers on its host are gone and stops with one line naming them (``rank 1 (pid 123 on host)
died``). Peers on other hosts are named by the heartbeat (``heartbeat.py``: whose counters in the
rendezvous store stopped), which also stops every rank within ``engine.peer_timeout_s`` when a host is cut
off. Either way the exit code is 76 (:data:`~scaletrain.engine.heartbeat.PEER_LOST_EXIT`): retry.
"""
from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain.errors import ScaletrainError


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


SHARED_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # set to 1 for torchrun: each round builds its store info


def elastic_join_note(environ=None) -> str | None:
    """The line rank 0 prints once (the agent's first attempt) when torchrun runs this job with restarts
    allowed and its rendezvous store shared with the workers (torch's default: the agent puts
    ``TORCHELASTIC_USE_AGENT_STORE=True`` in the worker's environment, which holds the agent's own variables
    too), else None. Then a node that comes back while the job runs cannot join: the agents restart the workers
    to take it in, but torch's ``DynamicRendezvousHandler.next_rendezvous`` (2.13) keeps the first round's
    store address on the node that stays rank 0, which never writes it under the new round's keys, so the
    new node waits for it until the rendezvous times out. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torchrun
    makes every round build it (``launch.sh --elastic`` sets it)."""
    env = os.environ if environ is None else environ
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "")
    if (env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get(SHARED_STORE_OFF) == "1"
            or not restarts.isdigit() or int(restarts) == 0 or env.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"):
        return None
    return (f"torchrun restarts this job (--max-restarts={restarts}) with its rendezvous store shared with the "
            f"workers: a node that comes back while the job runs cannot join it (the new rendezvous round times "
            f"out) unless {SHARED_STORE_OFF}=1 is set for torchrun (launch.sh --elastic sets it)")


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


def configure_threads(cfg) -> int:
    """The rank's torch threads (:func:`scaletrain.threads.apply_threads`: ``engine.threads``, else the user's
    OMP_NUM_THREADS, else usable cores / ranks on this node; a single-node launch without LOCAL_* variables
    counts WORLD_SIZE ranks)."""
    from scaletrain.threads import apply_threads, local_ranks_from_env

    local = local_ranks_from_env()
    if "LOCAL_WORLD_SIZE" not in os.environ and "LOCAL_SIZE" not in os.environ:
        local = max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))
    return apply_threads(requested=cfg.engine.threads or None, local_ranks=local)


MIXED = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}  # engine.precision -> Accelerate's mixed_precision


def check_accelerate_launch(cfg) -> None:
    """One line where ``accelerate launch`` was given a DeepSpeed config that is not this run's."""
    launcher_ds = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if launcher_ds and cfg.engine.accelerate != "deepspeed":
        raise ScaletrainError(
            "accelerate launch was given a DeepSpeed config (distributed_type: DEEPSPEED) but "
            "engine.accelerate is 'ddp'; set engine.accelerate=deepspeed or launch with ds_configs/accelerate_ddp.yaml"
        )
    launcher_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if launcher_ds and launcher_file:
        from scaletrain.engine.ds_config import resolve_ds_config_path

        ours = resolve_ds_config_path(cfg.engine.ds_config).resolve()
        theirs = Path(launcher_file)
        if not theirs.is_file() or theirs.resolve() != ours:
            raise ScaletrainError(
                f"the accelerate launch config names deepspeed_config_file {launcher_file} but engine.ds_config "
                f"is {cfg.engine.ds_config} ({ours}); make them the same file "
                "(launch.sh passes --deepspeed_config_file from engine.ds_config)"
            )


def start_accelerator(cfg, expected: int, plugin=None):
    """Accelerate's ``Accelerator`` for this rank (``plugin``: its DeepSpeed plugin, else plain DDP). Runs
    under ``accelerate launch``, under the ``deepspeed`` launcher, or as a single plain process. On CPU the
    process group is gloo and the world size Accelerate reports is checked against the launcher's
    WORLD_SIZE (``expected``): Accelerate otherwise silently runs every process alone."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cuda = torch.cuda.is_available()
    launched = "LOCAL_RANK" in os.environ or expected > 1
    acc = Accelerator(
        cpu=not cuda and plugin is None,
        deepspeed_plugin=plugin,
        mixed_precision=MIXED[cfg.engine.precision],
        gradient_accumulation_steps=cfg.engine.grad_accum,
        step_scheduler_with_optimizer=False,  # the LR schedule is the engine's (optim.UpdateSchedule)
        # a plain single process must not name a backend: Accelerate would then expect a process group
        kwargs_handlers=[InitProcessGroupKwargs(backend="nccl" if cuda else "gloo", timeout=collective_timeout(cfg))]
        if launched else [],
    )
    if acc.num_processes != expected:
        raise ScaletrainError(
            f"Accelerate runs {acc.num_processes} process(es) but the launcher started {expected} "
            f"(WORLD_SIZE); on CPU the process group must be gloo and the launch config use_cpu: true"
        )
    return acc


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

    def explain(self, e: BaseException, heartbeat=None, resume: str = ""):
        """A :class:`~scaletrain.engine.heartbeat.PeerLost` (exit code 76: retry) for a collective that failed
        because a peer died or hung, else None (not a collective failure: the caller re-raises the original).
        Peers on this host are checked by pid; peers on other hosts by the ``heartbeat``
        (:meth:`~scaletrain.engine.heartbeat.Heartbeat.confirm`: whose counters stopped), which names their
        host. ``resume``: what the last good checkpoint is and how to resume from it."""
        from scaletrain.engine.heartbeat import PEER_LOST_EXIT, PeerLost, describe_lost, lost_line

        if self.world_size == 1 or not isinstance(e, RuntimeError):
            return None
        text = str(e).lower()
        collective = any(w in text for w in ("gloo", "nccl", "timed out", "timeout", "connection", "peer", "socket",
                                             "broken pipe"))
        dead = self.dead()
        host = socket.gethostname()
        local_peers = any(h == host and r != self.rank for r, (h, _) in enumerate(self.table))
        # a killed peer's sockets close while its process is still exiting: wait for it, if one is on this host
        deadline = time.monotonic() + (3.0 if local_peers else 0.0)
        while not dead and collective and time.monotonic() < deadline:
            time.sleep(0.1)
            dead = self.dead()
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        resume = resume or "re-run the same command to resume from the last checkpoint"
        if dead:
            who = ", ".join(f"rank {r} (pid {self.table[r][1]} on {self.table[r][0]})" for r in dead)
            return PeerLost(f"{who} died; rank {self.rank} stops ({first}; exit {PEER_LOST_EXIT}: retry); see the "
                            f"dead rank's own output for its cause, then {resume}")
        if not collective:
            return None
        if heartbeat is not None:  # peers on other hosts whose heartbeats stopped: their host is lost
            lost, store_lost = heartbeat.confirm()
            lost = [r for r in lost if self.table[r][0] != host]
            if lost or store_lost:
                return PeerLost(lost_line(self.rank, lost, store_lost, self.table, heartbeat.timeout_s, resume,
                                          cause=f"collective failed ({first})"))
        remote = [r for r, (h, _) in enumerate(self.table) if h != host]
        where = (f"no rank on {host} died; the failed peer is one of {describe_lost(remote, self.table)} on other "
                 f"hosts" if remote else f"every rank on {host} is alive: a peer is hung or the network failed")
        return PeerLost(f"collective failed on rank {self.rank} ({first}); {where}; a hung peer fails after "
                        f"engine.collective_timeout_minutes (exit {PEER_LOST_EXIT}: retry); {resume}")
