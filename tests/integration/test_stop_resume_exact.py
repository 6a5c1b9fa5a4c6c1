"""A job stopped by a vote (a preemption signal; the wall-clock budget likewise) and resumed trains exactly what
an uninterrupted job trains: the batches drawn for the step that was voted away are not lost (the checkpoint
keeps the stream position from before them). In this process, DeepSpeed engine, world of one, dropout on."""
from __future__ import annotations

import signal

import pytest
import torch

from scaletrain.config import load_config
from test_nonfinite import TINY

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env")  # trains in this process


def _run(shards, out, steps, stop_before=None):
    from scaletrain.train import Trainer

    over = [*TINY, f"data.shards={shards}", f"train.out_dir={out}", f"train.max_steps={steps}", "train.resume=true",
            "train.save_every=0", "model.dropout=0.1"]
    tr = Trainer(load_config("small", over))
    if stop_before is not None:  # a SIGTERM arrives during update stop_before - 1: the vote stops before stop_before
        real = tr.logger.after_step

        def after_step(*a):
            real(*a)
            if tr.state.step == stop_before - 1:
                tr.preemption.signum = signal.SIGTERM
        tr.logger.after_step = after_step
    res = tr.fit()
    tr.close()
    return res, {k: v.detach().clone() for k, v in tr.engine.module.state_dict().items()}


def test_preempted_and_resumed_equals_uninterrupted(django_shards, tmp_path):
    _, want = _run(django_shards, tmp_path / "a", 6)
    res, _ = _run(django_shards, tmp_path / "b", 6, stop_before=4)
    assert res.preempted and res.steps == 3
    res2, got = _run(django_shards, tmp_path / "b", 6)
    assert res2.steps == 6 and not res2.preempted
    assert all(torch.equal(want[k], got[k]) for k in want)
