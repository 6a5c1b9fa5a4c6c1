"""Which network interface a rank's gloo/NCCL sockets use: the one that routes to the rendezvous address.

gloo and NCCL advertise the address of the interface named by ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME``; unset, gloo resolves the machine's own hostname, which on Debian and Ubuntu
(``127.0.1.1 HOSTNAME`` in /etc/hosts) is a loopback address no peer can reach: the peers fail with
"connectFullMesh ... Connection refused, remote=[127.0.1.1]" and the rank that advertised it waits. Here
each rank asks the kernel which local address routes to ``MASTER_ADDR`` (a UDP ``connect()`` sends
nothing, ``getsockname()`` gives the source address the route would use), maps that address to its
interface with ``psutil.net_if_addrs()`` and sets both variables for itself before the process group
starts. A value the user set is kept (and said once). Nothing in torch, DeepSpeed or Accelerate does
this choice, hence this module.
"""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)
VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def route_source(addr: str) -> str | None:
    """The local IPv4 address the kernel would use to reach ``addr`` (None: no route or unresolvable)."""
    try:
        infos = socket.getaddrinfo(addr, 9, socket.AF_INET, socket.SOCK_DGRAM)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])
            return s.getsockname()[0]
    except OSError:
        return None


def interface_of(local_addr: str) -> str | None:
    """The name of the interface holding ``local_addr`` (None if none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local_addr for a in addrs):
            return name
    return None


def choose_socket_ifname(env=os.environ) -> str | None:
    """Set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (those unset) to the interface that routes to
    MASTER_ADDR; return the interface chosen, or None where nothing was set."""
    master = env.get("MASTER_ADDR")
    user = {v: env[v] for v in VARS if env.get(v)}
    if user:
        log.info("network: %s as set by the user", ", ".join(f"{k}={v}" for k, v in user.items()))
    if not master or len(user) == len(VARS):
        return None
    src = route_source(master)
    iface = interface_of(src) if src else None
    if iface is None:
        log.info("network: no local interface routes to MASTER_ADDR=%s; gloo/NCCL choose their own", master)
        return None
    for v in VARS:
        if not env.get(v):
            env[v] = iface
    log.info("network: %s (%s) routes to MASTER_ADDR=%s; GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME=%s unless set",
             iface, src, master, iface)
    return iface
