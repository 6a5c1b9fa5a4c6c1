"""Time-based checkpoints (``train.save_every_minutes``): with a fake clock that moves 25 s per
update, a 1-minute interval saves at the steps the job's training time says, counted across a resume; only
rank 0's clock decides and every rank learns the decision from the step's one all-reduce."""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from scaletrain.config import load_config
from scaletrain.engine import StepInfo
from scaletrain.train.unit import train_step
from test_engine_loop import TINY, SkippingEngine

STEP_SECONDS = 25.0


class TimedEngine(SkippingEngine):
    """Each update takes STEP_SECONDS of a fake clock (``now``), no update skipped."""

    def __init__(self, cfg):
        super().__init__(cfg, skip=())
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    def step(self):
        self.t += STEP_SECONDS
        return super().step()


def _trainer(shards, out, steps):
    from scaletrain.train import Trainer

    cfg = load_config("small", [*TINY, f"data.shards={shards}", f"train.out_dir={out}", f"train.max_steps={steps}",
                                "train.save_every=0", "train.save_every_minutes=1", "train.keep_last=0",
                                "train.resume=true"])
    eng = TimedEngine(cfg)
    trainer = Trainer(cfg, engine=eng)
    trainer.clock.now = eng.now
    return trainer


def _saved_steps(out):
    return sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))


def test_saves_follow_the_training_clock_across_a_resume(django_shards, tmp_path):
    # after update k the loop clock reads 25k s; the vote before update k sees 25(k-1) s, so the first save is
    # after update 4 (75 s since the last save at 0 s: >= 60)
    first = _trainer(django_shards, tmp_path, 5)
    first.fit()
    first.close()
    assert _saved_steps(tmp_path) == [4, 5]  # 4: time; 5: the end of this session
    state = json.loads((tmp_path / "checkpoints" / "step-0000005" / "trainer_state.json").read_text())
    assert state["train_seconds"] == 125.0 and state["last_save_seconds"] == 125.0
    # the resumed session continues the job's clock (125 s) and the interval from the save at 125 s:
    # the vote before update k sees 125 + 25(k-6) s, >= 185 first at k = 9
    second = _trainer(django_shards, tmp_path, 11)
    second.fit()
    second.close()
    assert _saved_steps(tmp_path) == [4, 5, 9, 11]


class RankOneEngine:
    """Rank 1 of 2 whose all-reduce adds rank 0's votes: rank 0's timer said save, this rank's did not."""
    world_size, rank, device = 2, 1, torch.device("cpu")

    @property
    def parallel(self):  # the collectives of its parallel context
        return self

    def all_reduce_sum(self, values):
        rank0 = [values[0], 0.0, values[2], 0.0, 1.0]  # same tokens, no stop/preempt, a save vote
        return [float(a + b) for a, b in zip(values, rank0)]

    def backward(self, loss):
        pass

    def step(self):
        return StepInfo(grad_norm=1.0, lr=0.1)


def test_a_rank_without_the_vote_learns_the_save_from_the_all_reduce():
    unit = SimpleNamespace(loss=lambda b: (torch.tensor(1.0), torch.tensor(1.0), torch.tensor(3)))
    b = SimpleNamespace(n_tgt_tokens=3, n_src_tokens=4, size=1, to=lambda device: b)
    out = train_step(RankOneEngine(), unit, [b], stop_vote=False, save_vote=False)
    assert out.save_due
