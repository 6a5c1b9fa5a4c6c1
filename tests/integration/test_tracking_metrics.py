"""A real tiny MoE training run's metrics and records: MFU (formula, range), MoE auxiliary loss and
dropped tokens, memory and data-loader wait, MoE tags, the checkpoints.json artifact."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env")  # trains in this process

TINY = ["model.d_model=32", "model.n_heads=2", "model.encoder_layers=1", "model.decoder_layers=1", "model.ffn_dim=64",
        "model.dropout=0.0", "model.max_positions=64", "data.max_bytes=40", "data.max_tokens=600", "train.log_every=2",
        "train.valid_every=0", "train.valid_max_batches=1", "train.max_steps=6"]
MOE = ["moe.num_experts=4", "moe.top_k=2", "moe.every=1", "moe.capacity_factor=0.5"]


@pytest.fixture(scope="module")
def moe_run(django_shards, tmp_path_factory):
    import os

    from scaletrain.config import load_config
    from scaletrain.train import train

    saved = dict(os.environ)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    tmp = tmp_path_factory.mktemp("moe_run")
    uri = f"sqlite:///{tmp / 'mlruns.db'}"
    cfg = load_config("small", [*TINY, *MOE, f"data.shards={django_shards}", f"train.out_dir={tmp / 'run'}",
                                "train.save_every=2", "train.keep_last=1", "tracking.peak_tflops=0.5",
                                f"tracking.uri={uri}", "tracking.experiment=metrics"])
    try:
        res = train(cfg)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return cfg, res, MlflowClient(uri)


def _history(c, run_id, key):
    return {m.step: m.value for m in c.get_metric_history(run_id, key)}


def test_mfu_is_model_flops_times_tokens_over_the_peak(moe_run):
    from scaletrain.models import estimate_flops_per_token
    from scaletrain.train.mfu import moe_extra_flops_per_token

    cfg, res, c = moe_run
    mfu = _history(c, res.run_id, "train/mfu")
    tps = _history(c, res.run_id, "train/tokens_per_s")
    fpt = _history(c, res.run_id, "train/flops_per_token")
    assert sorted(mfu) == [2, 4, 6]
    V = json.loads(json.dumps(c.get_run(res.run_id).data.params))["vocab_size"]
    for s in mfu:
        assert 0 < mfu[s] <= 1
        assert mfu[s] == pytest.approx(tps[s] * fpt[s] / 0.5e12, rel=1e-9)  # world size 1, peak 0.5 TFLOP/s
        assert _history(c, res.run_id, "train/peak_tflops")[s] == 0.5
        # the model's own count (MoE layers included) at the interval's mean lengths, which lie within the
        # batches' bounds (<= 40 bytes + tag/eos)
        src_len = _history(c, res.run_id, "train/mean_src_len")[s]
        tgt_len = _history(c, res.run_id, "train/mean_tgt_len")[s]
        assert 1 <= src_len <= 42 and 1 <= tgt_len <= 42, (src_len, tgt_len)
        want = (estimate_flops_per_token(cfg.model, src_len, tgt_len, int(V))
                + moe_extra_flops_per_token(cfg.model, cfg.moe, src_len, tgt_len))
        assert fpt[s] == pytest.approx(want, rel=1e-9)
        assert moe_extra_flops_per_token(cfg.model, cfg.moe, src_len, tgt_len) > 0.05 * want  # MoE counted


def test_moe_aux_loss_dropped_tokens_memory_and_data_wait(moe_run):
    cfg, res, c = moe_run
    m = c.get_run(res.run_id).data.metrics
    aux = _history(c, res.run_id, "train/moe_aux_loss")
    assert sorted(aux) == [2, 4, 6]
    # coef * E * sum_e f_e P_e: E * sum f_e P_e is 1 when balanced, up to E; times coef 0.01
    assert all(0.005 < v < 0.01 * 4 + 1e-9 for v in aux.values()), aux
    dropped = [k for k in m if k.startswith("moe/") and k.endswith("/dropped")]
    assert dropped and all(0 < m[k] < 1 for k in dropped)  # capacity 0.5: some pairs dropped, not all
    assert m["sys/max_rss_mb"] > 50 and m["train/data_wait_s"] >= 0
    assert "train/loss_scale" not in m  # fp32: no loss scaling


def test_moe_tags_and_checkpoint_list(moe_run):
    cfg, res, c = moe_run
    tags = c.get_run(res.run_id).data.tags
    assert {k: tags.get(k) for k in ("moe.experts", "moe.top_k", "moe.ep_size")} == {
        "moe.experts": "4", "moe.top_k": "2", "moe.ep_size": "1"}
    local = json.loads((Path(res.out_dir) / "tracking" / "artifacts" / "checkpoints.json").read_text())
    got = json.loads(Path(c.download_artifacts(res.run_id, "checkpoints.json")).read_text())
    assert got == local and got["run_id"] == res.run_id
    ckpts = got["checkpoints"]
    assert [e["step"] for e in ckpts] == [2, 4, 6]
    assert [e["exists"] for e in ckpts] == [False, False, True]  # keep_last=1 pruned the older ones
    assert ckpts[-1]["path"] == str(Path(res.final_checkpoint).resolve())


def test_moe_expert_usage_per_language_plot_is_the_logged_shares(moe_run):
    from PIL import Image

    cfg, res, c = moe_run
    png = Path(res.out_dir) / "plots" / "expert_usage.png"
    with Image.open(png) as im:
        im.verify()
    data = json.loads(png.with_suffix(".json").read_text())
    assert data["step"] == 6 and list(data["layers"]) == ["moe encoder.0"]
    layer = data["layers"]["moe encoder.0"]
    assert layer["experts"] == [0, 1, 2, 3] and layer["langs"][-1] == "all" and "mean_radius" not in layer
    logged = c.get_run(res.run_id).data.metrics
    for i, lang in enumerate(layer["langs"]):
        assert layer["share"][i] == [logged[f"moe_usage/encoder.0/{lang}/share_e{e}"] for e in range(4)], lang
        assert abs(sum(layer["share"][i]) - 1) < 1e-9
