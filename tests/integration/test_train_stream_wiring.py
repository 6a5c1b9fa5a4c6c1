"""The trainer feeds the model from the stream the config describes (temperature, workers, vocabulary)."""
from __future__ import annotations

from collections import Counter

import pytest

from helpers import tiny_model
from scaletrain.config import load_config
from scaletrain.data.loader import ShardLoader
from scaletrain.data.stream import ShardStream

TINY = [
    *tiny_model(n_heads=4, dropout=None), "data.max_bytes=40", "data.max_tokens=1000", "train.resume=false",
    "tracking.enabled=false", "engine.ds_config=ds_configs/zero0.json",
]


pytestmark = pytest.mark.usefixtures("in_process_training")


def directions(batches):
    c = Counter()
    for b in batches:
        c.update(zip(b.src_lang.tolist(), b.tgt_lang.tolist()))
    return c


def test_trainer_stream_uses_temperature_and_workers_from_config(django_shards, tmp_path, isolated_env):
    from scaletrain.train import Trainer

    cfg = load_config("small", [f"data.shards={django_shards}", f"train.out_dir={tmp_path / 'r'}", *TINY,
                                "data.temperature=5", "data.num_workers=0", "data.seed=3"])
    trainer = Trainer(cfg)
    try:
        assert isinstance(trainer.stream, ShardLoader)
        it = iter(trainer.stream)
        got = [next(it) for _ in range(30)]
    finally:
        trainer.close()
    # the same batches as a stream built by hand with T=5, and not those of T=1
    kw = dict(seed=3, max_tokens=1000, max_bytes=40, buffer_size=cfg.data.buffer_size)
    hot = ShardStream(django_shards, "train", temperature=5, **kw)
    flat = ShardStream(django_shards, "train", temperature=1, **kw)
    want = [b for b, _ in zip(hot, range(30))]
    assert all((a.src == b.src).all() and (a.tgt_out == b.tgt_out).all() for a, b in zip(got, want))
    other = [b for b, _ in zip(flat, range(30))]
    assert directions(got) != directions(other)
