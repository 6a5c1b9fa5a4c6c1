"""Several "hosts" on one machine, each with its own network stack, hostname and /etc/hosts.

Multi-node code paths differ from single-node ones in the network: which interface a rank advertises, what
a host's own name resolves to, which addresses a peer can reach. Two processes on 127.0.0.1 exercise none
of that. This module makes N hosts from Linux network namespaces:

- one hub namespace holding a bridge, and one namespace per host joined to it by a veth pair; nothing is
  added to the machine's own network namespace, so parallel runs cannot clash (each set also has its own
  random /24 from 198.18.0.0/15, the range reserved for benchmarking, and only inside these namespaces);
- each host: ``lo`` up, ``eth0`` with 198.18.X.(i+1)/24, its own hostname (``unshare --uts`` per command),
  its own ``/etc/hosts`` (``ip netns exec`` bind-mounts ``/etc/netns/NAME/hosts`` over ``/etc/hosts``)
  where every host's name resolves to that host's address, or, with ``own_name="loopback"``, the host's
  own name resolves to 127.0.1.1 (Debian's and Ubuntu's default, the classic multi-node pitfall).

It is written here rather than taken from a library because the pieces are the ``ip``/``unshare`` tools
themselves; the module only sequences them and guarantees cleanup. Cleanup runs on every exit path: the
``close()`` of the set (pytest finalizer), ``atexit``, and at the start of every set a sweep of sets left
by a process that no longer exists (a run killed with SIGKILL): namespaces are named
``PREFIX-<pid>-<tag>`` so the sweep knows their owner.

Making namespaces needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN). ``unavailable_reason()`` says why they cannot
be made here, for a skip; the pytest fixture in conftest.py fails instead of skipping when ``CI=true``.
"""
from __future__ import annotations

import atexit
import os
import random
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "stnh"  # namespaces: stnh-<pid>-hub, stnh-<pid>-<i>; veth/bridge names stay under 15 characters
NETNS_ETC = Path("/etc/netns")
LOOPBACK_OWN_ADDR = "127.0.1.1"
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)-(\w+)$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _netns_names() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_netns(name: str) -> None:
    # Deleting a namespace removes its interfaces (the veth peers in the hub go with them).
    _ip("netns", "del", name, check=False)
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


def sweep_stale() -> list[str]:
    """Remove namespace sets (and their /etc/netns directories) whose creating process is gone."""
    removed = []
    names = set(_netns_names())
    if NETNS_ETC.is_dir():
        names |= {p.name for p in NETNS_ETC.iterdir()}
    for name in sorted(names):
        m = _NAME_RE.match(name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _remove_netns(name)
            removed.append(name)
    return removed


def unavailable_reason() -> str | None:
    """None when network namespaces can be made here, otherwise why not (one line)."""
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"network namespaces: `{tool}` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); this test runs as uid %d" % os.geteuid()
    probe = f"{PREFIX}-{os.getpid()}-probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"network namespaces cannot be made here: ip netns add: {r.stderr.strip()}"
    try:
        r = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts", "true"], capture_output=True,
                           text=True, timeout=30)
        if r.returncode != 0:
            return f"unshare --uts fails inside a network namespace: {r.stderr.strip()}"
    finally:
        _remove_netns(probe)
    return None


@dataclass
class Host:
    """One namespace host: ``netns`` (namespace name), ``hostname``, ``addr`` (its eth0 IPv4 address)."""
    netns: str
    hostname: str
    addr: str
    iface: str = "eth0"

    def command(self, cmd: list[str]) -> list[str]:
        """``cmd`` as run on this host: in its network namespace, with its /etc/hosts and its hostname."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.hostname, *cmd]

    def popen(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` on this host (Popen's keyword arguments pass through)."""
        return subprocess.Popen(self.command(cmd), **kwargs)

    def run(self, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.command(cmd), **kwargs)


@dataclass
class HostSet:
    """N hosts on one bridge; ``close()`` removes everything (idempotent)."""
    tag: str
    subnet: int  # the X of 198.18.X.0/24 (or 198.19.X-256.0/24)
    hosts: list[Host] = field(default_factory=list)
    hub: str = ""
    closed: bool = False

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self):
        return iter(self.hosts)

    def write_hosts_files(self, own_name: str = "self", extra: dict[str, str] | None = None) -> None:
        """Write every host's /etc/hosts: all hosts' names -> their addresses, plus ``extra`` (name -> address).
        ``own_name="loopback"``: each host's own name -> 127.0.1.1 instead (the peers still resolve it right)."""
        if own_name not in ("self", "loopback"):
            raise ValueError(f"own_name must be 'self' or 'loopback', not {own_name!r}")
        for h in self.hosts:
            lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
            for other in self.hosts:
                addr = LOOPBACK_OWN_ADDR if (other is h and own_name == "loopback") else other.addr
                lines.append(f"{addr}\t{other.hostname}")
            lines += [f"{a}\t{n}" for n, a in (extra or {}).items()]
            d = NETNS_ETC / h.netns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text("\n".join(lines) + "\n")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for h in self.hosts:
            _remove_netns(h.netns)
        if self.hub:
            _remove_netns(self.hub)


_OPEN: list[HostSet] = []


@atexit.register
def _close_all() -> None:
    for s in _OPEN:
        s.close()


def make_hosts(n: int, own_name: str = "self") -> HostSet:
    """Make ``n`` hosts joined by a bridge; see the module docstring. Raises RuntimeError (with ``ip``'s
    message) when a step fails, after removing what was made."""
    sweep_stale()
    pid = os.getpid()
    tag = f"{random.randrange(16**4):04x}"
    subnet = random.randrange(512)
    net = f"198.{18 + subnet // 256}.{subnet % 256}"
    hs = HostSet(tag=tag, subnet=subnet)
    _OPEN.append(hs)
    try:
        hs.hub = f"{PREFIX}-{pid}-{tag}hub"
        _ip("netns", "add", hs.hub)
        _ip("-n", hs.hub, "link", "set", "lo", "up")
        _ip("-n", hs.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hs.hub, "link", "set", "br0", "up")
        for i in range(n):
            h = Host(netns=f"{PREFIX}-{pid}-{tag}h{i}", hostname=f"st{tag}-node{i}", addr=f"{net}.{i + 1}")
            hs.hosts.append(h)
            _ip("netns", "add", h.netns)
            _ip("-n", h.netns, "link", "set", "lo", "up")
            # the pair is made in the host's namespace, its peer moved to the hub and enslaved to the bridge
            _ip("-n", h.netns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", hs.hub)
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            _ip("-n", h.netns, "link", "set", "eth0", "up")
            _ip("-n", hs.hub, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", hs.hub, "link", "set", f"p{i}", "up")
        hs.write_hosts_files(own_name)
    except subprocess.CalledProcessError as e:
        hs.close()
        raise RuntimeError(f"making namespace hosts failed: {' '.join(e.cmd)}: {e.stderr.strip()}") from None
    except BaseException:
        hs.close()
        raise
    return hs


def leftovers(hs: HostSet) -> list[str]:
    """What of ``hs`` still exists (namespaces, /etc/netns directories): empty after ``close()``."""
    names = [hs.hub] + [h.netns for h in hs.hosts]
    live = set(_netns_names())
    return [n for n in names if n in live] + [str(NETNS_ETC / n) for n in names if (NETNS_ETC / n).exists()]
