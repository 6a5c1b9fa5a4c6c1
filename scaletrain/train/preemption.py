"""Preemption: SIGTERM, SIGUSR1 or SIGINT ends the job at the next step boundary with a checkpoint.

A cluster scheduler sends SIGTERM to the job's process group (SLURM can send SIGUSR1 ahead of the
kill), a container runtime sends it to PID 1 (``launch.sh`` forwards it to the launcher), Ctrl-C sends
SIGINT; the ``deepspeed`` launcher passes SIGTERM on to the ranks and sends SIGKILL 30 s later.
The handler only records the signal; at each step boundary every rank casts its vote in the step's
all-reduce (:func:`scaletrain.train.unit.train_step`), so all ranks agree on the same step even when
only one of them got the signal. The loop then writes a checkpoint, the MLflow run ends KILLED and the
process exits with :data:`PREEMPTED_EXIT` (75, EX_TEMPFAIL: "try again"); re-running the same command
resumes. Rank 0 also writes ``OUT/preempted.json`` (step, checkpoint, signal): the ``deepspeed``
launcher itself exits 1 when it receives a signal, so ``launch.sh`` reads that file to exit 75 too.
If no step boundary arrives within ``train.preempt_grace_seconds`` of the signal (a stuck
collective, a very long step), the process exits with 128 + the signal number without a checkpoint,
before the launcher's SIGKILL. A second SIGINT interrupts at once (KeyboardInterrupt).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading

log = logging.getLogger("scaletrain")

PREEMPTED_EXIT = 75
PREEMPTED_FILE = "preempted.json"  # OUT/preempted.json: written by rank 0 after the checkpoint, removed at start
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Preemption:
    def __init__(self, grace_seconds: float = 20.0):
        self.grace = grace_seconds
        self.signum: int | None = None
        self._old: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def install(self) -> None:
        """Catch the signals (main thread only; elsewhere, e.g. a test thread, nothing is installed)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            self._old[s] = signal.signal(s, self._on_signal)

    def uninstall(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()
        self.cancel_grace()

    def _on_signal(self, signum, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        first = self.signum is None
        self.signum = signum
        if first:
            print(f"scaletrain: got {signal.Signals(signum).name}: checkpoint at the next step boundary, then exit "
                  f"(within {self.grace:g}s)", file=sys.stderr, flush=True)
            if self.grace > 0:
                self._timer = threading.Timer(self.grace, self._give_up)
                self._timer.daemon = True
                self._timer.start()

    def _give_up(self) -> None:
        print(f"scaletrain: no step boundary within train.preempt_grace_seconds={self.grace:g} after "
              f"{self.signal_name}; exiting without a checkpoint", file=sys.stderr, flush=True)
        os._exit(128 + int(self.signum or signal.SIGTERM))

    def cancel_grace(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
