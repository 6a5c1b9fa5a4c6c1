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

The bare ``deepspeed`` runner on one node does not forward signals: a SIGTERM to it alone (what a
container runtime sends to PID 1 when the user runs ``deepspeed ... -m scaletrain train`` as the
container's command) kills it and leaves DeepSpeed's ``launch.py`` and the ranks running. So each rank
started by DeepSpeed's launcher watches its launcher chain (:class:`LauncherWatch`: the launcher, and the
runner above it) once a second; when either is gone, or the rank was re-parented, the rank records a
SIGTERM as if it had received one, and the job checkpoints and exits 75 as above.
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


# DeepSpeed's per-node launcher (the ranks' parent); launch.sh runs it in-process for one node via the second
LAUNCHER_MODULES = ("deepspeed.launcher.launch", "scaletrain.engine.launch")


class LauncherWatch:
    """Calls ``on_gone(what)`` once when this rank's launcher chain breaks: its parent is DeepSpeed's
    ``launch.py`` and that process, or the ``deepspeed`` runner above it, is gone (or this rank or the
    launcher was re-parented). Nothing is watched outside DeepSpeed's launcher."""

    def __init__(self, on_gone, interval: float = 1.0):
        self.on_gone, self.interval = on_gone, interval
        self._stop = threading.Event()
        self.chain = self._chain()

    @staticmethod
    def _chain() -> list:
        import psutil

        try:
            me = psutil.Process()
            parent = me.parent()
            if parent is None or not any(m in " ".join(parent.cmdline()) for m in LAUNCHER_MODULES):
                return []
            runner = parent.parent()
            if runner is not None and runner.pid != 1 and "deepspeed" in " ".join(runner.cmdline()):
                return [me, parent, runner]
            return [me, parent]
        except psutil.Error:
            return []

    def broken(self) -> str | None:
        """What is gone, or None while the chain is intact."""
        import psutil

        for child, parent in zip(self.chain, self.chain[1:]):
            name = "deepspeed launcher" if parent is self.chain[1] else "deepspeed runner"
            try:
                gone = child.ppid() != parent.pid or parent.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                return f"the {name} (pid {parent.pid}) is gone"
        return None

    def start(self) -> None:
        if len(self.chain) < 2:
            return
        threading.Thread(target=self._run, name="scaletrain-launcher-watch", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            what = self.broken()
            if what:
                self.on_gone(what)
                return

    def stop(self) -> None:
        self._stop.set()


class Preemption:
    def __init__(self, grace_seconds: float = 20.0):
        self.grace = grace_seconds
        self.signum: int | None = None
        self._old: dict[int, object] = {}
        self._timer: threading.Timer | None = None
        self._watch: LauncherWatch | None = None

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
        self._watch = LauncherWatch(self._launcher_gone)
        self._watch.start()

    def uninstall(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        self.cancel_grace()

    def _launcher_gone(self, what: str) -> None:
        """The bare runner got the SIGTERM meant for the job (it does not forward it): act as if we had."""
        if self.signum is None:
            print(f"scaletrain: {what}; treating it as SIGTERM", file=sys.stderr, flush=True)
            self._on_signal(signal.SIGTERM, None)

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
