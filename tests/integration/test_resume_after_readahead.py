"""Exact resume from a checkpoint written while the next step's batches were already read (the loop reads one
step ahead, ``scaletrain/train/prefetch.py``): the checkpoint stores the stream position before those batches,
so a job resumed from it trains exactly what the uninterrupted job trained. In this process, DeepSpeed engine,
world of one, dropout on."""
from __future__ import annotations

import shutil

import pytest
import torch

from scaletrain.config import load_config
from test_nonfinite import TINY

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env")  # trains in this process


def _run(shards, out):
    from scaletrain.train import Trainer

    over = [*TINY, f"data.shards={shards}", f"train.out_dir={out}", "train.max_steps=6", "train.resume=true",
            "train.save_every=3", "train.log_every=2", "model.dropout=0.1"]
    tr = Trainer(load_config("small", over))
    res = tr.fit()
    tr.close()
    return res, {k: v.detach().clone() for k, v in tr.engine.module.state_dict().items()}


def test_resume_from_a_mid_run_checkpoint_equals_uninterrupted(django_shards, tmp_path):
    res_a, want = _run(django_shards, tmp_path / "a")
    assert res_a.steps == 6
    b = tmp_path / "b"
    shutil.copytree(tmp_path / "a", b)
    shutil.rmtree(b / "checkpoints" / "step-0000006")
    (b / "checkpoints" / "latest").write_text("step-0000003")
    res_b, got = _run(django_shards, b)
    assert res_b.steps == 6 and res_b.train_loss[-1] == res_a.train_loss[-1]  # the log of updates 5-6
    assert all(torch.equal(want[k], got[k]) for k in want)
