"""NaN/inf policy (``train.nonfinite``), in this process on the real engines (world of one):
a NaN loss at one step skips that update (parameters and LR schedule unchanged), is counted, and the step's
examples are written to OUT/nonfinite/; ``stop`` and ``max_nonfinite`` stop with one line. The 2-rank case
(NaN on one rank only) is ``test_nonfinite_two_ranks.py``."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import tiny_model
from scaletrain.checkpoint import load_model_weights
from scaletrain.config import load_config
from scaletrain.errors import ScaletrainError

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env")  # trains in this process

TINY = [*tiny_model(), "data.max_bytes=40", "data.max_tokens=600", "optim.lr=3e-3", "optim.warmup_steps=10",
        "train.log_every=1", "train.valid_every=0", "train.valid_max_batches=1", "train.save_every=1",
        "train.keep_last=0", "train.resume=false", "tracking.enabled=false", "engine.threads=1",
        "engine.precision=fp32"]


def nan_at(monkeypatch, steps, trainer):
    """Make the loss NaN at the given (1-based) updates."""
    real = trainer.unit.loss

    def loss(batch):
        loss_sum, nll_sum, ntok = real(batch)
        if trainer.state.step + 1 in steps:
            loss_sum = loss_sum * float("nan")
        return loss_sum, nll_sum, ntok

    monkeypatch.setattr(trainer.unit, "loss", loss)


def _trainer(shards, out, *over):
    from scaletrain.train import Trainer

    return Trainer(load_config("small", [*TINY, f"data.shards={shards}", f"train.out_dir={out}", *over]))


@pytest.mark.parametrize("backend", ["deepspeed", "accelerate"])
def test_nan_loss_skips_the_update_counts_it_and_names_the_examples(django_shards, tmp_path, monkeypatch, backend):
    tr = _trainer(django_shards, tmp_path, "train.max_steps=4", f"engine.backend={backend}")
    nan_at(monkeypatch, {3}, tr)
    lrs = []
    real_step = tr.engine.step
    monkeypatch.setattr(tr.engine, "step", lambda: (info := real_step(), lrs.append(info.lr))[0])
    res = tr.fit()
    tr.close()
    assert res.steps == 4 and tr.state.nonfinite_steps == 1 and tr.state.nonfinite_run == 0
    assert tr.state.skipped_steps == 0  # not an fp16 overflow
    ck = tmp_path / "checkpoints"
    w = {s: load_model_weights(ck / f"step-{s:07d}") for s in (1, 2, 3, 4)}
    assert all(torch.equal(w[2][k], w[3][k]) for k in w[2])  # update 3 was not applied
    assert any(not torch.equal(w[1][k], w[2][k]) for k in w[1]) and any(not torch.equal(w[3][k], w[4][k]) for k in w[3])
    assert all(torch.isfinite(v).all() for v in w[4].values() if v.is_floating_point())
    assert lrs[1] == lrs[2] < lrs[3]  # the warm-up schedule did not advance for the skipped update
    assert json.loads((ck / "step-0000004" / "trainer_state.json").read_text())["nonfinite_steps"] == 1
    (dump,) = (tmp_path / "nonfinite").glob("*.json")
    rec = json.loads(dump.read_text())
    assert dump.name == "step-0000003-rank00000.json" and rec["step"] == 3 and rec["rank"] == 0
    assert rec["update_skipped"] and not rec["loss_finite"]
    assert rec["stream_position_before_step"] is not None
    ex = rec["batches"][0]["examples"]
    assert ex and all(e["source"] and e["target"] and len(e["sha256"]) == 64 for e in ex)
    assert {e["src_lang"] for e in ex} <= set(tr.vocab.langs)


def test_stop_mode_stops_at_the_first_with_one_line(django_shards, tmp_path, monkeypatch):
    tr = _trainer(django_shards, tmp_path, "train.max_steps=6", "train.nonfinite=stop")
    nan_at(monkeypatch, {2}, tr)
    with pytest.raises(ScaletrainError, match=r"non-finite loss or gradient at step 2 \(train.nonfinite=stop\)"):
        tr.fit()
    tr.close("FAILED")
    assert tr.state.step == 2 and (tmp_path / "nonfinite" / "step-0000002-rank00000.json").is_file()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-0000001"


def test_skip_mode_stops_after_max_nonfinite_in_a_row(django_shards, tmp_path, monkeypatch):
    tr = _trainer(django_shards, tmp_path, "train.max_steps=8", "train.max_nonfinite=2")
    nan_at(monkeypatch, {2, 4, 5}, tr)  # 2 alone is skipped and training goes on; 4 and 5 in a row stop it
    with pytest.raises(ScaletrainError, match=r"2 non-finite updates in a row, the last at step 5 "
                                              r"\(train.max_nonfinite=2\)"):
        tr.fit()
    tr.close("FAILED")
    assert tr.state.nonfinite_steps == 3 and tr.state.step == 5
