"""The catalogs recipes: each model recipe with the catalogs overlay (one data/budget/eval section for all),
and the list form of a recipe's ``base:`` that builds them."""
from __future__ import annotations

import dataclasses

import pytest
import yaml

from scaletrain.config import load_config, recipe_names
from scaletrain.prepare.gettext import CATALOG_LANGS
from scaletrain.errors import ScaletrainError

CATALOG_RECIPES = {"catalogs_base": "base", "catalogs_embeddingless": "embeddingless", "catalogs_byte_ncf": "byte_ncf",
                   "catalogs_msc": "msc", "catalogs_moce_d5_lid": "moce_d5_lid", "catalogs_subword_cg": "subword_cg"}
SCRIPT_GROUPS = ("latin", "cyrillic", "arabic-hebrew", "greek-armenian-georgian", "brahmic", "cjk")


def _shared(cfg) -> dict:
    """What the overlay makes equal across models (everything but the model and a subword tokenizer's keys)."""
    d = dataclasses.asdict(cfg)
    data = {k: v for k, v in d["data"].items() if k not in ("tokenizer", "spm_vocab_size")}
    return {"data": data, "engine": d["engine"], "train": d["train"], "eval": d["eval"],
            "optim": {k: d["optim"][k] for k in ("lr", "warmup_steps", "warmup_init_lr")}}


def test_catalog_recipes_share_data_budget_and_eval_and_keep_each_model():
    assert set(CATALOG_RECIPES) | {"catalogs_gpu"} <= set(recipe_names())
    assert not any(n.startswith("overlays") for n in recipe_names())
    ref = load_config("catalogs_base")
    assert ref.data.shards == "shards/catalogs" and ref.train.max_minutes == 10 and ref.engine.grad_accum == 1
    for name, model_recipe in CATALOG_RECIPES.items():
        cfg = load_config(name)
        shared = _shared(cfg)
        shared["train"].pop("out_dir")
        want = _shared(ref)
        want["train"].pop("out_dir")
        assert shared == want, name
        assert cfg.model == load_config(model_recipe).model, name  # the paper's model, untouched
    sub = load_config("catalogs_subword_cg")
    assert sub.data.tokenizer == "spm" and sub.data.spm_vocab_size == 8000
    gpu = load_config("catalogs_gpu")
    assert gpu.train.max_minutes == 9 and gpu.model == ref.model and gpu.data == ref.data


def test_script_groups_cover_every_default_language_once():
    groups = load_config("catalogs_base").eval.groups
    assert set(groups) == {*SCRIPT_GROUPS, "low-resource"}  # the overlay's groups replace the paper's OPUS-100 ones
    members = [l for g in SCRIPT_GROUPS for l in groups[g]]
    assert sorted(members) == sorted(CATALOG_LANGS)
    assert set(groups["low-resource"]) <= set(CATALOG_LANGS)


def test_base_list_merges_in_order_and_fails_clearly(tmp_path):
    (tmp_path / "a.yaml").write_text("train:\n  max_steps: 7\n  log_every: 3\n")
    (tmp_path / "b.yaml").write_text("train:\n  max_steps: 9\n")
    p = tmp_path / "r.yaml"
    p.write_text(f"base: [small, {tmp_path / 'a.yaml'}, {tmp_path / 'b.yaml'}]\ntrain:\n  keep_last: 5\n")
    cfg = load_config(str(p))
    assert (cfg.train.max_steps, cfg.train.log_every, cfg.train.keep_last) == (9, 3, 5)  # later bases win
    assert cfg.model == load_config("small").model
    p.write_text("base: {a: 1}\n")
    with pytest.raises(ScaletrainError, match="'base' must be a recipe name or a list"):
        load_config(str(p))
    (tmp_path / "c.yaml").write_text(f"base: [small, {tmp_path / 'c.yaml'}]\n")
    with pytest.raises(ScaletrainError, match="circular"):
        load_config(str(tmp_path / "c.yaml"))
    # any recipe takes the overlay the same way
    p.write_text("base: [msha, overlays/catalogs]\n")
    cfg = load_config(str(p))
    assert cfg.model.arch == "msha" and cfg.data.shards == "shards/catalogs" and cfg.train.max_minutes == 10
    assert yaml.safe_load(p.read_text())["base"][1] == "overlays/catalogs"


def test_compare_models_pins_one_precision_per_folder(tmp_path, monkeypatch):
    from scaletrain.eval import compare_models as cm

    monkeypatch.setenv("SCALETRAIN_AUTO_PRECISION", "bf16")
    assert cm.pinned_precision(tmp_path)[0] == "bf16"  # a new folder: resolved here
    (tmp_path / "plan.json").write_text('{"precision": "fp32", "precision_reason": "first run"}')
    assert cm.pinned_precision(tmp_path) == ("fp32", "first run")  # recorded: every later run gets the same


def test_compare_models_size_presets_fit_every_model():
    from scaletrain.eval import compare_models as cm

    for size in cm.SIZES:
        for name in CATALOG_RECIPES:
            arch = load_config(name).model.arch
            cfg = load_config(name, cm.size_overrides(size, arch))
            if size != "paper":
                assert cfg.model.d_model == cm.SIZES[size]["d_model"]
                enc = cfg.model.encoder_layers + (cfg.model.lobef.byte_layers if arch == "byte_ncf" else 0)
                assert enc == cfg.model.decoder_layers == cm.SIZES[size]["layers"], (size, name)
    with pytest.raises(ScaletrainError, match="--size"):
        cm.size_overrides("huge", "transformer")
