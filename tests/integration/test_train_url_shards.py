"""A 2-rank training (deepspeed launcher, CPU/gloo) that streams its shards from a real HTTP server on
127.0.0.1, end to end (train and validation streams; the batches equal the local directory's, see
tests/unit/test_data_url_shards.py), with one corrupt train block skipped (``data.on_corrupt=skip``):
both ranks still take every step together."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import DIST_DRIVER, deepspeed_cmd, launcher_env, run, ten_step_run, tiny_model
from shard_server import ShardServer

from scaletrain.config import load_config
from scaletrain.data.stream import ShardStream


def flip_first_block_of_rank1(root):
    """Flip bytes in the text of rank 1's first block of the first window (the training reads it at once)."""
    seed = load_config("small").data.seed
    st = ShardStream(root, "train", rank=1, world_size=2, buffer_size=4, seed=seed, max_tokens=600, max_bytes=40)
    sh, b = st.block(st.planner.slot_blocks(0, 0)[1][0])
    raw = bytearray((root / sh.name).read_bytes())
    for i in range(b.offset + b.size - 32, b.offset + b.size):
        raw[i] ^= 0x5A
    (root / sh.name).write_bytes(bytes(raw))
    return sh, b


@pytest.mark.slow
def test_two_rank_training_streams_shards_from_http(django_shards, tmp_path):
    root = tmp_path / "www" / "shards"
    shutil.copytree(django_shards, root)
    sh, b = flip_first_block_of_rank1(root)
    out = tmp_path / "run"
    out.mkdir()
    with ShardServer(root.parent) as srv:
        url = f"{srv.url}/shards"
        args = [str(out), "small", f"data.shards={url}", f"train.out_dir={out}", *ten_step_run(40, 600),
                *tiny_model(), "train.valid_every=5", "data.fetch_retries=3", "data.on_corrupt=skip",
                "data.buffer_size=4", "data.num_workers=0"]  # the planted block is rank 1's in the 1-slot-per-rank layout
        p = run(deepspeed_cmd(2, DIST_DRIVER, *args), launcher_env(tmp_path))
        assert srv.counter["ranges"] > 0  # the blocks arrived as HTTP range requests
    res = [json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in res] == [2, 2] and res[0]["steps"] == res[1]["steps"] == 10
    assert len(res[0]["valid_nll"]) >= 2 and res[0]["train_loss"][-1][1] < res[0]["train_loss"][0][1]
    p0, p1 = torch.load(out / "params_rank0.pt"), torch.load(out / "params_rank1.pt")
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    log = p.stdout + p.stderr
    assert f"{url}/{sh.name} member {b.key}.pairs: checksum mismatch" in log  # the skip is logged, naming it
    assert "rank 1 skipped 1 corrupt shard block(s)" in log and "rank 0 skipped" not in log
