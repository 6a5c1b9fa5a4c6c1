"""Plots of a real tiny MoCE run: expert usage per source language (PNG + the JSON of the numbers drawn,
which equal the routing statistics logged to MLflow), learning curves with their JSON."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env")  # trains in this process

TINY = ["model.d_model=32", "model.n_heads=2", "model.encoder_layers=1", "model.decoder_layers=1", "model.ffn_dim=64",
        "model.dropout=0.0", "model.max_positions=64", "data.max_bytes=40", "data.max_tokens=600", "train.log_every=2",
        "train.valid_every=0", "train.valid_max_batches=1", "train.save_every=0", "train.max_steps=4"]


def _png_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as im:
        im.verify()  # a valid PNG, not just a file
    with Image.open(path) as im:
        assert im.format == "PNG"
        return im.size


def test_moce_run_plots_expert_usage_per_language_from_the_logged_routing(django_shards, tmp_path, monkeypatch):
    from scaletrain.config import load_config
    from scaletrain.train import train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    res = train(load_config("small", [*TINY, "model.arch=moce", "model.conv.kernels=[0,1,3]", f"tracking.uri={uri}",
                                      f"data.shards={django_shards}", f"train.out_dir={tmp_path / 'run'}"]))
    plots = Path(res.out_dir) / "plots"
    png, data_file = plots / "expert_usage.png", plots / "expert_usage.json"
    w, h = _png_size(png)
    assert w == 1000 and h > 100
    data = json.loads(data_file.read_text())
    assert data["step"] == 4 and list(data["layers"]) == ["L0"]
    layer = data["layers"]["L0"]
    assert layer["kernels"] == [0, 1, 3] and layer["langs"][-1] == "all" and len(layer["langs"]) > 2
    c = MlflowClient(uri)
    logged = c.get_run(res.run_id).data.metrics  # the last value of each key: step 4's
    for i, lang in enumerate(layer["langs"]):
        shares = layer["share"][i]
        assert shares == [logged[f"routing/L0/{lang}/share_k{k}"] for k in (0, 1, 3)], lang
        assert abs(sum(shares) - 1) < 1e-6
        assert layer["mean_radius"][i] == logged[f"routing/L0/{lang}/mean_radius"]
    arts = {a.path for a in c.list_artifacts(res.run_id, "plots")}
    assert {"plots/expert_usage.png", "plots/expert_usage.json", "plots/learning_curves.png",
            "plots/learning_curves.json"} <= arts
    curves = json.loads((plots / "learning_curves.json").read_text())
    loss = {m.step: m.value for m in c.get_metric_history(res.run_id, "train/loss")}
    assert {p["step"]: p["value"] for p in curves["train/loss"]} == loss and sorted(loss) == [2, 4]
    # read alone: units on the axes, the target-unigram NLL the trainer logged as the reference line
    base = logged["baseline/unigram_valid_nll"]
    assert curves["baseline/unigram_valid_nll"] == base
    for ax in curves["figure"]["axes"]:
        assert f"target-unigram NLL, validation split ({base:.2f})" in ax["lines"]
        assert ax["xlabel"] in ("update", "training time (min)") and ax["ylabel"].endswith("nats / target byte)")
    usage = json.loads(data_file.read_text())["figure"]
    assert usage["title"] == c.get_run(res.run_id).info.run_name
    assert usage["axes"][0]["xlabel"] == "share of the routing choices since the last validation"
    assert usage["axes"][0]["ylabel"] == "source language" and usage["axes"][1]["xlabel"] == "receptive radius (tokens)"
