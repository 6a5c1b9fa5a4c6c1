"""Out of device memory in a training step (``train.on_oom``), in this process on the real engines (world of
one): an injected ``torch.OutOfMemoryError`` in the forward of one micro-batch stops with one line naming the
batch and ``data.max_tokens`` and leaves the last checkpoint the newest; under ``skip`` that update is withheld
(parameters unchanged), counted in ``TrainState.oom_steps`` and training goes on."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from scaletrain.checkpoint import load_model_weights
from scaletrain.config import load_config
from scaletrain.errors import ScaletrainError
from scaletrain.oom import OomPolicy
from test_nonfinite import TINY

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env", "fresh_accelerate")  # in this process


def _trainer(shards, out, *over):
    from scaletrain.train import Trainer

    return Trainer(load_config("small", [*TINY, f"data.shards={shards}", f"train.out_dir={out}", "engine.grad_accum=2",
                                         "train.log_every=2", *over]))


def oom_at(monkeypatch, tr, step: int, micro: int):
    """The model runs out of memory in the forward of micro-batch ``micro`` (0-based) of update ``step``."""
    model = tr.engine.module
    real, calls, shapes = model.forward, [0], []

    def forward(src, tgt_in, **kw):
        calls[0] += 1
        if torch.is_grad_enabled() and tr.state.step + 1 == step and calls[0] == 2 * (step - 1) + micro + 1:
            shapes.append((tuple(src.shape), tuple(tgt_in.shape)))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real(src, tgt_in, **kw)

    monkeypatch.setattr(model, "forward", forward)
    return shapes


def test_stop_names_the_batch_and_keeps_the_last_checkpoint(django_shards, tmp_path, monkeypatch):
    tr = _trainer(django_shards, tmp_path, "train.max_steps=5")
    shapes = oom_at(monkeypatch, tr, 3, 1)
    with pytest.raises(ScaletrainError) as e:
        tr.fit()
    tr.close("FAILED")
    (src, tgt), = shapes
    msg = str(e.value)
    assert "\n" not in msg and "out of memory in micro-batch 2/2" in msg and "data.max_tokens=600" in msg
    assert f"{src[0]}x{src[1]} source -> {tgt[0]}x{tgt[1]} target" in msg and "train.on_oom=skip" in msg
    ck = tmp_path / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step-0000002" and not list(ck.glob("*.partial"))
    assert load_model_weights(ck / "step-0000002")


@pytest.mark.parametrize("backend", ["deepspeed", "accelerate"])
def test_skip_withholds_the_update_counts_it_and_trains_on(django_shards, tmp_path, monkeypatch, caplog, backend):
    tr = _trainer(django_shards, tmp_path, "train.max_steps=5", "train.on_oom=skip", f"engine.backend={backend}")
    oom_at(monkeypatch, tr, 3, 1)  # the second micro-batch: the first one's gradient must be dropped too
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        res = tr.fit()
    tr.close()
    assert res.steps == 5 and tr.state.oom_steps == 1 and tr.state.skipped_steps == 0 and tr.state.nonfinite_steps == 0
    ck = tmp_path / "checkpoints"
    w = {s: load_model_weights(ck / f"step-{s:07d}") for s in (2, 3, 4)}
    assert all(torch.equal(w[2][k], w[3][k]) for k in w[2])  # update 3 withheld, first micro-batch's gradient dropped
    assert any(not torch.equal(w[3][k], w[4][k]) for k in w[3])  # and the next one applied
    assert json.loads((ck / "step-0000005" / "trainer_state.json").read_text())["oom_steps"] == 1
    assert any("step 3 ran out of device memory" in r.getMessage() and "data.max_tokens=600" in r.getMessage()
               for r in caplog.records)
    assert tr.logger.loss_history and all(torch.isfinite(torch.tensor(v)) for _, v in tr.logger.loss_history)


def test_skip_is_refused_for_more_than_one_rank():
    with pytest.raises(ScaletrainError, match=r"train.on_oom=skip needs a single process \(this job has 2 ranks"):
        OomPolicy("skip", 600, world_size=2)
    OomPolicy("stop", 600, world_size=2)
