"""The start of the process group is bounded: past ``engine.rendezvous_timeout_s`` (or on a connection error)
a rank stops with one line naming its host, the address it advertised and the variable to set."""
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from scaletrain.engine import rendezvous as rv
from scaletrain.errors import ScaletrainError


def _cfg(timeout_s):
    return SimpleNamespace(engine=SimpleNamespace(rendezvous_timeout_s=timeout_s))


def test_the_line_names_host_address_variable_and_the_store(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "9")  # nothing listens on the discard port here
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    line = rv.stuck_line(5)
    assert line.startswith(f"{os.uname().nodename} (rank 1) did not join the job's process group within "
                           "engine.rendezvous_timeout_s=5 s: it advertises 127.0.0.1 (interface lo, from "
                           "GLOO_SOCKET_IFNAME)"), line
    assert "the rendezvous at 127.0.0.1:9 does not answer" in line and "set GLOO_SOCKET_IFNAME" in line
    assert "(here lo, which routes to MASTER_ADDR)" in line and line.endswith("(exit 2)")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert "(its own hostname" in rv.stuck_line(5) and "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME unset" in rv.stuck_line(5)


def test_a_connection_error_in_the_start_becomes_the_line_and_others_pass(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "9")
    with pytest.raises(ScaletrainError) as e:
        with rv.bounded_start(_cfg(30)):
            raise RuntimeError("Gloo connectFullMesh failed with [...] Connection refused, remote=[127.0.1.1]:4242")
    assert "could not connect to its peers (Gloo connectFullMesh failed" in str(e.value)
    assert "GLOO_SOCKET_IFNAME" in str(e.value)
    with pytest.raises(ValueError):  # not a connection error: as it was
        with rv.bounded_start(_cfg(30)):
            raise ValueError("bad shape")


WATCHED = """
import sys, time
from types import SimpleNamespace
from scaletrain.engine.rendezvous import bounded_start
with bounded_start(SimpleNamespace(engine=SimpleNamespace(rendezvous_timeout_s=float(sys.argv[1])))):
    time.sleep(float(sys.argv[2]))  # a connect that does not return
print("started")
"""


@pytest.mark.parametrize("bound,blocked,code", [(0.5, 30, 2), (0, 1.0, 0), (5, 0.2, 0)])
def test_the_watchdog_ends_a_start_stuck_past_the_bound(bound, blocked, code):
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", WATCHED, str(bound), str(blocked)], env=env, capture_output=True,
                       text=True, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == code, p.stderr[-2000:]
    if code:
        assert took < 15 and "started" not in p.stdout
        errs = [ln for ln in p.stderr.splitlines() if ln.startswith("scaletrain: error:")]
        assert len(errs) == 1 and "within engine.rendezvous_timeout_s=0.5 s" in errs[0], p.stderr[-2000:]
    else:
        assert "started" in p.stdout and "scaletrain: error" not in p.stderr
