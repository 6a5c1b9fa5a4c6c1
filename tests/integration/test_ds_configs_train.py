"""Every shipped DeepSpeed config trains on 2 CPU ranks.

The ZeRO-Offload configs (``zero3_offload.json``, ``zero3_offload_optimizer.json``) used to stop at start
with "ZeRO-Offload with a client provided optimizer"; the ds_config resolver now sets
``zero_force_ds_cpu_optimizer: false`` for them so our AdamW runs on the offloaded fp32 partitions.
One ``deepspeed`` launch trains a few steps with each config on the same fixed batches (the replay
driver), so every config must also follow ZeRO-0's loss trajectory. ``fp16.json`` runs with
engine.precision=fp32 here (fp16 needs a GPU; its ``enabled: auto`` follows engine.precision).
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import REPLAY_DRIVER, ROOT, deepspeed_cmd, launcher_env, run

CONFIGS = sorted(p.stem for p in (ROOT / "ds_configs").glob("*.json"))
STEPS = 3


@pytest.mark.slow
def test_every_shipped_ds_config_trains_on_two_cpu_ranks(django_shards, tmp_path):
    assert {"zero3_offload", "zero3_offload_optimizer"} <= set(CONFIGS)
    driver = REPLAY_DRIVER
    jobs = [{"name": c, "overrides": [f"engine.ds_config={c}.json", f"train.max_steps={STEPS}"]} for c in CONFIGS]
    run(deepspeed_cmd(2, driver, str(tmp_path), str(django_shards), json.dumps(jobs)), launcher_env(tmp_path))
    ref = json.loads((tmp_path / "zero0" / "result_rank0.json").read_text())["train_loss"]
    for c in CONFIGS:
        res = [json.loads((tmp_path / c / f"result_rank{r}.json").read_text()) for r in (0, 1)]
        assert [r["steps"] for r in res] == [STEPS, STEPS] and [r["world_size"] for r in res] == [2, 2], c
        losses = [v for _, v in res[0]["train_loss"]]
        assert all(math.isfinite(v) for v in losses), (c, losses)
        assert losses == pytest.approx([v for _, v in ref], rel=1e-4), c  # same batches, same maths as ZeRO-0
        p0, p1 = (torch.load(tmp_path / c / f"params_rank{r}.pt") for r in (0, 1))
        assert all(torch.equal(p0[k], p1[k]) for k in p0), c
        assert (tmp_path / c / "checkpoints" / f"step-{STEPS:07d}" / "index.json").is_file(), c
