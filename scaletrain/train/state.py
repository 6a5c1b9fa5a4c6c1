"""Every counter of a training job in one object that the checkpoint saves (OLMo's trainer state).

``train_seconds`` is the wall-clock time of the training loop summed over every session of the job,
so ``train.max_minutes`` is a budget for the whole job, not for each resume.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    step: int = 0  # optimizer updates attempted (skipped fp16-overflow updates included)
    tokens_seen: int = 0  # target tokens, all ranks
    examples_seen: int = 0  # sentence pairs, this rank
    skipped_steps: int = 0  # fp16 overflow: updates the engine skipped (loss scale lowered)
    train_seconds: float = 0.0  # training-loop wall time, all sessions of the job
    valid_history: list[tuple[int, float]] = field(default_factory=list)  # (step, valid nll)
    best: dict | None = None  # the best-checkpoint tracker's state (metric, best value/step, patience count)
    run_id: str | None = None  # the MLflow run of the job

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "tokens_seen": self.tokens_seen, "examples_seen": self.examples_seen,
            "skipped_steps": self.skipped_steps, "train_seconds": self.train_seconds,
            "valid_history": [list(v) for v in self.valid_history], "best": self.best, "run_id": self.run_id,
        }

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.step = int(st["step"])
        self.tokens_seen = int(st["tokens_seen"])
        self.examples_seen = int(st["examples_seen"])
        self.skipped_steps = int(st.get("skipped_steps", 0))
        self.train_seconds = float(st.get("train_seconds", 0.0))
        self.valid_history = [(int(s), float(v)) for s, v in st.get("valid_history", [])]
        self.best = st.get("best")
        self.run_id = st.get("run_id")


class TrainClock:
    """Keeps ``state.train_seconds`` current: the job's earlier sessions plus this one's loop time."""

    def __init__(self, state: TrainState):
        self.state = state
        self._t0 = time.time()
        self._base = state.train_seconds

    def start(self) -> None:
        self._t0 = time.time()
        self._base = self.state.train_seconds

    def tick(self) -> float:
        self.state.train_seconds = self._base + (time.time() - self._t0)
        return self.state.train_seconds

    def session_seconds(self) -> float:
        return time.time() - self._t0


class TimeBudget:
    """``train.max_minutes`` over the whole job (0 = none)."""

    def __init__(self, max_minutes: float, state: TrainState):
        self.limit = max_minutes * 60.0
        self.state = state

    def exceeded(self) -> bool:
        return self.limit > 0 and self.state.train_seconds > self.limit

    def left(self) -> float:
        return max(0.0, self.limit - self.state.train_seconds) if self.limit > 0 else float("inf")
