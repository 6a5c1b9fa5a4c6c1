"""Checkpoint integrity: each checkpoint's index.json records every file's sha256;
a corrupt or truncated file is named on load; resume falls back to the newest intact checkpoint (or
stops, train.on_corrupt_checkpoint=stop); stale .partial directories are removed at start; a full disk
during a save names the path and the free space, keeps the previous checkpoint and stops (or continues
without saving, train.on_save_error=continue)."""
from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest
import torch

from helpers import engine_holding
from scaletrain.checkpoint import (INDEX, CheckpointContents, CheckpointManager, CorruptCheckpoint, load_model_weights,
                                   verify_checkpoint, write_index)
from scaletrain.config import load_config
from scaletrain.errors import ScaletrainError


def OneRank(fail_with: BaseException | None = None):
    """The real engine, world of one, holding a one-layer model; ``fail_with``: raised inside its save."""
    return engine_holding(torch.nn.Linear(4, 1), fail_with=fail_with)


def _save(mgr, step):
    state = {"step": step, "tokens_seen": step, "examples_seen": step, "world_size": 1}
    return mgr.save(step, CheckpointContents(state, {"stream": {"pos": step}}, "name: t\n", ["de"]))


def _flip(path: Path, at: int = 100):
    b = bytearray(path.read_bytes())
    b[at % len(b)] ^= 0xFF
    path.write_bytes(bytes(b))


def test_index_lists_every_file_with_its_sha256(tmp_path):
    mgr = CheckpointManager(tmp_path, OneRank(), keep_last=3)
    d = _save(mgr, 1)
    files = json.loads((d / INDEX).read_text())["files"]
    assert set(files) == {p.name for p in d.iterdir()} - {INDEX}
    assert {"model.safetensors", "rank00000.pt", "trainer_state.json", "config.yaml", "langs.json"} <= set(files)
    verify_checkpoint(d)  # intact


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_file_is_named(tmp_path, damage):
    mgr = CheckpointManager(tmp_path, OneRank(), keep_last=3)
    d = _save(mgr, 1)
    f = d / "model.safetensors"
    if damage == "flip":
        _flip(f)
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:50])
    else:
        f.unlink()
    with pytest.raises(CorruptCheckpoint) as e:
        verify_checkpoint(d)
    assert str(f) in str(e.value) and {"flip": "corrupt", "truncate": "truncated", "delete": "missing"}[damage] in str(e.value)


def test_resume_falls_back_to_the_newest_intact_checkpoint_with_a_warning(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, OneRank(), keep_last=3)
    for s in (1, 2, 3):
        _save(mgr, s)
    _flip(mgr.root / "step-0000003" / "rank00000.pt")
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        assert mgr.resume_tag("fallback") == "step-0000002"
    text = caplog.text
    assert str(mgr.root / "step-0000003" / "rank00000.pt") in text and "falling back" in text
    with pytest.raises(ScaletrainError, match="step-0000003/rank00000.pt: corrupt.*on_corrupt_checkpoint=fallback"):
        mgr.resume_tag("stop")
    for s in (1, 2):
        _flip(mgr.root / f"step-{s:07d}" / "model.safetensors")
    with pytest.raises(ScaletrainError, match="no intact checkpoint"):
        mgr.resume_tag("fallback")


def test_inference_loader_names_a_corrupt_weights_file(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "ck"
    d.mkdir()
    save_file({"w": torch.ones(64)}, str(d / "model.safetensors"))
    write_index(d)
    assert torch.equal(load_model_weights(d)["w"], torch.ones(64))
    _flip(d / "model.safetensors", at=-10)
    with pytest.raises(CorruptCheckpoint, match="model.safetensors: corrupt"):
        load_model_weights(d)


def test_stale_partials_are_removed(tmp_path):
    mgr = CheckpointManager(tmp_path, OneRank(), keep_last=3)
    _save(mgr, 1)
    for s in (2, 3):
        (mgr.root / f"step-{s:07d}.partial").mkdir()
        (mgr.root / f"step-{s:07d}.partial" / "model.safetensors").write_bytes(b"x")
    assert mgr.remove_stale_partials() == ["step-0000002.partial", "step-0000003.partial"]
    assert sorted(p.name for p in mgr.root.iterdir()) == ["latest", "step-0000001"]


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device", "/ckpt/step-0000002.partial/optim_states.pt"),
    RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 512 vs 448: basic_ios::clear: iostream error"),
])
def test_full_disk_names_the_path_and_free_space_and_keeps_the_previous_checkpoint(tmp_path, error):
    eng = OneRank()
    mgr = CheckpointManager(tmp_path, eng, keep_last=3)
    _save(mgr, 1)
    eng.backend.fail_with = error
    with pytest.raises(ScaletrainError) as e:
        _save(mgr, 2)
    msg = str(e.value)
    assert "could not write checkpoint step-0000002" in msg and "MiB free" in msg and "\n" not in msg
    assert ("No space left on device (/ckpt/step-0000002.partial/optim_states.pt)" in msg
            if isinstance(error, OSError) else "iostream error" in msg)
    assert f"the previous checkpoint {mgr.root / 'step-0000001'} is intact" in msg
    assert sorted(p.name for p in mgr.root.iterdir()) == ["latest", "step-0000001"]  # no partial left
    assert mgr.resume_tag() == "step-0000001"
    # continue: warn, no checkpoint, training goes on; the next save works again
    mgr.on_save_error = "continue"
    assert _save(mgr, 2) is None and mgr.latest() == "step-0000001"
    eng.backend.fail_with = None
    assert _save(mgr, 3) == mgr.root / "step-0000003" and mgr.latest() == "step-0000003"


def test_a_programming_error_in_save_is_not_disguised_as_a_disk_problem(tmp_path):
    eng = OneRank(fail_with=RuntimeError("Expected all tensors to be on the same device"))
    with pytest.raises(RuntimeError, match="same device"):
        _save(CheckpointManager(tmp_path, eng, keep_last=3), 1)


def test_trainer_resume_falls_back_and_clears_partials(django_shards, tmp_path, caplog):
    """The wiring in Trainer.fit: stale partials go at start; a corrupt newest checkpoint is skipped."""
    from test_engine_loop import TINY, SkippingEngine

    from scaletrain.train import Trainer

    over = [*TINY, f"data.shards={django_shards}", f"train.out_dir={tmp_path}", "train.max_steps=4",
            "train.save_every=2"]
    cfg = load_config("small", over)
    t = Trainer(cfg, engine=SkippingEngine(cfg, skip=()))
    t.fit()
    t.close()
    root = tmp_path / "checkpoints"
    _flip(root / "step-0000004" / "model.safetensors")
    (root / "step-0000006.partial").mkdir()
    cfg2 = load_config("small", [*over, "train.max_steps=5"])
    t2 = Trainer(cfg2, engine=SkippingEngine(cfg2, skip=()))
    with caplog.at_level(logging.INFO, logger="scaletrain"):
        res = t2.fit()
    t2.close()
    assert not (root / "step-0000006.partial").exists()
    assert "falling back" in caplog.text and f"resumed from {root / 'step-0000002'} at step 2" in caplog.text
    assert res.steps == 5 and t2.engine.updates == 3
    cfg3 = load_config("small", [*over, "train.max_steps=6", "train.on_corrupt_checkpoint=stop"])
    _flip(root / "step-0000005" / "model.safetensors")
    t3 = Trainer(cfg3, engine=SkippingEngine(cfg3, skip=()))
    with pytest.raises(ScaletrainError, match="step-0000005/model.safetensors: corrupt"):
        t3.fit()
    t3.close()
