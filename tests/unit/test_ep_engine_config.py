"""Expert parallelism (moe.ep_size > 1) under DeepSpeed: ZeRO-3 and fp16 are refused at start-up with one
line naming the stage, the precision and what to use, ZeRO-1/2 with clipping too; ZeRO-0 in fp32 and in
bf16 (run as torch autocast over fp32 weights, no DeepSpeed 16-bit optimizer) resolves with DeepSpeed's
gradient clipping off (the driver clips with the EP-aware norm). The MoE recipes have the sizes their
comments give."""
from __future__ import annotations

import pytest

from scaletrain.config import load_config
from scaletrain.engine.ds_config import load_ds_config
from scaletrain.errors import ScaletrainError

MOE = ["moe.num_experts=4", "moe.every=2", "moe.ep_size=2", "optim.clip_norm=1.0"]


REASONS = {  # what DeepSpeed 0.19.8 does there (scaletrain/engine/ds_config.py::_expert_parallel_refusal)
    "zero3": "Native DeepSpeed MoE is not supported with ZeRO Stage 3",
    "zero0": "FP16_UnfusedOptimizer, whose fp32 master weights are copied while every rank still holds rank 0's",
    "fp16": "fp16's loss-scaled ZeRO-1/2 optimizers are untested",
}


@pytest.mark.parametrize("ds,prec,why", [("zero3.json", "fp32", "zero3"), ("zero0.json", "fp16", "zero0"),
                                         ("zero3.json", "bf16", "zero3"), ("zero2.json", "fp16", "fp16")])
def test_ep_refused_where_the_engine_cannot_reduce_experts(ds, prec, why):
    cfg = load_config("small", [*MOE, "optim.clip_norm=0", f"engine.ds_config={ds}", f"engine.precision={prec}"])
    with pytest.raises(ScaletrainError) as e:
        load_ds_config(cfg, 2)
    msg = str(e.value)
    assert "\n" not in msg and "moe.ep_size=2" in msg and "ZeRO-0/1/2 in fp32 or bf16" in msg and f"is {prec}" in msg
    assert REASONS[why] in msg and "engine.accelerate=ddp" in msg


def test_ep_refusal_names_the_optimizer_deepspeed_picks_for_zero0_fp16():
    """The reason given is what DeepSpeed does: fp16 without ZeRO and a client optimizer that is not its
    FusedAdam get FP16_UnfusedOptimizer, which clones fp32 master weights."""
    import inspect

    import torch
    from deepspeed.runtime.engine import FP16, DeepSpeedEngine
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    class Fp16Zero0:  # the attributes _do_optimizer_sanity_check reads
        def get_data_types(self):
            return torch.float16, torch.float16

        def zero_optimization(self):
            return False

        pipeline_parallelism = False

    assert DeepSpeedEngine._do_optimizer_sanity_check(Fp16Zero0(), torch.optim.AdamW([torch.zeros(1)])) == FP16
    src = inspect.getsource(DeepSpeedEngine._configure_fp16_optimizer)
    assert "use_fused_optimizer = isinstance(optimizer, fused_opts)" in src and "FP16_UnfusedOptimizer(" in src
    assert "p.clone().float().detach()" in inspect.getsource(FP16_UnfusedOptimizer.__init__)


def test_ep_zero0_bf16_runs_as_autocast_without_deepspeeds_16bit_optimizer():
    """ZeRO-0 bf16 is accepted because DeepSpeed gets it as torch autocast over fp32 weights: no ``bf16``
    section enabled, so no FP16_UnfusedOptimizer copying rank 0's experts (the 2-rank equivalence is
    tests/integration/test_expert_parallel.py::test_ep2_trains_like_ep1_in_bf16[z0bf16])."""
    from scaletrain.engine.ds_config import runtime_ds_config

    ds = load_ds_config(load_config("small", [*MOE, "engine.ds_config=zero0.json", "engine.precision=bf16"]), 2)
    assert ds["gradient_clipping"] == 0.0 and ds["bf16"]["enabled"] is True
    rt = runtime_ds_config(ds)
    assert rt["bf16"]["enabled"] is False and rt["fp16"]["enabled"] is False
    assert rt["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}


@pytest.mark.parametrize("ds", ["zero1.json", "zero2.json"])
def test_ep_with_zero12_needs_no_clipping(ds):
    cfg = load_config("small", [*MOE, f"engine.ds_config={ds}", "engine.precision=fp32"])
    with pytest.raises(ScaletrainError, match=r"moe.ep_size=2 with ZeRO-\d .* needs optim.clip_norm=0"):
        load_ds_config(cfg, 2)
    ok = load_config("small", [*MOE[:3], "optim.clip_norm=0", f"engine.ds_config={ds}", "engine.precision=fp32"])
    assert load_ds_config(ok, 2)["gradient_clipping"] == 0.0


def test_ep_zero0_fp32_leaves_clipping_to_the_driver():
    ds = load_ds_config(load_config("small", [*MOE, "engine.ds_config=zero0.json", "engine.precision=fp32"]), 2)
    assert ds["gradient_clipping"] == 0.0
    ds1 = load_ds_config(load_config("small", [*MOE[:2], "optim.clip_norm=1.0", "engine.ds_config=zero0.json",
                                               "engine.precision=fp32"]), 2)
    assert ds1["gradient_clipping"] == 1.0


@pytest.mark.parametrize("recipe,total", [("moe_base", 132_535_296), ("moce_d5_moe", 132_638_400)])
def test_moe_recipes_sizes_as_their_comments_say(recipe, total):
    from scaletrain.models.summary import model_summary

    cfg = load_config(recipe)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.every, cfg.moe.capacity_factor) == (8, 2, 2, 0.0)
    assert cfg.engine.backend == "accelerate" and cfg.engine.accelerate == "ddp"  # EP in any precision
    s = model_summary(cfg.model, 360, moe=cfg.moe)  # OPUS-100 vocabulary layout, as test_recipes_models
    expert = 2 * 512 * 2048 + 2048 + 512
    assert s["experts"] == 6 * 8 * expert and s["total"] == total
    dense = model_summary(load_config("base" if recipe == "moe_base" else "moce_d5").model, 360)["total"]
    assert total == dense - 6 * expert + 6 * 8 * expert + 6 * 512 * 8  # 6 FFNs -> 6 x 8 experts + routers


def test_moce_partition_resolves_like_moe_ffn_experts():
    """moe.moce_partition adds no rule of its own: ZeRO-0/1/2 (1/2 without clipping) and DDP, as for MoE-FFN."""
    for over in (["engine.ds_config=zero0.json", "engine.precision=fp32"], ["engine.backend=accelerate"],
                 ["engine.ds_config=zero2.json", "optim.clip_norm=0"]):
        cfg = load_config("moce_d5", ["moe.ep_size=2", "moe.moce_partition=true", *over])
        assert cfg.moe.moce_partition and cfg.moe.ep_size == 2
        if cfg.engine.backend == "deepspeed":
            assert load_ds_config(cfg, 2)["gradient_clipping"] == 0.0
    cfg = load_config("moce_d5", ["moe.ep_size=2", "moe.moce_partition=true", "engine.ds_config=zero3.json"])
    with pytest.raises(ScaletrainError, match="moe.ep_size=2 under DeepSpeed needs ZeRO-0"):
        load_ds_config(cfg, 2)
    assert load_config("moce_d5_moe", ["moe.ep_size=2"]).moe.ep_size == 2  # FFN experts split, MoCE replicated
