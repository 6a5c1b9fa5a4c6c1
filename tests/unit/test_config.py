import json
import math
import re

import pytest
import yaml

from scaletrain.config import dump_yaml, load_config, recipe_names
from scaletrain.engine.optim import inverse_sqrt_factor
from scaletrain.engine.ds_config import load_ds_config
from scaletrain.errors import ScaletrainError


def test_recipes_load_and_round_trip(tmp_path):
    names = recipe_names()
    assert {"small", "base"} <= set(names)
    for n in names:
        cfg = load_config(n)
        p = tmp_path / f"{n}.yaml"
        p.write_text(dump_yaml(cfg))
        assert load_config(str(p)) == load_config(str(p))
        assert dump_yaml(load_config(str(p))).replace(f"name: {n}", "") == dump_yaml(cfg).replace(f"name: {n}", "")


def test_overrides_typed():
    cfg = load_config("small", ["optim.lr=2e-3", "model.d_model=128", "model.n_heads=4", "optim.betas=[0.9,0.99]",
                                "engine.precision=bf16", "train.resume=false"])
    assert cfg.optim.lr == 0.002 and cfg.model.d_model == 128 and cfg.optim.betas == (0.9, 0.99)
    assert cfg.engine.precision == "bf16" and cfg.train.resume is False


@pytest.mark.parametrize("override,msg", [
    ("optim.lrr=1", "unknown config key 'optim.lrr'"),
    ("bogus.x=1", "unknown config key 'bogus'"),
    ("model.n_heads=3", "model.n_heads"),
    ("train.max_steps=1.5", "train.max_steps' must be an integer"),
    ("engine.precision=fp8", "engine.precision"),
    ("data.max_bytes=5000", "data.max_bytes"),
    ("optim.lr", "must look like section.key=value"),
])
def test_bad_overrides_name_the_key(override, msg):
    with pytest.raises(ScaletrainError, match=msg.replace("(", r"\(").replace("[", r"\[")):
        load_config("small", [override])


def test_variant_sections_load_from_yaml_and_dotted_overrides(tmp_path):
    cfg = load_config("moce_d5", ["model.moce.top_k=3", "model.conv.kernels=[0,1,3]"])
    assert (cfg.model.moce.top_k, cfg.model.moce.lid, cfg.model.conv.kernels) == (3, False, [0, 1, 3])
    p = tmp_path / "ncf.yaml"
    p.write_text("base: byte_ncf\nmodel:\n  lobef:\n    ngrams: [1, 2]\n")
    assert load_config(str(p)).model.lobef.ngrams == [1, 2]
    # the resolved config lists only the variant keys the arch / embedding uses
    dumped = yaml.safe_load(dump_yaml(load_config("byte_wsf")))["model"]
    assert dumped["lobef"] == {"byte_layers": 2, "separators": [32]} and dumped["onehot"] == {"learnable_scales": False}
    assert not {"conv", "moce", "charaware"} & set(dumped)
    assert not {"lobef", "conv", "moce", "onehot", "charaware"} & set(yaml.safe_load(dump_yaml(load_config("base")))["model"])


@pytest.mark.parametrize("recipe,override,msg", [
    ("small", "model.moce.top_k=3", "model.moce.top_k is set but model.arch is 'transformer'; it applies only to arch moce"),
    ("msc", "model.moce.lid=true", "model.moce.lid is set but model.arch is 'msc'"),
    ("byte_wsf", "model.lobef.ngrams=[1,2]", "model.lobef.ngrams is set but model.arch is 'byte_wsf'; it applies only to arch byte_ncf"),
    ("byte_ncf", "model.lobef.separators=[32]", "model.lobef.separators is set but model.arch is 'byte_ncf'"),
    ("base", "model.conv.layers=[0]", "model.conv.layers is set but model.arch is 'transformer'; it applies only to arch msc, msha, moce"),
    ("base", "model.charaware.dim=8", "model.charaware.dim is set but model.embedding is 'learned'; it applies only to embedding charaware"),
    ("moce_d5", "model.onehot.learnable_scales=false", "model.onehot.learnable_scales is set but model.embedding is 'learned'"),
    ("moce_d5", "model.moce_top_k=3", "config key 'model.moce_top_k' is now 'model.moce.top_k'"),
    ("byte_ncf", "model.byte_encoder_layers=2", "config key 'model.byte_encoder_layers' is now 'model.lobef.byte_layers'"),
    ("moce_d5", "model.moce.topk=3", "unknown config key 'model.moce.topk'; valid keys under 'model.moce'"),
    ("moce_d5", "model.conv.kernels=[0,2]", "model.conv.kernels: kernel sizes must be 0"),
    ("msha", "model.n_heads=4", "model.conv.kernels: msha needs one kernel per head (4)"),
])
def test_variant_keys_are_checked_against_the_arch(recipe, override, msg):
    with pytest.raises(ScaletrainError, match=re.escape(msg)):
        load_config(recipe, [override])


