"""The namespace-hosts fixture itself: separate network stacks that reach each other over TCP, each with its
own hostname and /etc/hosts, the 127.0.1.1 option, and nothing left behind."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import netns_hosts as nh

SERVER = """
import socket, sys
s = socket.socket(); s.bind(("0.0.0.0", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, peer = s.accept()
c.sendall((socket.gethostname() + " " + peer[0]).encode()); c.close()
"""
CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
print(c.recv(200).decode(), socket.gethostname(), socket.gethostbyname(socket.gethostname()))
"""


def test_two_hosts_talk_over_tcp_by_name_with_their_own_hostnames(netns_hosts):
    hosts = netns_hosts(2)
    h0, h1 = hosts[0], hosts[1]
    assert h0.addr != h1.addr and h0.addr.startswith(("198.18.", "198.19."))
    srv = h0.popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = srv.stdout.readline().strip()
        # host1 reaches host0 by host0's name (its /etc/hosts), not by an address
        out = h1.run([sys.executable, "-c", CLIENT, h0.hostname, port], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        server_name, peer_addr, client_name, client_resolves_self = out.stdout.split()
        assert (server_name, peer_addr) == (h0.hostname, h1.addr)
        assert (client_name, client_resolves_self) == (h1.hostname, h1.addr)
        assert srv.wait(timeout=10) == 0
    finally:
        srv.kill()
    # separate network stacks: host0 has only lo and its eth0, not the machine's interfaces
    links = h0.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()] == ["lo", "eth0"]
    # the hostnames did not leak to the machine
    assert os.uname().nodename not in (h0.hostname, h1.hostname)


def test_own_name_can_resolve_to_127_0_1_1(netns_hosts):
    hosts = netns_hosts(2)
    try:
        hosts.write_hosts_files(own_name="loopback")
        resolve = [sys.executable, "-c", "import socket,sys; print(*(socket.gethostbyname(n) for n in sys.argv[1:]))"]
        out = hosts[1].run(resolve + [hosts[0].hostname, hosts[1].hostname], capture_output=True, text=True)
        assert out.stdout.split() == [hosts[0].addr, "127.0.1.1"], out.stderr
    finally:
        hosts.write_hosts_files(own_name="self")
    out = hosts[1].run(resolve + [hosts[1].hostname], capture_output=True, text=True)
    assert out.stdout.split() == [hosts[1].addr]


def test_cleanup_leaves_nothing_and_stale_sets_are_swept():
    if nh.unavailable_reason():
        pytest.skip(nh.unavailable_reason())
    hs = nh.make_hosts(3)
    assert not hs.hosts[2].run(["ip", "-4", "addr", "show", "eth0"], capture_output=True).returncode
    assert len(nh.leftovers(hs)) == 4 + 3  # hub and 3 hosts: namespaces; the hosts' /etc/netns directories
    hs.close()
    assert nh.leftovers(hs) == []
    # a set whose owner died (a SIGKILLed run) is removed by the next set's sweep
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import netns_hosts as nh, os; nh.make_hosts(2); "
            "print(os.getpid()); os._exit(0)")
    pid = subprocess.run([sys.executable, "-c", code, os.path.dirname(nh.__file__)], check=True, timeout=60,
                         capture_output=True, text=True).stdout.strip()
    stale = [n for n in nh._netns_names() if n.startswith(f"{nh.PREFIX}-{pid}-")]
    assert len(stale) == 3 and sum((nh.NETNS_ETC / n).is_dir() for n in stale) == 2  # hub + 2 hosts
    removed = nh.sweep_stale()
    assert set(stale) <= set(removed)
    assert not [n for n in nh._netns_names() if n in stale]
    assert not [n for n in stale if (nh.NETNS_ETC / n).exists()]
