"""A 2-rank training (deepspeed launcher, CPU/gloo) that streams its shards from a real HTTP server on
127.0.0.1, end to end (train and validation streams; the batches equal the local directory's, see
tests/unit/test_data_url_shards.py)."""
from __future__ import annotations

import shutil

import pytest

from helpers import ten_step_run, tiny_model, two_rank_training
from shard_server import ShardServer


@pytest.mark.slow
def test_two_rank_training_streams_shards_from_http(django_shards, tmp_path):
    root = tmp_path / "www" / "shards"
    shutil.copytree(django_shards, root)
    out = tmp_path / "run"
    with ShardServer(root.parent) as srv:
        url = f"{srv.url}/shards"
        _, cfg, _, state = two_rank_training(out, "small", f"data.shards={url}", f"train.out_dir={out}",
                                             *ten_step_run(40, 600), *tiny_model(), "train.valid_every=5",
                                             "data.fetch_retries=3", tmp_path=tmp_path)
        assert srv.counter["ranges"] > 0  # the blocks arrived as HTTP range requests
    assert cfg.data.shards == url and state["world_size"] == 2 and len(state["valid_history"]) >= 2
