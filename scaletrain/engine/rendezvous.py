"""A bound on joining the job: the process group starts within ``engine.rendezvous_timeout_s`` or every rank
stops with one line naming its host, the address it advertised and the variable to set.

Starting the process group is where a multi-host job most often goes wrong, and where torch says least: a
rank that advertises an address its peers cannot reach (a loopback address, the wrong interface) leaves
its peers waiting in gloo's or NCCL's connect for the whole process-group timeout
(``engine.collective_timeout_minutes``, 10 by default), with no line; the rank whose connection was
refused dies with a traceback that names neither the host nor ``GLOO_SOCKET_IFNAME``. The timeout given to
``init_process_group`` cannot be shorter here: it is also the timeout of every later collective. So a
watchdog thread runs while the process group starts (until its first barrier has returned: every peer
connected): past the bound it prints the line and ends the process with exit 2 (fix the setting: the
rendezvous does not complete by itself), as the heartbeat does for a peer lost later
(:mod:`scaletrain.engine.heartbeat`; the main thread is blocked in C++ and cannot be interrupted). A
connection error raised inside the start becomes the same line at once. Nothing in torch, DeepSpeed or
Accelerate bounds the start apart from the collectives, hence this module.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from typing import Iterator

from scaletrain.engine.heartbeat import record_exit
from scaletrain.engine.netif import VARS, interface_of, route_source

RENDEZVOUS_EXIT = 2  # the same as a configuration error: the setting must change, a retry does not help
CONNECT_MARKERS = ("connectfullmesh", "connection refused", "connection reset", "unable to find address",
                   "no route to host", "timed out", "timeout", "connect")


def _addr_of_interface(name: str) -> str | None:
    import psutil

    for a in psutil.net_if_addrs().get(name, []):
        if a.family == socket.AF_INET:
            return a.address
    return None


def advertised() -> str:
    """The address this rank's gloo/NCCL sockets advertise to the peers, and why."""
    for var in VARS:
        name = os.environ.get(var)
        if name:
            addr = _addr_of_interface(name.split(",")[0])
            return f"{addr or 'no IPv4 address'} (interface {name}, from {var})"
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        addr = "an address it cannot resolve"
    return f"{addr} (its own hostname {host}; {' and '.join(VARS)} unset)"


def _store_answers(addr: str, port: str) -> bool:
    try:
        with socket.create_connection((addr, int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


def stuck_line(timeout_s: float | None, cause: str | None = None) -> str:
    """The one line for a start that did not complete (``cause``: the error raised, else the bound passed)."""
    rank = os.environ.get("RANK", "?")
    master, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
    src = route_source(master) if master != "?" else None
    reach = interface_of(src) if src else None
    store = "answers" if _store_answers(master, port) else "does not answer"
    what = (f"could not connect to its peers ({cause})" if cause else
            f"did not join the job's process group within engine.rendezvous_timeout_s={timeout_s:g} s")
    fix = (f"set {VARS[0]} (and {VARS[1]} on GPUs) on every host to the interface its peers reach it on"
           + (f" (here {reach}, which routes to MASTER_ADDR)" if reach else ""))
    return (f"{socket.gethostname()} (rank {rank}) {what}: it advertises {advertised()}; the rendezvous at "
            f"{master}:{port} {store}. If the hosts cannot reach each other at these addresses, {fix}; if a host "
            f"started late, start every host within engine.rendezvous_timeout_s of the first or raise it "
            f"(exit {RENDEZVOUS_EXIT})")


def is_connect_error(e: BaseException) -> bool:
    text = str(e).lower()
    return any(m in text for m in CONNECT_MARKERS)


@contextlib.contextmanager
def bounded_start(cfg) -> Iterator[None]:
    """Around the start of the process group (through its first barrier): past ``engine.rendezvous_timeout_s``
    this process prints :func:`stuck_line` and exits; a connection error raised inside becomes that line, as
    a :class:`~scaletrain.errors.ScaletrainError` (exit 2). One process, or a bound of 0: no watch."""
    from scaletrain.errors import ScaletrainError

    timeout_s = float(cfg.engine.rendezvous_timeout_s)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        if done.wait(timeout_s):
            return
        print(f"scaletrain: error: {stuck_line(timeout_s)}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        record_exit(RENDEZVOUS_EXIT)
        os._exit(RENDEZVOUS_EXIT)  # the main thread is blocked in a connect nothing else interrupts

    if timeout_s > 0:
        threading.Thread(target=watch, name="scaletrain-rendezvous", daemon=True).start()
    try:
        yield
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # every peer connected (NCCL connects at the first collective, not at the start)
    except Exception as e:
        if isinstance(e, ScaletrainError) or not is_connect_error(e):
            raise
        raise ScaletrainError(stuck_line(None, cause=" ".join(str(e).split())[:300])) from e
    finally:
        done.set()
