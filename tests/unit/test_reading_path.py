"""The reading path of docs/DESIGN.md ("Reading one training step") is the code's: every ``scaletrain/`` file whose
code runs during one training step and its checkpoint is named there, and nothing else is.

A real Trainer (tiny model, world of one, in this process, ``data.num_workers=0`` so the loader runs here too)
under DeepSpeed ZeRO-0 and under Accelerate DDP: a profile hook (``sys.setprofile``, and ``threading.setprofile``
for threads started meanwhile) records the files of every Python function called while the first step's batches
are read from the shards (``Prefetcher.fetch``) and while that step runs, logs and writes its checkpoint
(``Trainer._iteration`` with ``train.log_every=1``, ``train.save_every=1``). The doc's delimited block lists the
path (numbered, in reading order) and, apart, what runs beside it (logging, the run's policies, leaf helpers);
a file that only one backend runs is marked ``[deepspeed]`` or ``[accelerate]``."""
from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

import pytest

from helpers import IN_PROCESS_ENGINES, reset_accelerate, tiny_model
from scaletrain.config import load_config

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env", "fresh_accelerate")

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "scaletrain"
DOC = ROOT / "docs" / "DESIGN.md"
BEGIN, END = "<!-- reading-path: begin -->", "<!-- reading-path: end -->"
BESIDE = "Beside the path"
MAX_PATH, MAX_ALL = 20, 30
_ITEM = re.compile(r"^\s*(?:\d+\.|-)\s+`(scaletrain/[\w/]+\.py)`(?:\s+\[(deepspeed|accelerate)\])?")
BASE = [*tiny_model(), "data.max_bytes=40", "data.max_tokens=600", "data.num_workers=0", "train.max_steps=2",
        "train.log_every=1", "train.save_every=1", "train.valid_every=0", "train.resume=false",
        "tracking.enabled=false", "engine.threads=1", "engine.precision=fp32"]


def doc_lists(text: str, backend: str) -> tuple[list[str], list[str]]:
    """(the path, the files beside it) of ``backend`` as the doc's delimited block names them."""
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{DOC.name}: one {BEGIN} ... {END} block"
    block = text.split(BEGIN)[1].split(END)[0]
    path, beside, now = [], [], None
    for line in block.splitlines():
        if line.startswith(BESIDE):
            now = beside
        m = _ITEM.match(line)
        if m is None:
            continue
        if now is None:
            now = path
        if m.group(2) in (None, backend):
            now.append(m.group(1))
    return path, beside


def traced_files(trainer, monkeypatch) -> dict[str, str]:
    """The ``scaletrain/`` files (relative to the checkout) whose functions ran while the first step's batches were
    read and while that step ran and saved, in the order they were first called, each with its first function."""
    from scaletrain.train.prefetch import Prefetcher
    from scaletrain.train.trainer import Trainer

    seen: dict[str, str] = {}
    pkg, depth = str(PKG) + "/", [0]

    def hook(frame, event, arg):
        f = frame.f_code.co_filename
        if event == "call" and f.startswith(pkg):
            seen.setdefault(str(Path(f).relative_to(ROOT)), frame.f_code.co_name)

    def traced(fn):
        def run(self):
            if trainer.state.step != 0 or self not in (trainer, trainer.prefetcher):
                return fn(self)
            depth[0] += 1
            sys.setprofile(hook)
            threading.setprofile(hook)
            try:
                return fn(self)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    sys.setprofile(None)
                    threading.setprofile(None)
        return run

    monkeypatch.setattr(Prefetcher, "fetch", traced(Prefetcher.fetch))
    monkeypatch.setattr(Trainer, "_iteration", traced(Trainer._iteration))
    return seen  # filled by fit()


@pytest.mark.parametrize("backend", ["deepspeed", "accelerate"])
def test_the_doc_names_every_file_one_step_and_its_checkpoint_run(django_shards, tmp_path, monkeypatch, backend):
    from scaletrain.train import Trainer

    cfg = load_config("small", [*BASE, *IN_PROCESS_ENGINES[backend], f"data.shards={django_shards}",
                                f"train.out_dir={tmp_path}"])
    tr = Trainer(cfg)
    try:
        seen = traced_files(tr, monkeypatch)
        tr.fit()
    finally:
        tr.close()
        reset_accelerate()
    assert (tmp_path / "checkpoints" / "step-0000001" / "index.json").is_file()  # the traced step saved
    ran = list(seen)
    assert "scaletrain/data/shards.py" in ran and "scaletrain/checkpoint/engine_state.py" in ran, ran
    path, beside = doc_lists(DOC.read_text(encoding="utf-8"), backend)
    named = path + beside
    assert len(named) == len(set(named)), f"{DOC.name}: a file named twice: {sorted(named)}"
    missing = [f"{f} ({seen[f]})" for f in ran if f not in named]
    idle = [f for f in named if f not in ran]
    assert not missing, f"{backend}: run by one step and its checkpoint but not in {DOC.name}'s reading path: {missing}"
    assert not idle, f"{backend}: in {DOC.name}'s reading path but not run by one step and its checkpoint: {idle}"
    assert len(path) <= MAX_PATH, f"{backend}: the path has {len(path)} files, more than {MAX_PATH}: {path}"
    assert len(named) <= MAX_ALL, f"{backend}: {len(named)} files run, more than {MAX_ALL}: {named}"
