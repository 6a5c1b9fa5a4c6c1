"""Multi-node on one machine: two "nodes" of one rank each rendezvous on 127.0.0.1.

One `deepspeed` launcher per node with the hostfile, ``--no_ssh --node_rank K --master_addr 127.0.0.1``
(what launch.sh passes through). The nodes must end with identical parameters and must have read
disjoint examples (the stream splits blocks by global rank).
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from helpers import REPLAY_DRIVER, ROOT, free_port, launcher_env

from test_engine_replay import batch_pair_hashes



@pytest.mark.slow
def test_two_nodes_one_rank_each_stay_in_sync_and_read_disjoint_data(django_shards, tmp_path):
    from scaletrain.data.batch import collate
    from scaletrain.data.shards import read_split

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    env = launcher_env(tmp_path)
    port = str(free_port())
    job = [{"name": "two", "replay": False, "record": True, "overrides": ["train.max_steps=6", "engine.ds_config=zero1.json"]}]
    exe = str(Path(sys.executable).with_name("deepspeed"))
    procs = []
    for k in (0, 1):
        cmd = [exe, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(k), "--master_addr", "127.0.0.1",
               "--master_port", port, "--no_local_rank", REPLAY_DRIVER, str(tmp_path), str(django_shards),
               json.dumps(job)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
        assert p.returncode == 0, out[-4000:]
    assert "nnodes=2, num_local_procs=1, node_rank=0" in outs[0]
    assert "nnodes=2, num_local_procs=1, node_rank=1" in outs[1]
    res = [json.loads((tmp_path / "two" / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in res] == [2, 2] and [r["rank"] for r in res] == [0, 1]
    assert res[0]["steps"] == res[1]["steps"] == 6 and res[0]["train_loss"] == res[1]["train_loss"]
    p0 = torch.load(tmp_path / "two" / "params_rank0.pt")
    p1 = torch.load(tmp_path / "two" / "params_rank1.pt")
    for k in p0:
        assert torch.equal(p0[k], p1[k]), k
    # disjoint data: a pair seen by both nodes must be one that occurs more than once in the corpus
    seen0, seen1 = set(res[0]["seen"]), set(res[1]["seen"])
    assert len(seen0) > 20 and len(seen1) > 20
    max_bytes = 40  # TINY's data.max_bytes
    counts = Counter(h for ex in read_split(django_shards, "train") for h in batch_pair_hashes(collate([ex], max_bytes)))
    assert seen0 | seen1 <= set(counts)  # the hashes really are pairs of the corpus
    shared = seen0 & seen1
    assert all(counts[h] > 1 for h in shared), [h for h in shared if counts[h] == 1]
