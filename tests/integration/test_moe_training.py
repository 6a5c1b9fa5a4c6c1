"""A model with sparse MoE feed-forward layers (moe.ep_size=1) trains end to end in the real loop
(in this process, world of one) under the DeepSpeed engine (ZeRO-0 and ZeRO-3) and the Accelerate
engine: the loss falls, the experts have their own optimizer group, the load-balancing loss reaches
the gradient, MoE metrics are logged, and the final checkpoint loads (and exports) with exactly the
trained weights."""
from __future__ import annotations

import math

import pytest
import torch

from scaletrain.checkpoint import load_for_inference
from scaletrain.config import load_config

COMMON = [
    "model.d_model=32", "model.n_heads=2", "model.encoder_layers=2", "model.decoder_layers=2", "model.ffn_dim=48",
    "model.dropout=0.0", "model.max_positions=64", "data.max_bytes=40", "data.max_tokens=600", "optim.lr=3e-3",
    "optim.warmup_steps=2", "train.max_steps=8", "train.log_every=4", "train.valid_every=0",
    "train.valid_max_batches=1", "train.save_every=0", "train.resume=false", "tracking.enabled=false",
    "engine.precision=fp32", "moe.num_experts=4", "moe.top_k=2", "moe.every=2", "moe.ffn_dim=32",
    "moe.aux_loss_coef=0.01",
]
ENGINES = {
    "deepspeed-zero0": ["engine.backend=deepspeed", "engine.ds_config=ds_configs/zero0.json"],
    "deepspeed-zero3": ["engine.backend=deepspeed", "engine.ds_config=ds_configs/zero3.json"],
    "accelerate-ddp": ["engine.backend=accelerate", "engine.accelerate=ddp", "moe.capacity_factor=1.0",
                       "moe.shared_expert=true"],
}

pytestmark = [pytest.mark.usefixtures("in_process_training"), pytest.mark.slow]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_moe_model_trains_saves_loads(engine, django_shards, tmp_path, isolated_env):
    from scaletrain.train import Trainer

    out = tmp_path / "run"
    cfg = load_config("small", [f"data.shards={django_shards}", f"train.out_dir={out}", *COMMON, *ENGINES[engine]])
    trainer = Trainer(cfg)
    model = trainer.engine.module
    experts = sum(p.numel() for n, p in model.named_parameters() if ".ffn.experts." in n)
    assert experts == 2 * 4 * (32 * 32 + 32 + 32 * 32 + 32) or engine.endswith("zero3")  # ZeRO-3 partitions
    res = trainer.fit()
    trainer.close()
    first, last = res.train_loss[0][1], res.train_loss[-1][1]
    assert math.isfinite(last) and last < first, res.train_loss
    assert model.last_aux_loss is not None and model.last_aux_loss.item() > 0
    metrics = trainer.logger.last_routing
    assert {k for k in metrics if k.startswith("moe/")} == {
        f"moe/{side}.1/{m}" for side in ("encoder", "decoder") for m in ("dropped", "max_load")}
    assert {k for k in metrics if not k.startswith("moe/")} >= {f"moe_usage/encoder.1/all/share_e{e}" for e in range(4)}
    assert all(1.0 <= metrics[f"moe/{s}.1/max_load"] <= 4.0 for s in ("encoder", "decoder"))
    if "capacity_factor=1.0" not in " ".join(ENGINES[engine]):
        assert metrics["moe/encoder.1/dropped"] == 0.0
    if engine == "accelerate-ddp":
        groups = trainer.engine.optimizer.param_groups
        assert [g.get("name") for g in groups] == ["dense", "experts"]
    trained = {k: v.detach().clone() for k, v in trainer.engine.full_state_dict().items()}
    loaded, cfg2, *_ = load_for_inference(out)
    assert cfg2.moe == cfg.moe
    sd = loaded.state_dict()
    assert sd.keys() == trained.keys() and any(".ffn.experts.w1" in k for k in sd)
    for k in trained:
        assert torch.equal(sd[k].float(), trained[k].float()), k
    if engine == "deepspeed-zero3":  # export consolidates the ZeRO-3 shards, experts included
        from safetensors.torch import load_file

        from scaletrain.export import export_checkpoint

        exported = load_file(str(export_checkpoint(out, tmp_path / "model.safetensors")))
        assert exported.keys() == trained.keys()
        for k in trained:
            assert torch.equal(exported[k].float(), trained[k].float()), k
