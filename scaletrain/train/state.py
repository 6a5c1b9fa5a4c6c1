"""Every counter of a training job in one object that the checkpoint saves (OLMo's trainer state).

``train_seconds`` is the wall-clock time of the training loop summed over every session of the job,
so ``train.max_minutes`` is a budget for the whole job, not for each resume, and
``train.save_every_minutes`` counts the same clock: ``last_save_seconds`` (its value at the last
checkpoint) is saved too, so a job resumed after 25 of its 30 minutes saves 5 minutes later.
``nonfinite_steps``/``nonfinite_run`` count updates skipped for a non-finite gradient (all of them,
and the current consecutive run; ``train.nonfinite``); ``oom_steps`` those withheld because a batch ran
out of device memory (``train.on_oom=skip``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class TrainState:
    step: int = 0  # optimizer updates attempted (skipped fp16-overflow updates included)
    tokens_seen: int = 0  # target tokens, all ranks
    examples_seen: int = 0  # sentence pairs, this rank
    skipped_steps: int = 0  # fp16 overflow: updates the engine skipped (loss scale lowered)
    train_seconds: float = 0.0  # training-loop wall time, all sessions of the job
    last_save_seconds: float = 0.0  # train_seconds when the last checkpoint was written
    nonfinite_steps: int = 0  # updates skipped for a non-finite loss/gradient (train.nonfinite=skip)
    nonfinite_run: int = 0  # ... of them in a row up to the last update (train.max_nonfinite)
    oom_steps: int = 0  # updates withheld because a batch ran out of device memory (train.on_oom=skip)
    valid_history: list[tuple[int, float]] = field(default_factory=list)  # (step, valid nll)
    best: dict | None = None  # the best-checkpoint tracker's state (metric, best value/step, patience count)
    run_id: str | None = None  # the MLflow run of the job
    init_from: dict | None = None  # train.init_from: the checkpoint whose weights the job started from (warm_start)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "tokens_seen": self.tokens_seen, "examples_seen": self.examples_seen,
            "skipped_steps": self.skipped_steps, "train_seconds": self.train_seconds,
            "last_save_seconds": self.last_save_seconds, "nonfinite_steps": self.nonfinite_steps,
            "nonfinite_run": self.nonfinite_run, "oom_steps": self.oom_steps,
            "valid_history": [list(v) for v in self.valid_history], "best": self.best, "run_id": self.run_id,
            "init_from": self.init_from,
        }

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.step = int(st["step"])
        self.tokens_seen = int(st["tokens_seen"])
        self.examples_seen = int(st["examples_seen"])
        self.skipped_steps = int(st.get("skipped_steps", 0))
        self.train_seconds = float(st.get("train_seconds", 0.0))
        self.last_save_seconds = float(st.get("last_save_seconds", 0.0))
        self.nonfinite_steps = int(st.get("nonfinite_steps", 0))
        self.nonfinite_run = int(st.get("nonfinite_run", 0))
        self.oom_steps = int(st.get("oom_steps", 0))
        self.valid_history = [(int(s), float(v)) for s, v in st.get("valid_history", [])]
        self.best = st.get("best")
        self.run_id = st.get("run_id")
        self.init_from = st.get("init_from")


class TrainClock:
    """Keeps ``state.train_seconds`` current: the job's earlier sessions plus this one's loop time.
    ``now``: the time source (seconds; tests pass a fake one)."""

    def __init__(self, state: TrainState, now: Callable[[], float] = time.time):
        self.state = state
        self.now = now
        self._t0 = now()
        self._base = state.train_seconds

    def start(self) -> None:
        self._t0 = self.now()
        self._base = self.state.train_seconds

    def tick(self) -> float:
        self.state.train_seconds = self._base + (self.now() - self._t0)
        return self.state.train_seconds

    def session_seconds(self) -> float:
        return self.now() - self._t0


class SaveTimer:
    """``train.save_every_minutes`` of training-loop time (all sessions; 0 = off). Only rank 0's clock
    decides: its vote rides on the step's all-reduce (:func:`scaletrain.train.unit.train_step`), so
    every rank saves after the same step whatever its own clock says."""

    def __init__(self, every_minutes: float, state: TrainState):
        self.every = every_minutes * 60.0
        self.state = state

    def due(self) -> bool:
        return self.every > 0 and self.state.train_seconds - self.state.last_save_seconds >= self.every

    def saved(self) -> None:
        """Call when a checkpoint's contents are taken: the interval restarts (and is saved with them)."""
        self.state.last_save_seconds = self.state.train_seconds


class TimeBudget:
    """``train.max_minutes`` over the whole job (0 = none)."""

    def __init__(self, max_minutes: float, state: TrainState):
        self.limit = max_minutes * 60.0
        self.state = state

    def exceeded(self) -> bool:
        return self.limit > 0 and self.state.train_seconds > self.limit

    def left(self) -> float:
        return max(0.0, self.limit - self.state.train_seconds) if self.limit > 0 else float("inf")
