"""A NaN loss on one rank of 2: both ranks skip that update (no rank steps while the other
skips: their parameters stay identical and equal to the previous step's), both count it, and the NaN rank's
examples are named in OUT/nonfinite/. In bf16 at ZeRO-1 and ZeRO-2 (an inf planted) the update is withheld on the device
from the norm DeepSpeed's ZeRO optimizer computes, with its own overflow check off: the path that rests on
DeepSpeed turning its -1 "invalid norm" marker into inf (``scaletrain/engine/deepspeed_internals.py``)."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import ROOT, deepspeed_cmd, launcher_env, run
from scaletrain.checkpoint import load_model_weights
from test_nonfinite import TINY


@pytest.mark.slow
@pytest.mark.parametrize("ds_config,precision,value", [
    ("zero0", "fp32", "nan"),
    ("zero2", "fp32", "nan"),  # DeepSpeed's own global-norm check skips
    ("zero1", "bf16", "inf"),  # the same at ZeRO-1 (its optimizer is ZeRO-2's, gradients not partitioned)
    ("zero2", "bf16", "inf"),  # withheld on the device (ZeroNormHook): DeepSpeed's check is off in bf16
])
def test_nan_on_one_rank_skips_the_update_on_both(django_shards, tmp_path, ds_config, precision, value):
    out = tmp_path / "run"
    out.mkdir()
    env = {**launcher_env(tmp_path), "NAN_RANK": "1", "NAN_STEP": "3", "NAN_VALUE": value}
    cmd = deepspeed_cmd(2, "tests/integration/nonfinite_driver.py", str(out), "small", *TINY,
                        f"data.shards={django_shards}", f"train.out_dir={out}", "train.max_steps=4",
                        f"engine.ds_config=ds_configs/{ds_config}.json", f"engine.precision={precision}")
    run(cmd, env, cwd=ROOT)
    res = [json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    assert res[0]["steps"] == res[1]["steps"] == 4
    p0, p1 = torch.load(out / "params_rank0.pt"), torch.load(out / "params_rank1.pt")
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    ck = out / "checkpoints"
    w2, w3, w4 = (load_model_weights(ck / f"step-{s:07d}") for s in (2, 3, 4))
    assert all(torch.equal(w2[k], w3[k]) for k in w2)  # update 3 applied on neither rank
    assert any(not torch.equal(w3[k], w4[k]) for k in w3)
    assert json.loads((ck / "step-0000004" / "trainer_state.json").read_text())["nonfinite_steps"] == 1
    dumps = {p.name: json.loads(p.read_text()) for p in (out / "nonfinite").glob("*.json")}
    assert set(dumps) == {"step-0000003-rank00000.json", "step-0000003-rank00001.json"}
    assert not dumps["step-0000003-rank00001.json"]["loss_finite"]  # the rank that planted the NaN
    assert dumps["step-0000003-rank00000.json"]["loss_finite"]  # its own loss was fine; it skipped too
    assert all(d["update_skipped"] for d in dumps.values())
