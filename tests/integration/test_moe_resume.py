"""A MoE-FFN model (moe.ep_size=1) resumes exactly: N updates, stop, relaunch, N more == 2N
uninterrupted updates, bitwise (Accelerate DDP engine, one plain process per launch, dropout on)."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from helpers import REPLAY_DRIVER, launcher_env, run

N = 3
MOE = ["model.dropout=0.1", "optim.warmup_steps=4", "engine.backend=accelerate", "engine.accelerate=ddp",
       "model.encoder_layers=2", "model.decoder_layers=2", "moe.num_experts=4", "moe.every=2", "moe.ffn_dim=32",
       "moe.shared_expert=true"]


@pytest.mark.slow
def test_moe_resume_is_bitwise_identical(django_shards, tmp_path):
    driver = REPLAY_DRIVER  # relative to the repository root, the working directory of ``run``
    env = launcher_env(tmp_path)
    jobs = [
        [{"name": "full", "replay": False, "overrides": [f"train.max_steps={2 * N}", *MOE]}],
        [{"name": "half", "replay": False, "overrides": [f"train.max_steps={N}", *MOE]}],
        [{"name": "half", "replay": False, "overrides": [f"train.max_steps={2 * N}", *MOE]}],
    ]
    for j in jobs:  # a fresh process each: Accelerate state is per process
        run([sys.executable, driver, str(tmp_path), str(django_shards), json.dumps(j)], env)
    a = torch.load(tmp_path / "full" / "params_rank0.pt")
    b = torch.load(tmp_path / "half" / "params_rank0.pt")
    assert any(".ffn.experts.w1" in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    full = json.loads((tmp_path / "full" / "result_rank0.json").read_text())
    res = json.loads((tmp_path / "half" / "result_rank0.json").read_text())
    assert res["train_loss"] == full["train_loss"][N:]
