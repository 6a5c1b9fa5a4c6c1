"""The one training loop against the Engine, in-process over a minimal backend (fast).

fp16 overflow steps are GPU-only in practice; here an engine reports some updates as skipped (as
DeepSpeed's dynamic loss scaler does) and the loop must count them in the log, the metrics and the
checkpoint.
"""
from __future__ import annotations

import json
import logging

import torch

from helpers import local_backend_class, tiny_model
from scaletrain.config import load_config
from scaletrain.engine import Engine

TINY = [*tiny_model(), "data.max_bytes=40", "data.max_tokens=600", "train.log_every=2",
        "train.valid_every=0", "train.valid_max_batches=1", "train.save_every=0", "tracking.enabled=false",
        "train.max_steps=6"]


class SkippingEngine(Engine):
    """The real Engine, world of one, over a backend that drops the updates listed in ``skip`` like an fp16
    overflow (no update, no LR step)."""

    def __init__(self, cfg, skip=(2, 3)):
        super().__init__(cfg, local_backend_class()(skip=skip))

    @property
    def updates(self) -> int:
        return self.backend.updates


def test_skipped_updates_are_counted_in_log_metrics_and_checkpoint(django_shards, tmp_path, caplog):
    from scaletrain.train import Trainer

    cfg = load_config("small", [*TINY, f"data.shards={django_shards}", f"train.out_dir={tmp_path}"])
    trainer = Trainer(cfg, engine=SkippingEngine(cfg))
    before = {k: v.clone() for k, v in trainer.engine.module.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="scaletrain"):
        res = trainer.fit()
    trainer.close()
    assert res.steps == 6 and trainer.state.skipped_steps == 2
    lines = [r.getMessage() for r in caplog.records if "| loss" in r.getMessage()]
    assert len(lines) == 3
    # log every 2 updates; updates 2 and 3 were skipped
    assert "skipped 1 (fp16 overflow; 1 in all)" in lines[0]
    assert "skipped 1 (fp16 overflow; 2 in all)" in lines[1]
    assert "skipped" not in lines[2]
    state = json.loads((tmp_path / "checkpoints" / "step-0000006" / "trainer_state.json").read_text())
    assert state["skipped_steps"] == 2
    # 4 real updates happened (the LR schedule advanced 4 times, not 6)
    assert trainer.engine.schedule.applied == 4
    assert any(not torch.equal(before[k], v) for k, v in trainer.engine.module.state_dict().items())


def test_wall_clock_budget_counts_across_resumes(django_shards, tmp_path):
    """train.max_minutes is a budget for the whole job: a resume does not get a fresh one."""
    from scaletrain.train import Trainer

    over = [*TINY, f"data.shards={django_shards}", f"train.out_dir={tmp_path}", "train.max_steps=4"]
    first = Trainer(load_config("small", over), engine=SkippingEngine(load_config("small", over), skip=()))
    res = first.fit()
    first.close()
    assert res.steps == 4 and res.train_seconds > 0
    saved = json.loads((tmp_path / "checkpoints" / "step-0000004" / "trainer_state.json").read_text())
    assert saved["train_seconds"] == res.train_seconds
    # the budget is half of what the first session already used: the resumed job must not train at all
    budget = res.train_seconds / 2 / 60
    over2 = [*over, "train.max_steps=8", "train.resume=true", f"train.max_minutes={budget}"]
    second = Trainer(load_config("small", over2), engine=SkippingEngine(load_config("small", over2), skip=()))
    res2 = second.fit()
    second.close()
    assert res2.steps == 4 and second.engine.updates == 0
    assert res2.train_seconds >= res.train_seconds
    # without a budget the resumed job continues its counters from the checkpoint
    over3 = [*over, "train.max_steps=6", "train.resume=true", "train.max_minutes=0"]
    third = Trainer(load_config("small", over3), engine=SkippingEngine(load_config("small", over3), skip=()))
    res3 = third.fit()
    third.close()
    assert res3.steps == 6 and third.engine.updates == 2
    assert res3.tokens > res.tokens and third.state.examples_seen > saved["examples_seen"]


def test_train_state_round_trip():
    from scaletrain.train import TrainState

    st = TrainState(step=7, tokens_seen=100, examples_seen=9, skipped_steps=1, train_seconds=3.5,
                    valid_history=[(0, 6.2), (7, 4.1)], best={"metric": "valid/nll"}, run_id="abc")
    back = TrainState()
    back.load_state_dict(json.loads(json.dumps(st.state_dict())))
    assert back == st
