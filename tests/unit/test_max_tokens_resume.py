"""``data.max_tokens: auto`` resolves from the device's memory and precision (``scaletrain.models.memory``); the data
stream resumes exactly only with the budget it planned its batches with. So each checkpoint records the resolved
budget (``trainer_state.json``'s ``max_tokens``) and a resume keeps it on another device: silently where it fits
this device's estimate (one info line), with one warning line naming what to do where it does not.

In-process over the real Engine with a minimal backend; the device's memory is faked
(``memory.device_memory``): for the tiny fp32 model 1.35 GiB gives 2304 tokens, 1.36 GiB 3584, 1.345 GiB 1536."""
from __future__ import annotations

import json
import logging
import shutil

import pytest

from scaletrain.config import load_config
from scaletrain.models import memory
from test_checkpoint_compat import _fit  # one trainer run, then closed
from test_engine_loop import TINY, SkippingEngine

GiB = 2**30
pytestmark = pytest.mark.usefixtures("isolated_env")


def _trainer(shards, out, monkeypatch, gib: float, *over):
    from scaletrain.train import Trainer

    monkeypatch.setattr(memory, "device_memory", lambda device: int(gib * GiB))
    cfg = load_config("small", [*TINY, "data.max_tokens=auto", "engine.precision=fp32", f"data.shards={shards}",
                                f"train.out_dir={out}", "train.resume=true", *over])
    return Trainer(cfg, engine=SkippingEngine(cfg, skip=()))


def test_a_resume_on_another_device_keeps_the_checkpoints_budget(django_shards, tmp_path, monkeypatch, caplog):
    first = _trainer(django_shards, tmp_path / "run", monkeypatch, 1.35, "train.max_steps=2")
    assert first.cfg.data.max_tokens == 2304
    _fit(first)
    ckpt = tmp_path / "run" / "checkpoints" / "step-0000002"
    assert json.loads((ckpt / "trainer_state.json").read_text())["max_tokens"] == 2304
    full = _fit(_trainer(django_shards, tmp_path / "full", monkeypatch, 1.35, "train.max_steps=4"))
    for gib, estimate, fits in ((1.36, 3584, True), (1.345, 1536, False)):
        run = tmp_path / f"on{gib}"
        shutil.copytree(tmp_path / "run", run)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="scaletrain"):
            t = _trainer(django_shards, run, monkeypatch, gib, "train.max_steps=4")
            assert t.cfg.data.max_tokens == 2304, gib
            why = t.cfg.data.max_tokens_auto
            assert why.startswith(f"2304: the resumed checkpoint's budget (this device's estimate {estimate}: ") \
                and " GiB device, fp32: " in why, why
            res = _fit(t)
        # the stream resumed where it stood: the same batches as the uninterrupted run at 2304 tokens
        assert (res.steps, res.tokens) == (4, full.tokens), (gib, res.tokens, full.tokens)
        said = [r for r in caplog.records if "data.max_tokens=auto" in r.getMessage()]
        assert len(said) == 1 and "\n" not in said[0].getMessage(), [r.getMessage() for r in said]
        assert said[0].levelno == (logging.INFO if fits else logging.WARNING)
        if not fits:
            assert (f"the checkpoint's 2304 tokens per micro-batch exceed this device's estimate of {estimate}"
                    in said[0].getMessage() and "engine.activation_checkpointing=true" in said[0].getMessage())
        last = run / "checkpoints" / "step-0000004"
        assert json.loads((last / "trainer_state.json").read_text())["max_tokens"] == 2304
        assert "max_tokens: 2304\n" in (last / "config.yaml").read_text()


def test_a_resume_on_the_same_device_says_nothing_and_a_number_is_kept(django_shards, tmp_path, monkeypatch, caplog):
    """The same estimate: no line. A number set by hand is the run's (a checkpoint's budget is not looked at: the
    stream refuses a changed one with its own line)."""
    _fit(_trainer(django_shards, tmp_path, monkeypatch, 1.35, "train.max_steps=2"))
    with caplog.at_level(logging.INFO, logger="scaletrain"):
        t = _trainer(django_shards, tmp_path, monkeypatch, 1.35, "train.max_steps=3")
        t.close()
        fixed = _trainer(django_shards, tmp_path, monkeypatch, 1.36, "train.max_steps=3", "data.max_tokens=600")
        fixed.close()
    assert t.cfg.data.max_tokens == 2304 and fixed.cfg.data.max_tokens == 600
    assert not [r for r in caplog.records if "data.max_tokens=auto" in r.getMessage()]
