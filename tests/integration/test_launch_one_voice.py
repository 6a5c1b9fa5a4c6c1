"""One voice per job: ``./launch.sh --no_ssh --node_rank K`` on two "hosts" (loopback, a hostfile, one rank
each): node 0 prints the end-of-job summary and the commands to try next; node 1 prints one line."""
from __future__ import annotations

import os
import subprocess
import time

from helpers import free_port, launch_checkout, tiny_model


def test_only_node_0_prints_the_summary_and_next_commands(tmp_path, django_shards):
    checkout = launch_checkout(tmp_path)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    out = tmp_path / "run"
    env = dict(os.environ)
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlruns.db", MPLCONFIGDIR=str(tmp_path / "mpl"),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    overrides = [f"data.shards={django_shards}", *tiny_model(), "data.max_tokens=600", "data.max_bytes=60",
                 "train.max_steps=2", "train.log_every=1", "train.valid_every=0", "train.valid_max_batches=1",
                 "train.save_every=0", "optim.warmup_steps=1", "tracking.system_metrics=false"]
    port = str(free_port())
    t0 = time.time()
    procs = [subprocess.Popen(["bash", str(checkout / "launch.sh"), "--nproc", "1", "--hostfile", str(hostfile),
                               "--num_nodes", "2", "--no_ssh", "--node_rank", str(k), "--master_addr", "127.0.0.1",
                               "--master_port", port, "--out", str(out), "--no-eval", *overrides],
                              cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for k in (0, 1)]
    texts = []
    try:
        for p in procs:
            texts.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    print(f"two launch.sh nodes: {time.time() - t0:.1f} s")
    assert [p.returncode for p in procs] == [0, 0], texts[0][-3000:] + texts[1][-3000:]
    node0, node1 = texts
    assert "trained 2 steps" in node0 and "== next: try these on this run" in node0 and "== training took" in node0
    assert "== next" not in node1 and "trained 2 steps" not in node1 and "== training took" not in node1
    done = [ln for ln in node1.splitlines() if "training done" in ln]
    assert done == [f"== {os.uname().nodename} (node 1): training done; the summary and the commands to try next "
                    "are on node 0"], node1[-3000:]