def test_variant_key_of_another_arch_in_a_yaml_file_is_an_error(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("base: moce_d5\nmodel:\n  arch: transformer\n")  # the parent's moce keys no longer apply
    with pytest.raises(ScaletrainError, match=r"model\.conv\.kernels is set but model\.arch is 'transformer'"):
        load_config(str(p))


def test_unknown_recipe():
    with pytest.raises(ScaletrainError, match="unknown recipe 'nope'"):
        load_config("nope")


def test_recipe_base_inheritance(tmp_path):
    p = tmp_path / "child.yaml"
    p.write_text("base: small\noptim:\n  lr: 0.01\n")
    cfg = load_config(str(p))
    small = load_config("small")
    assert cfg.optim.lr == 0.01 and cfg.model == small.model and cfg.name == "child"


def test_inverse_sqrt_matches_fairseq():
    # docs/MODELS.md §12: lr(4000) = 5e-4, lr(16000) = 2.5e-4, linear warm-up from warmup_init
    f = inverse_sqrt_factor(5e-4, 4000, 0.0)
    lr = lambda k: 5e-4 * f(k - 1)  # update number k (1-based)
    assert math.isclose(lr(4000), 5e-4) and math.isclose(lr(16000), 2.5e-4)
    assert math.isclose(lr(2000), 2.5e-4) and math.isclose(lr(1), 5e-4 / 4000)
    g = inverse_sqrt_factor(5e-4, 4000, 1e-7)
    assert math.isclose(5e-4 * g(2 - 1), 1e-7 + (5e-4 - 1e-7) * 2 / 4000)  # update 2


def _cfg_with_ds(tmp_path, content, *over):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(content))
    return load_config("small", [f"engine.ds_config={p}", *over])


def test_ds_config_filled_from_trainer(tmp_path):
    cfg = _cfg_with_ds(tmp_path, {"zero_optimization": {"stage": 2}}, "engine.grad_accum=4", "optim.clip_norm=0.5",
                       "engine.precision=bf16")
    ds = load_ds_config(cfg, world_size=2)
    assert ds["gradient_accumulation_steps"] == 4 and ds["train_batch_size"] == 8
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False


@pytest.mark.parametrize("content,msg", [
    ({"gradient_accumulation_steps": 3}, "'gradient_accumulation_steps' is 3 but scaletrain sets it to 1 from engine.grad_accum"),
    ({"gradient_clipping": 5.0}, "optim.clip_norm"),
    ({"bf16": {"enabled": True}}, "engine.precision"),
    ({"zero_optimization": {"stage": 7}}, "stage must be 0, 1, 2 or 3"),
    ({"optimizer": {"type": "Adam"}}, "owned by scaletrain"),
])
def test_ds_config_conflicts_are_errors(tmp_path, content, msg):
    cfg = _cfg_with_ds(tmp_path, content)
    with pytest.raises(ScaletrainError, match=msg.replace("(", r"\(")):
        load_ds_config(cfg, world_size=1)


def test_ds_config_missing_and_invalid(tmp_path):
    cfg = load_config("small", ["engine.ds_config=nope.json"])
    with pytest.raises(ScaletrainError, match="nope.json not found"):
        load_ds_config(cfg, 1)
    p = tmp_path / "bad.json"
    p.write_text("{\n  'x': 1\n}")
    cfg = load_config("small", [f"engine.ds_config={p}"])
    with pytest.raises(ScaletrainError, match="invalid JSON at line 2"):
        load_ds_config(cfg, 1)


def test_packaged_ds_configs_valid():
    for name in ("zero0.json", "zero1.json", "zero2.json", "zero3.json", "zero3_offload.json"):
        cfg = load_config("small", [f"engine.ds_config={name}"])
        assert load_ds_config(cfg, 2)["zero_optimization"]["stage"] in (0, 1, 2, 3)
