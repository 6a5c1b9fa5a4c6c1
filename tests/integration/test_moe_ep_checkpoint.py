"""Checkpoints under expert parallelism (moe.ep_size=2, 2 gloo ranks, DeepSpeed ZeRO-0 and ZeRO-2 and
Accelerate DDP, dropout on): N updates, stop, resume, N more == 2N uninterrupted updates, bitwise (each rank's
experts and their Adam state come back from its own shard file; under ZeRO-2 the Adam state is in
each rank's own ZeRO partition file); ``scaletrain export`` stacks the
shards into one file that a single-process model loads and gives the trained model's loss; a resume
with another ep_size reshards the experts and their Adam state (ZeRO-0, DDP; replayed batches: it
follows the uninterrupted run) or, under ZeRO-1/2, fails with one line naming both sizes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers import assert_resume_bitwise, deepspeed_cmd, free_port, launcher_env, run

N = 3
DRIVER = "tests/integration/ep_driver.py"
MOE = ["model.dropout=0.1", "moe.num_experts=4", "moe.every=1", "moe.ffn_dim=32", "moe.ep_size=2",
       "engine.precision=fp32"]
ENGINES = {"ds": ["engine.ds_config=zero0.json"], "z2": ["engine.ds_config=zero2.json", "optim.clip_norm=0"],
           "ddp": ["engine.backend=accelerate", "engine.accelerate=ddp"]}


def _jobs(engine: str) -> list[dict]:
    o = [*MOE, *ENGINES[engine]]
    return [{"name": f"{engine}_full", "replay": False, "overrides": [f"train.max_steps={2 * N}", *o]},
            {"name": f"{engine}_half", "replay": False, "overrides": [f"train.max_steps={N}", *o]},
            {"name": f"{engine}_half", "replay": False, "overrides": [f"train.max_steps={2 * N}", *o]}]


def _reshard_jobs(engine: str, first: int, then: int) -> list[list[dict]]:
    """Replayed fixed batches, no dropout: 2N updates at ep_size=1, and N at ``first`` then N more at
    ``then`` (the resume reshards the experts and their Adam state)."""
    o = ["engine.precision=fp32", "moe.num_experts=4", "moe.every=1", "moe.ffn_dim=32", *ENGINES[engine]]
    name = f"{engine}_rs{first}{then}"
    return [[{"name": f"{engine}_rs_ref", "overrides": [*o, f"train.max_steps={2 * N}"]}],
            [{"name": name, "overrides": [*o, f"moe.ep_size={first}", f"train.max_steps={N}"]}],
            [{"name": name, "overrides": [*o, f"moe.ep_size={then}", f"train.max_steps={2 * N}"]}]]


@pytest.fixture(scope="module")
def runs(django_shards, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("epck")
    env = launcher_env(out)
    sh = str(django_shards)
    reshard = [j for jobs in _reshard_jobs("ds", 2, 1) + _reshard_jobs("ds", 1, 2)[1:] for j in jobs]
    run(deepspeed_cmd(2, DRIVER, str(out), sh, json.dumps(_jobs("ds") + _jobs("z2") + reshard)), env)
    acc = Path(sys.executable).with_name("accelerate")
    for job in [[j] for j in _jobs("ddp")] + _reshard_jobs("ddp", 1, 2):  # a fresh process each
        run([str(acc), "launch", "--config_file", "ds_configs/accelerate_ddp.yaml", "--num_processes", "2",
             "--main_process_port", str(free_port()), DRIVER, str(out), sh, json.dumps(job)], env)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
def test_ep2_resume_is_bitwise_identical(runs, engine):
    ck = runs / f"{engine}_half" / "checkpoints" / f"step-{N:07d}"
    assert sorted(p.name for p in ck.glob("expert_shard_ep*.pt")) == [
        "expert_shard_ep000_of_002.pt", "expert_shard_ep001_of_002.pt"]
    assert any(".ffn.experts.w1" in k for k in torch.load(runs / f"{engine}_full" / "params_rank0.pt"))
    assert_resume_bitwise(runs, engine, N)


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
def test_export_of_ep2_checkpoint_loads_in_one_process(runs, engine, django_shards, tmp_path):
    from safetensors.torch import load_file

    from scaletrain.checkpoint import load_exported
    from test_engine_replay import fixed_batch_loss, fixed_batches

    out = tmp_path / "model.safetensors"
    p = run([sys.executable, "-m", "scaletrain", "export", str(runs / f"{engine}_full"), "--out", str(out)],
            launcher_env(tmp_path))
    assert "wrote" in p.stdout
    trained = torch.load(runs / f"{engine}_full" / "params_rank0.pt")  # consolidated by the engine
    exported = load_file(str(out))
    assert exported.keys() == trained.keys()
    for k in trained:
        assert torch.equal(exported[k].float(), trained[k]), k
    model, cfg, *_ = load_exported(out)
    assert model.encoder_layers[0].ffn.experts.w1.shape[0] == 4  # every expert, one process
    res = json.loads((runs / f"{engine}_full" / "result_rank0.json").read_text())
    batch = fixed_batches(django_shards, 1)[0]  # test_engine_replay's probe batch
    assert fixed_batch_loss(model, batch, cfg.optim.label_smoothing) == pytest.approx(res["probe_loss"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ds_rs21", "ds_rs12", "ddp_rs12"])
def test_resume_with_another_ep_size_reshards(runs, name):
    """N updates at one ep_size, resume at the other: the second half follows the uninterrupted ep_size=1
    run within fp32 round-off (the experts and their Adam moments were cut for the new layout)."""
    ref = json.loads((runs / f"{name[:-5]}_rs_ref" / "result_rank0.json").read_text())
    got = json.loads((runs / name / "result_rank0.json").read_text())
    a, b = [v for _, v in ref["train_loss"][N:]], [v for _, v in got["train_loss"]]
    assert len(a) == len(b) == N and max(abs(x - y) / abs(x) for x, y in zip(a, b)) < 1e-4, (a, b)
    p, q = (torch.load(runs / n / "params_rank0.pt") for n in (f"{name[:-5]}_rs_ref", name))
    num = sum(float(((p[k] - q[k]) ** 2).sum()) for k in p)
    assert (num / sum(float((p[k] ** 2).sum()) for k in p)) ** 0.5 < 1e-3


@pytest.mark.slow
def test_zero2_resume_with_another_ep_size_fails_in_one_line(runs):
    from scaletrain.errors import ScaletrainError
    from scaletrain.models import build_model
    from scaletrain.models.config import ModelConfig, MoEConfig
    from scaletrain.checkpoint.experts import expert_checkpoint_load, saved_ep_size

    CFG = ModelConfig(d_model=16, n_heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=24, dropout=0.0)

    ck = runs / "z2_half" / "checkpoints" / f"step-{2 * N:07d}"
    assert saved_ep_size(ck) == 2
    model = build_model(CFG, 260, moe=MoEConfig(num_experts=4, every=1, ffn_dim=32))
    with pytest.raises(ScaletrainError) as e:
        with expert_checkpoint_load(ck, model, None, model.encoder_layers[0].ffn.parallel, reshard=False):
            pass
    msg = str(e.value)
    assert "moe.ep_size=2" in msg and "moe.ep_size=1" in msg and "ZeRO-1/2" in msg and "\n" not in msg
