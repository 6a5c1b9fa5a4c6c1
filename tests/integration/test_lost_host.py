"""A host cut off mid-step on namespace hosts (tests/netns_hosts.py): host 1's link set down inside its
namespace (a partition: no reset, half-open connections). Both hosts stop within engine.peer_timeout_s
(10 s here; default 60) plus a few seconds, exit 76 (retry), each with one line: host 0 names host 1 and its
rank, host 1 says rank 0's host (the rendezvous store) is unreachable."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import ROOT, launcher_env
from test_nonfinite import TINY

DRIVER = "tests/integration/lost_peer_driver.py"
PEER_TIMEOUT = 10


def test_a_host_whose_link_goes_down_stops_both_hosts_with_exit_76(netns_hosts, django_shards, tmp_path):
    hosts = netns_hosts(2)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h.hostname} slots=1\n" for h in hosts))
    out = tmp_path / "run"
    out.mkdir()
    exe = str(Path(sys.executable).with_name("deepspeed"))
    env = {**launcher_env(tmp_path), "SLOW_STEP_SECONDS": "0.05"}
    logs = [tmp_path / f"host{k}.log" for k in (0, 1)]
    procs = []
    for k, h in enumerate(hosts):
        with open(logs[k], "w") as f:
            procs.append(h.popen(
                [exe, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(k), "--master_addr", hosts[0].addr,
                 "--master_port", "29531", "--no_local_rank", DRIVER, str(out), "small", f"data.shards={django_shards}",
                 *TINY, f"train.out_dir={out}", "train.max_steps=100000", "train.save_every=0", "train.valid_every=0",
                 f"engine.peer_timeout_s={PEER_TIMEOUT}"],
                env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        deadline = time.time() + 180
        while "step      3 |" not in logs[0].read_text():
            assert all(p.poll() is None for p in procs) and time.time() < deadline, logs[0].read_text()[-3000:]
            time.sleep(0.1)
        subprocess.run(["ip", "netns", "exec", hosts[1].netns, "ip", "link", "set", hosts[1].iface, "down"], check=True)
        t0 = time.time()
        took = []
        for p in procs:
            p.wait(timeout=120)
            took.append(time.time() - t0)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    texts = [lg.read_text() for lg in logs]
    print(f"link of host 1 down: exits {[p.returncode for p in procs]} after {[round(t, 1) for t in took]} s "
          f"(engine.peer_timeout_s={PEER_TIMEOUT})")
    assert [p.returncode for p in procs] == [76, 76], texts[0][-2000:] + texts[1][-2000:]
    assert all(t < PEER_TIMEOUT + 10 for t in took), took
    line0 = next(ln for ln in texts[0].splitlines() if "scaletrain: error:" in ln)
    assert line0.startswith(f"scaletrain: error: lost {hosts[1].hostname} (rank 1): no heartbeat for {PEER_TIMEOUT} s"), line0
    assert f"rank 0 on {hosts[0].hostname} stops (exit 76: retry)" in line0, line0
    line1 = next(ln for ln in texts[1].splitlines() if "scaletrain: error:" in ln)
    assert f"{hosts[0].hostname} (rank 0's host, which holds the rendezvous store) is unreachable" in line1, line1
