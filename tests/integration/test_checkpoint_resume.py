"""Exact resume: 2N uninterrupted updates == N, stop, relaunch, resume, N more -- bitwise, 2 ranks.

Real shard stream (its state is in the checkpoint), dropout on (the RNG states are in the checkpoint),
ZeRO-2 (partitioned optimizer states), CPU/gloo under the `deepspeed` launcher. The resumed half runs
in a fresh launch, so nothing survives in memory between the halves.
"""
from __future__ import annotations

import json

import pytest
import torch

from helpers import REPLAY_DRIVER, deepspeed_cmd, launcher_env, run

N = 6
COMMON = ["model.dropout=0.1", "engine.ds_config=zero2.json", "optim.warmup_steps=4"]


@pytest.mark.slow
def test_resume_is_bitwise_identical_two_ranks(django_shards, tmp_path):
    env = launcher_env(tmp_path)
    sh = str(django_shards)
    first = [
        {"name": "full", "replay": False, "overrides": [f"train.max_steps={2 * N}", *COMMON]},
        {"name": "half", "replay": False, "overrides": [f"train.max_steps={N}", *COMMON]},
    ]
    run(deepspeed_cmd(2, REPLAY_DRIVER, str(tmp_path), sh, json.dumps(first)), env)
    ck = tmp_path / "half" / "checkpoints"
    assert (ck / "latest").read_text().strip() == f"step-{N:07d}"
    before = torch.load(tmp_path / "half" / "params_rank0.pt")
    second = [{"name": "half", "replay": False, "overrides": [f"train.max_steps={2 * N}", *COMMON]}]
    p = run(deepspeed_cmd(2, REPLAY_DRIVER, str(tmp_path), sh, json.dumps(second)), env)
    assert f"resumed from {ck / f'step-{N:07d}'} at step {N}" in p.stdout
    full = [json.loads((tmp_path / "full" / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    res = [json.loads((tmp_path / "half" / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    assert res[0]["steps"] == full[0]["steps"] == 2 * N
    assert res[0]["tokens"] == full[0]["tokens"]
    # the resumed run logged steps N+1..2N with exactly the uninterrupted run's losses
    assert res[0]["train_loss"] == full[0]["train_loss"][N:]
    for r in (0, 1):
        a = torch.load(tmp_path / "full" / f"params_rank{r}.pt")
        b = torch.load(tmp_path / "half" / f"params_rank{r}.pt")
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (r, k)
    # and training did move between the halves (the comparison is not trivially true)
    assert any(not torch.equal(before[k], b[k]) for k in b)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "deepspeed"])
def test_resume_is_bitwise_identical_accelerate_one_process(django_shards, tmp_path, mode):
    """The Accelerate engine's own save/load (DDP: save_state/load_state; DeepSpeed plugin: engine
    checkpoint + our LR schedule) resumes exactly too (one plain process each, cheap)."""
    import sys

    env = launcher_env(tmp_path)
    sh = str(django_shards)
    common = [*COMMON, "engine.backend=accelerate", f"engine.accelerate={mode}"]
    first = [
        {"name": "full", "replay": False, "overrides": [f"train.max_steps={2 * N}", *common]},
        {"name": "half", "replay": False, "overrides": [f"train.max_steps={N}", *common]},
    ]
    second = [{"name": "half", "replay": False, "overrides": [f"train.max_steps={2 * N}", *common]}]
    for jobs in ([first[0]], [first[1]], second):  # a fresh process each: Accelerate state is per process
        run([sys.executable, REPLAY_DRIVER, str(tmp_path), sh, json.dumps(jobs)], env)
    a = torch.load(tmp_path / "full" / "params_rank0.pt")
    b = torch.load(tmp_path / "half" / "params_rank0.pt")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    full = json.loads((tmp_path / "full" / "result_rank0.json").read_text())
    res = json.loads((tmp_path / "half" / "result_rank0.json").read_text())
    assert res["engine"] == f"accelerate/{mode}" and res["train_loss"] == full["train_loss"][N:]
    ck = tmp_path / "half" / "checkpoints" / f"step-{2 * N:07d}"
    assert (ck / ("model.safetensors" if mode == "ddp" else "mp_rank_00_model_states.pt")).is_file()
    assert json.loads((ck / "engine.json").read_text())["schedule"] == {"applied": 2 * N}  # the LR schedule's position
