"""Engine configuration checked before any process starts, and the scale knobs (fast, in-process)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, tiny_model
from scaletrain.config import load_config
from scaletrain.engine.model_prep import prepare_model
from scaletrain.engine.preflight import preflight
from scaletrain.errors import ScaletrainError

TINY = [*tiny_model(layers=2, dropout=None), "data.max_bytes=40", "data.max_tokens=600"]


def cfg_with(*overrides):
    return load_config("small", [*TINY, *overrides])


def write_json(tmp_path, obj, name="ds.json"):
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return str(p)


def test_fp16_without_gpu_is_refused_with_the_key_named():
    with pytest.raises(ScaletrainError, match=r"engine.precision.*fp16 needs a GPU.*bf16"):
        preflight(cfg_with("engine.precision=fp16"), cuda_available=False)
    ds = preflight(cfg_with("engine.precision=fp16", "engine.ds_config=fp16.json"), world_size=4, cuda_available=True)
    assert ds["fp16"]["enabled"] is True and ds["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    assert ds["bf16"]["enabled"] is False


def test_invalid_zero_stage(tmp_path):
    path = write_json(tmp_path, {"zero_optimization": {"stage": 4}})
    with pytest.raises(ScaletrainError, match=r"ds\.json: zero_optimization.stage must be 0, 1, 2 or 3, got 4"):
        preflight(cfg_with(f"engine.ds_config={path}"))


def test_missing_ds_config_lists_the_available_ones():
    with pytest.raises(ScaletrainError, match=r"nope.json not found.*zero3_offload.json"):
        preflight(cfg_with("engine.ds_config=nope.json"))
    # plain DDP under Accelerate needs no DeepSpeed JSON at all
    assert preflight(cfg_with("engine.backend=accelerate", "engine.ds_config=nope.json")) is None
    with pytest.raises(ScaletrainError, match="not found"):
        preflight(cfg_with("engine.backend=accelerate", "engine.accelerate=deepspeed", "engine.ds_config=nope.json"))


def test_trainer_owned_values_fill_and_conflicts_name_both(tmp_path):
    ds = preflight(cfg_with("engine.grad_accum=3", "optim.clip_norm=0.5"), world_size=4)
    assert ds["gradient_accumulation_steps"] == 3 and ds["train_batch_size"] == 12
    assert ds["train_micro_batch_size_per_gpu"] == 1 and ds["gradient_clipping"] == 0.5
    path = write_json(tmp_path, {"train_batch_size": 16, "zero_optimization": {"stage": 1}})
    with pytest.raises(ScaletrainError, match=r"'train_batch_size' is 16 but scaletrain sets it to 12.*engine.grad_accum"):
        preflight(cfg_with(f"engine.ds_config={path}", "engine.grad_accum=3"), world_size=4)
    path = write_json(tmp_path, {"bf16": {"enabled": True}}, "b.json")
    with pytest.raises(ScaletrainError, match=r"bf16.enabled.*engine.precision is 'fp32'"):
        preflight(cfg_with(f"engine.ds_config={path}"))
    path = write_json(tmp_path, {"optimizer": {"type": "Adam"}}, "o.json")
    with pytest.raises(ScaletrainError, match="owned by scaletrain"):
        preflight(cfg_with(f"engine.ds_config={path}"))


def test_shipped_ds_configs_all_resolve():
    for name in ("zero0", "zero1", "zero2", "zero3", "zero3_offload", "zero3_offload_optimizer"):
        ds = preflight(cfg_with(f"engine.ds_config={name}.json", "engine.precision=bf16"), world_size=2)
        assert ds["zero_optimization"]["stage"] == int(name[4]) and ds["bf16"]["enabled"] is True


def test_unknown_accelerate_mode_is_a_config_error():
    with pytest.raises(ScaletrainError, match=r"engine.accelerate.*ddp or deepspeed"):
        cfg_with("engine.accelerate=fsdp")


def test_preflight_cli_exits_2_with_one_line():
    p = subprocess.run([sys.executable, "-m", "scaletrain.engine.preflight", "--config", "small", "engine.precision=fp16"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    if torch.cuda.is_available():
        assert p.returncode == 0
    else:
        assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "fp16 needs a GPU" in p.stderr


def test_accelerate_launch_config_must_agree_with_engine_config(monkeypatch):
    from scaletrain.engine import build_engine

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ScaletrainError, match=r"DEEPSPEED.*engine.accelerate is 'ddp'"):
        build_engine(cfg_with("engine.backend=accelerate"))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ROOT / "ds_configs" / "zero3.json"))
    with pytest.raises(ScaletrainError, match=r"deepspeed_config_file .*zero3.json but engine.ds_config is .*zero1.json"):
        build_engine(cfg_with("engine.backend=accelerate", "engine.accelerate=deepspeed", "engine.ds_config=zero1.json"))


def _tiny_model(cfg):
    from scaletrain.models import build_model

    torch.manual_seed(0)
    return build_model(cfg.model, 300)


def _loss_and_grads(model, seed=1):
    torch.manual_seed(seed)
    src = torch.randint(4, 260, (3, 11))
    tgt = torch.randint(4, 260, (3, 9))
    model.train()
    model.zero_grad()
    torch.manual_seed(seed + 1)  # same dropout masks
    loss = model(src, tgt).float().logsumexp(-1).mean()
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"  # every parameter is reached
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_same_maths_and_recomputes():
    plain = _tiny_model(cfg_with("model.dropout=0.1"))
    ckpt_cfg = cfg_with("model.dropout=0.1", "engine.activation_checkpointing=true")
    ck = prepare_model(_tiny_model(ckpt_cfg), ckpt_cfg)
    calls = []
    ck.encoder_layers[0].ffn.register_forward_hook(lambda *a: calls.append(1))
    l1, g1 = _loss_and_grads(plain)
    l2, g2 = _loss_and_grads(ck)
    assert len(calls) == 2  # forward once, recomputed once in backward
    assert l1 == pytest.approx(l2, rel=1e-6) and g1.keys() == g2.keys()
    for k in g1:
        assert torch.allclose(g1[k], g2[k], rtol=1e-5, atol=1e-7), k
    # in eval / no_grad nothing is recomputed
    calls.clear()
    ck.eval()
    with torch.no_grad():
        ck(torch.randint(4, 260, (2, 5)), torch.randint(4, 260, (2, 5)))
    assert len(calls) == 1
    assert set(ck.state_dict()) == set(plain.state_dict())  # checkpoints unchanged


def test_compile_keeps_parameter_names():
    cfg = cfg_with("engine.compile=true")
    m = _tiny_model(cfg)
    keys = list(m.state_dict())
    assert list(prepare_model(m, cfg).state_dict()) == keys  # compiled in place: checkpoints stay loadable
