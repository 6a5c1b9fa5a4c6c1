"""The NaN/inf policy with the non-finite check on the device (``scaletrain/engine/optim.py``): between log
steps nothing is read; the fused AdamW withholds a non-finite update itself (and the LR schedule does not count
it, on the device), and the flag is read at the next log/save step, where the update is counted, its examples
dumped and the policy applied.
In this process, world of one; ``test_nonfinite.py`` covers the same policy read at every step."""
from __future__ import annotations

import json

import pytest
import torch

from scaletrain.checkpoint import load_model_weights
from scaletrain.errors import ScaletrainError
from test_nonfinite import _trainer, nan_at

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env", "fresh_accelerate")  # in this process


@pytest.mark.parametrize("backend,precision", [("deepspeed", "fp32"), ("deepspeed", "bf16"), ("accelerate", "bf16")])
def test_nan_between_log_steps_is_withheld_on_the_device_and_read_later(django_shards, tmp_path, monkeypatch,
                                                                        backend, precision):
    tr = _trainer(django_shards, tmp_path, "train.max_steps=6", "train.log_every=4", "train.save_every=2",
                  f"engine.backend={backend}", f"engine.precision={precision}")
    nan_at(monkeypatch, {3}, tr)
    infos, seen_at_step = [], {}
    real_step, real_settle = tr.engine.step, tr._settle
    monkeypatch.setattr(tr.engine, "step", lambda: (info := real_step(), infos.append(info))[0])

    def settle():
        seen_at_step.update({len(infos): [i.pending for i in infos]})
        real_settle()
    monkeypatch.setattr(tr, "_settle", settle)
    res = tr.fit()
    tr.close()
    assert res.steps == 6 and tr.state.nonfinite_steps == 1 and tr.state.skipped_steps == 0
    assert seen_at_step[4] == [False, False, True, True]  # update 3 was still on the device after it ran
    ck = tmp_path / "checkpoints"
    w = {s: load_model_weights(ck / f"step-{s:07d}") for s in (2, 4)}
    w3 = load_model_weights(ck / "step-0000006")
    assert any(not torch.equal(w[2][k], w[4][k]) for k in w[2]) and all(torch.isfinite(v).all() for v in w3.values())
    # 5 updates applied: the warm-up schedule and AdamW's step count did not advance for the withheld one
    sched = tr.engine.schedule
    assert sched.state_dict() == {"applied": 5} and infos[-1].lr == pytest.approx(3e-3 * 6 / 10)
    opt = tr.engine.optimizer
    assert {float(s["step"]) for s in opt.state.values()} == {5.0}
    (dump,) = (tmp_path / "nonfinite").glob("*.json")
    rec = json.loads(dump.read_text())
    assert dump.name == "step-0000003-rank00000.json" and rec["step"] == 3 and rec["update_skipped"]


def test_stop_mode_stops_at_the_next_read_before_any_checkpoint(django_shards, tmp_path, monkeypatch):
    tr = _trainer(django_shards, tmp_path, "train.max_steps=8", "train.log_every=4", "train.save_every=4",
                  "train.nonfinite=stop")
    nan_at(monkeypatch, {2}, tr)
    with pytest.raises(ScaletrainError, match=r"non-finite loss or gradient at step 2 \(train.nonfinite=stop\)"):
        tr.fit()
    tr.close("FAILED")
    assert tr.state.step == 4 and (tmp_path / "nonfinite" / "step-0000002-rank00000.json").is_file()
    assert not (tmp_path / "checkpoints" / "latest").exists()  # no checkpoint after the non-finite update
