"""The ds_config resolver lets our optimizer run under ZeRO-Offload; the 2-rank
training of every shipped config is tests/integration/test_ds_configs_train.py."""
from __future__ import annotations

import json

import pytest

from scaletrain.config import load_config
from scaletrain.engine.preflight import preflight
from scaletrain.errors import ScaletrainError


def _resolve(ds_config):
    return preflight(load_config("small", [f"engine.ds_config={ds_config}"]), world_size=2)


@pytest.mark.parametrize("name", ["zero3_offload.json", "zero3_offload_optimizer.json"])
def test_optimizer_offload_accepts_our_optimizer(name):
    assert _resolve(name)["zero_force_ds_cpu_optimizer"] is False


def test_no_offload_leaves_the_flag_alone():
    assert "zero_force_ds_cpu_optimizer" not in _resolve("zero3.json")


def test_forcing_deepspeeds_cpu_optimizer_is_a_clear_error(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                             "zero_force_ds_cpu_optimizer": True}))
    with pytest.raises(ScaletrainError, match="zero_force_ds_cpu_optimizer.*remove the key"):
        _resolve(str(p))
