"""The DeepSpeed settings that keep a step from waiting for the device (``ds_config._sync_free``,
``runtime_ds_config``): the throughput timer off unless the user turns it on, bf16 ZeRO-1/2 without DeepSpeed's
host overflow check, bf16 at ZeRO-0 as torch autocast (fp32 weights, no unfused optimizer)."""
from __future__ import annotations

import json

import pytest

from scaletrain.config import load_config
from scaletrain.engine.ds_config import load_ds_config, runtime_ds_config
from scaletrain.errors import ScaletrainError


def _ds(tmp_path, content, *over):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(content))
    return load_ds_config(load_config("small", [f"engine.ds_config={p}", *over]), world_size=1)


def test_throughput_timer_off_by_default_and_the_users_choice_kept(tmp_path):
    assert _ds(tmp_path, {})["timers"]["throughput"]["enabled"] is False
    ds = _ds(tmp_path, {"timers": {"throughput": {"enabled": True, "synchronized": False}}})
    assert ds["timers"]["throughput"] == {"enabled": True, "synchronized": False}
    with pytest.raises(ScaletrainError, match="'timers' must be an object"):
        _ds(tmp_path, {"timers": 3})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_per_stage(tmp_path, stage):
    ds = _ds(tmp_path, {"zero_optimization": {"stage": stage}}, "engine.precision=bf16")
    assert ds["bf16"]["enabled"] is True  # the resolved config says what the user asked for
    assert ds["bf16"].get("check_grad_overflow") is (False if stage in (1, 2) else None)
    run = runtime_ds_config(ds)
    if stage == 0:  # DeepSpeed gets fp32 weights and autocast instead of its unfused bf16 optimizer
        assert run["bf16"]["enabled"] is False and run["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    else:
        assert run == ds
    assert ds["bf16"]["enabled"] is True  # not changed in place


def test_user_overflow_check_and_autocast_options(tmp_path):
    ds = _ds(tmp_path, {"zero_optimization": {"stage": 2}, "bf16": {"check_grad_overflow": True}}, "engine.precision=bf16")
    assert ds["bf16"]["check_grad_overflow"] is True
    mods = ["torch.nn.modules.linear.Linear"]
    ds = _ds(tmp_path, {"torch_autocast": {"lower_precision_safe_modules": mods}}, "engine.precision=bf16")
    assert runtime_ds_config(ds)["torch_autocast"]["lower_precision_safe_modules"] == mods
    assert runtime_ds_config(_ds(tmp_path, {"torch_autocast": {"lower_precision_safe_modules": mods}},
                                 "engine.precision=fp32"))["torch_autocast"]["enabled"] is False
    with pytest.raises(ScaletrainError, match=r"'torch_autocast.enabled' is True.*engine.precision=bf16 at ZeRO-0"):
        _ds(tmp_path, {"torch_autocast": {"enabled": True}}, "engine.precision=fp32")
