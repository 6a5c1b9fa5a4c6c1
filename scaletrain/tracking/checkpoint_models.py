"""Which logged-model records a written checkpoint calls for: the bookkeeping behind
:mod:`scaletrain.tracking.models`.

The run's list of checkpoints (``checkpoints.json``, :func:`scaletrain.tracking.journal.checkpoint_list`)
remembers, per checkpoint, the key of its logged model, the validation metrics linked to it, the state its
tags describe (``exists``; ``best-copy``: deleted by ``keep_last`` but kept as ``checkpoints/best``;
``gone``) and whether it is tagged best. :meth:`CheckpointModels.records` compares that with the disk and
the metrics and returns the journal records that bring the models' tags up to date, so each change is sent
once, and a resumed job (which reads the list back) sends nothing twice. No MLflow here: plain dicts.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from scaletrain.tracking.models import BEST_TAG, EXISTS_TAG, PATH_TAG, model_name

__all__ = ["CheckpointModels"]


@dataclass
class CheckpointModels:
    """How a run's checkpoints become logged models: ``prefix`` names them (``<prefix>-step-<N>``),
    ``params`` are each model's params, ``dataset`` (``name``, ``digest``) the corpus the linked metrics were
    measured on; the metrics logged at a checkpoint's step whose keys start with ``linked_prefix`` are linked
    to it; the best checkpoint is the first to reach the best ``best_metric`` (``best_mode`` min or max,
    improving by more than ``min_delta``: the trainer's own rule for ``checkpoints/best``); ``best_dir``
    (``checkpoints/best``) may hold a copy of a checkpoint ``keep_last`` deleted."""

    prefix: str
    params: dict[str, str] = field(default_factory=dict)
    dataset: dict | None = None
    best_metric: str = "valid/nll"
    best_mode: str = "min"
    min_delta: float = 0.0
    linked_prefix: str = "valid/"
    best_dir: Path | None = None

    def records(self, entries: list[dict], new: dict | None, last: Mapping[str, tuple[int, int, float]]) -> list[dict]:
        """Journal records for the checkpoint list ``entries`` (updated in place) after checkpoint ``new``
        (one of ``entries``, None: no new checkpoint) was written; ``last``: each metric's last logged
        (step, timestamp, value)."""
        out: list[dict] = []
        if new is not None:
            out += self._new_model(new, last)
        for e in entries:
            out += self._state_tags(e)
        out += self._best_tags(entries)
        return out

    def _new_model(self, e: dict, last: Mapping[str, tuple[int, int, float]]) -> list[dict]:
        key, step = Path(e["path"]).name, int(e["step"])
        e.update(model=key, state="exists", best=False)
        out = [{"t": "model", "key": key, "step": step, "name": model_name(self.prefix, step), "params": self.params,
                "tags": {PATH_TAG: e["path"], EXISTS_TAG: "true"}}]
        linked = sorted((k, v, ts) for k, (s, ts, v) in last.items() if k.startswith(self.linked_prefix) and s == step)
        e["metrics"] = {k: v for k, v, _ in linked}
        if linked:
            out.append({"t": "model_metrics", "key": key, "s": step, "m": [list(x) for x in linked],
                        "dataset": self.dataset})
        return out

    def _holds_best_copy(self, e: dict) -> bool:
        if self.best_dir is None:
            return False
        try:
            info = json.loads((self.best_dir / "best.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return isinstance(info, dict) and info.get("source") == Path(e["path"]).name

    def _state_tags(self, e: dict) -> list[dict]:
        if "model" not in e:  # listed by a version that made no models
            return []
        state = "exists" if Path(e["path"]).is_dir() else "best-copy" if self._holds_best_copy(e) else "gone"
        if state == e.get("state"):
            return []
        e["state"] = state
        tags = {"exists": {EXISTS_TAG: "true", PATH_TAG: e["path"]},
                "best-copy": {EXISTS_TAG: "true", PATH_TAG: str(self.best_dir)},
                "gone": {EXISTS_TAG: "false"}}[state]
        return [{"t": "model_tags", "key": e["model"], "v": tags}]

    def _best(self, entries: list[dict]) -> dict | None:
        best, value = None, math.nan
        for e in sorted((e for e in entries if "model" in e), key=lambda e: int(e["step"])):
            v = (e.get("metrics") or {}).get(self.best_metric)
            if v is None or math.isnan(float(v)):
                continue
            v = float(v)
            if best is None or (v > value + self.min_delta if self.best_mode == "max" else v < value - self.min_delta):
                best, value = e, v
        return best

    def _best_tags(self, entries: list[dict]) -> list[dict]:
        best = self._best(entries)
        out = []
        for e in entries:
            want = e is best
            if "model" in e and bool(e.get("best")) != want:
                e["best"] = want
                out.append({"t": "model_tags", "key": e["model"], "v": {BEST_TAG: str(want).lower()}})
        return out
