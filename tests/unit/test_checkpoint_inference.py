"""Loading for inference (``scaletrain.checkpoint.inference``) and the single-file export it reads back,
in process with a tiny model: the weights round-trip exactly (bf16 within rounding), a checkpoint or an
exported file whose weights do not fit the model is refused naming the path and the names, and a
safetensors file ``scaletrain export`` did not write is refused in one line."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import tiny_model
from scaletrain.checkpoint import load_exported, load_for_inference, load_model_weights, resolve_checkpoint
from scaletrain.config import dump_yaml, load_config
from scaletrain.errors import ScaletrainError
from scaletrain.export import export_checkpoint
from scaletrain.models import build_model
from scaletrain.vocab import ByteVocab

LANGS = ["de", "en"]


def _checkpoint(root, sd_edit=None):
    """OUT/checkpoints/step-0000003 of a tiny byte Transformer; ``sd_edit`` changes the saved weights."""
    torch.manual_seed(0)
    cfg = load_config("small", [*tiny_model(), "data.max_bytes=60"])
    model = build_model(cfg.model, ByteVocab(LANGS).size)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if sd_edit:
        sd_edit(sd)
    ck = root / "checkpoints" / "step-0000003"
    ck.mkdir(parents=True)
    save_file(sd, str(ck / "model.safetensors"))
    (ck / "config.yaml").write_text(dump_yaml(cfg))
    (ck / "langs.json").write_text(json.dumps(LANGS))
    (ck / "trainer_state.json").write_text(json.dumps({"step": 3}))
    (root / "checkpoints" / "latest").write_text("step-0000003\n")
    return ck, model.state_dict()


def test_a_run_directory_loads_its_latest_checkpoint(tmp_path):
    ck, want = _checkpoint(tmp_path)
    assert resolve_checkpoint(tmp_path) == ck and resolve_checkpoint(tmp_path / "checkpoints") == ck
    model, cfg, vocab, state, where = load_for_inference(tmp_path)
    assert where == ck and state == {"step": 3} and vocab.langs == LANGS and not model.training
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_exported_file_loads_back_as_the_checkpoint(tmp_path, dtype):
    ck, want = _checkpoint(tmp_path / "run")
    out = export_checkpoint(tmp_path / "run", tmp_path / "x" / "m.safetensors", dtype)
    stored = load_file(str(out))
    assert all(v.dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32) for v in stored.values())
    model, cfg, vocab, state, where = load_for_inference(out)  # dispatches on the .safetensors file
    assert where == out and state == {"step": 3} and vocab.langs == LANGS
    got = model.state_dict()
    for k, v in want.items():
        if dtype == "fp32":
            assert torch.equal(got[k], v), k
        else:
            assert torch.equal(got[k], v.to(torch.bfloat16).float()), k
    assert load_exported(out)[3] == {"step": 3}


def test_checkpoint_weights_that_do_not_fit_the_model_are_refused(tmp_path):
    def drop_one_add_one(sd):
        sd.pop("embeddings.weight")
        sd["stray.weight"] = torch.zeros(2)

    ck, _ = _checkpoint(tmp_path, drop_one_add_one)
    with pytest.raises(ScaletrainError) as e:
        load_for_inference(ck)
    msg = str(e.value)
    assert msg.startswith(f"{ck}: weights do not match the model") and "embeddings.weight" in msg
    assert "stray.weight" in msg and "\n" not in msg


def test_exported_file_whose_weights_do_not_fit_is_refused(tmp_path):
    _checkpoint(tmp_path / "run")
    out = export_checkpoint(tmp_path / "run", tmp_path / "m.safetensors")
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    sd = load_file(str(out))
    sd["stray.weight"] = torch.zeros(2)
    save_file(sd, str(out), metadata=meta)
    with pytest.raises(ScaletrainError, match="weights do not match the model") as e:
        load_for_inference(out)
    assert str(e.value).startswith(str(out)) and "stray.weight" in str(e.value)


def test_a_safetensors_file_not_written_by_export_is_refused(tmp_path):
    f = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(f))
    with pytest.raises(ScaletrainError, match="not written by `scaletrain export`"):
        load_for_inference(f)
    f.write_bytes(b"not safetensors")
    with pytest.raises(ScaletrainError, match="not a readable safetensors file"):
        load_for_inference(f)


def test_a_directory_without_weights_is_named(tmp_path):
    ck, _ = _checkpoint(tmp_path)
    (ck / "model.safetensors").unlink()
    with pytest.raises(ScaletrainError, match="no model weights found") as e:
        load_model_weights(ck)
    assert str(ck) in str(e.value)
