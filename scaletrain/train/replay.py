"""Metrics of re-done steps are not logged twice.

A job that crashed (kill -9, a dead rank) resumes from its last checkpoint and trains again the steps after
it, which the crashed session had already logged (and, through the tracking journal, sent). The resume is
bit-identical, so those steps' values are the ones already in MLflow: :class:`ReplayFilter` wraps the
tracker and drops metrics at steps up to the last step the journal (``OUT/tracking/journal.jsonl``)
recorded before this session, so every step's metrics are in the run exactly once.
"""
from __future__ import annotations

import logging
from pathlib import Path

from scaletrain.tracking import last_logged_step

log = logging.getLogger("scaletrain")


class ReplayFilter:
    """The tracker, except that ``log_metrics`` at a step <= ``until`` (already logged) does nothing."""

    def __init__(self, tracker):
        self._tracker = tracker
        self.until = -1

    def __getattr__(self, name):
        return getattr(self._tracker, name)

    def __setattr__(self, name, value):  # settings (e.g. flush_every) belong to the tracker
        if name in ("_tracker", "until"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._tracker, name, value)

    def replaying_until(self, journal: Path, resumed_step: int) -> None:
        """Call after resuming at ``resumed_step``: steps up to the journal's last one are re-done, not new."""
        last = last_logged_step(journal)
        if last > resumed_step:
            self.until = last
            if self._tracker.is_main:
                log.info("steps %d-%d were logged before the restart: their metrics are not logged again",
                         resumed_step + 1, last)

    def log_metrics(self, metrics, step: int) -> None:
        if step <= self.until:
            return
        self._tracker.log_metrics(metrics, step=step)
