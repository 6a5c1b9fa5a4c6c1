"""Atomic checkpoints: a crash during a save leaves the previous checkpoint loadable and `latest`
never names a partial one; resuming with another world size fails with a clear message.

The real engine over a one-process backend stands in for DeepSpeed/Accelerate here (``helpers.engine_holding``),
so these tests are fast and can crash the writer on purpose.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT, engine_holding
from scaletrain.checkpoint import CheckpointContents, CheckpointManager, latest_tag, resolve_checkpoint
from scaletrain.errors import ScaletrainError

CRASH = OSError("disk full (simulated) while writing optimizer states")


def LocalEngine(model, crash_in_save: bool = False):
    return engine_holding(model, fail_with=CRASH if crash_in_save else None)


def _save(mgr: CheckpointManager, step: int, world_size: int = 1):
    state = {"step": step, "tokens_seen": 10 * step, "examples_seen": step, "world_size": world_size}
    return mgr.save(step, CheckpointContents(state, {"stream": {"pos": step}}, "name: t\n", ["de", "ru"]))


def _model(fill: float):
    m = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(fill)
    return m


def test_exception_inside_engine_save_keeps_previous_checkpoint(tmp_path):
    m = _model(1.0)
    mgr = CheckpointManager(tmp_path, LocalEngine(m), keep_last=3)
    _save(mgr, 10)
    with torch.no_grad():
        m.weight.fill_(2.0)
    mgr.engine.backend.fail_with = CRASH
    with pytest.raises(ScaletrainError, match="simulated.*step-0000010 is intact"):
        _save(mgr, 20)
    root = tmp_path / "checkpoints"
    # the failed save's partial directory is removed (partials do not pile up)
    assert not (root / "step-0000020.partial").exists() and not (root / "step-0000020").exists()
    assert mgr.latest() == "step-0000010"
    # the previous checkpoint loads and restores the old weights and stream state
    fresh = _model(0.0)
    loaded = CheckpointManager(tmp_path, LocalEngine(fresh), 3).load("step-0000010")
    assert loaded.same_world and loaded.trainer_state["step"] == 10 and loaded.rank_states == [{"stream": {"pos": 10}}]
    assert torch.all(fresh.weight == 1.0)
    # the next save after the crash replaces the leftover partial and succeeds
    mgr.engine.backend.fail_with = None
    _save(mgr, 20)
    assert mgr.latest() == "step-0000020" and not (root / "step-0000020.partial").exists()
    assert resolve_checkpoint(tmp_path) == root / "step-0000020"


KILL_SCRIPT = """
import os, sys, torch
sys.path[:0] = {paths!r}
from test_checkpoint_atomic import CheckpointManager, LocalEngine, _model, _save
mgr = CheckpointManager({out!r}, LocalEngine(_model(1.0)), keep_last=3)
_save(mgr, 10)
real_replace = os.replace
def dying_replace(src, dst):
    if {when!r} == "rename" and str(src).endswith(".partial"):
        os._exit(9)              # killed after the engine wrote everything, before the rename
    if {when!r} == "latest" and str(dst).endswith("latest") and "0000020" in open(src).read():
        os._exit(9)              # killed after the rename, before `latest` moved
    return real_replace(src, dst)
os.replace = dying_replace
import scaletrain.checkpoint.manager as ck
ck.os.replace = dying_replace
_save(mgr, 20)
"""


@pytest.mark.parametrize("when", ["rename", "latest"])
def test_process_killed_during_save(tmp_path, when):
    paths = [str(Path(__file__).resolve().parent), str(ROOT / "tests")]  # this module, and what it imports
    script = KILL_SCRIPT.format(paths=paths, out=str(tmp_path), when=when)
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 9, p.stderr[-2000:]
    root = tmp_path / "checkpoints"
    # `latest` still names the complete step-10 checkpoint, which loads
    assert (root / "latest").read_text().strip() == "step-0000010"
    assert latest_tag(root) == "step-0000010"
    fresh = _model(0.0)
    state = CheckpointManager(tmp_path, LocalEngine(fresh), 3).load(latest_tag(root)).trainer_state
    assert state["step"] == 10 and torch.all(fresh.weight == 1.0)
    if when == "rename":
        assert (root / "step-0000020.partial" / "model.safetensors").is_file() and not (root / "step-0000020").exists()
    else:
        assert (root / "step-0000020" / "trainer_state.json").is_file()  # complete, just not yet `latest`
    assert not any(p.name.startswith("latest.tmp") and p.stat().st_size == 0 for p in root.iterdir())


def test_latest_naming_a_partial_checkpoint_is_refused(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step-0000005").mkdir(parents=True)
    (root / "latest").write_text("step-0000005\n")
    with pytest.raises(ScaletrainError, match="not a complete checkpoint"):
        latest_tag(root)


def test_keep_last_prunes_oldest(tmp_path):
    mgr = CheckpointManager(tmp_path, LocalEngine(_model(1.0)), keep_last=2)
    for s in (1, 2, 3):
        _save(mgr, s)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert names == ["step-0000002", "step-0000003"]
    assert json.loads((tmp_path / "checkpoints" / "step-0000003" / "langs.json").read_text()) == ["de", "ru"]


def test_resume_at_another_world_size_without_a_layout_record_is_a_clear_error(tmp_path):
    """A checkpoint from before engine.json cannot say its layout: another world size is refused in one line
    (with engine.json it resumes: tests/integration/test_resume_any_layout.py)."""
    mgr = CheckpointManager(tmp_path, LocalEngine(_model(1.0)), keep_last=2)
    _save(mgr, 4, world_size=2)  # as if written by 2 ranks
    ck = tmp_path / "checkpoints" / "step-0000004"
    (ck / "engine.json").unlink()
    index = json.loads((ck / "index.json").read_text())
    index["files"].pop("engine.json")
    (ck / "index.json").write_text(json.dumps(index))
    one = CheckpointManager(tmp_path, LocalEngine(_model(0.0)), keep_last=2)
    with pytest.raises(ScaletrainError, match=r"written by 2 ranks but this run has 1, before checkpoints recorded "
                                              r"their layout.*relaunch with the old rank count"):
        one.load(one.latest())
