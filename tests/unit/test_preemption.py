"""Preemption, in-process: a signal during step k stops the loop at the next step
boundary with a checkpoint of step k, the tracker's run ends KILLED, the command exits 75, and running
again resumes; no step boundary within the grace period exits 128+signal."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from helpers import ROOT
from scaletrain.config import load_config
from scaletrain.train.preemption import PREEMPTED_EXIT
from test_engine_loop import TINY, SkippingEngine


class SignallingEngine(SkippingEngine):
    """Sends ``signum`` to its own process during update number ``at``."""

    def __init__(self, cfg, signum=None, at=3):
        super().__init__(cfg, skip=())
        self.signum, self.at = signum, at

    def step(self):
        info = super().step()
        if self.signum is not None and self.updates == self.at:
            os.kill(os.getpid(), self.signum)
        return info


class Recorder:
    def __init__(self, inner):
        self.inner, self.ended = inner, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def end(self, status="FINISHED"):
        self.ended = status
        self.inner.end(status)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_signal_checkpoints_at_the_next_step_and_resume_continues(django_shards, tmp_path, signum):
    from scaletrain.train import Trainer

    over = [*TINY, f"data.shards={django_shards}", f"train.out_dir={tmp_path}", "train.max_steps=6"]
    cfg = load_config("small", over)
    t = Trainer(cfg, engine=SignallingEngine(cfg, signum, at=3))
    t.tracker = Recorder(t.tracker)
    before = signal.getsignal(signum)
    res = t.fit()
    t.close()
    assert res.preempted and res.steps == 3 and t.engine.updates == 3
    assert t.tracker.ended == "KILLED"
    assert res.final_checkpoint.endswith("step-0000003") and (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-0000003"
    assert signal.getsignal(signum) is before  # handlers restored
    t2 = Trainer(cfg, engine=SignallingEngine(cfg))
    res2 = t2.fit()
    t2.close()
    assert not res2.preempted and res2.steps == 6 and t2.engine.updates == 3


def test_train_command_exits_75(django_shards, tmp_path, monkeypatch):
    import scaletrain.train as tr
    from scaletrain.cli import main

    real = tr.Trainer

    def trainer(cfg):
        return real(cfg, engine=SignallingEngine(cfg, signal.SIGTERM, at=2))

    monkeypatch.setattr(tr.trainer, "Trainer", trainer)
    over = [*TINY, f"data.shards={django_shards}", f"train.out_dir={tmp_path}", "train.max_steps=6"]
    assert main(["train", "--config", "small", *over]) == PREEMPTED_EXIT
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-0000002"


def test_no_step_boundary_within_the_grace_exits_128_plus_signal():
    code = ("import os, signal, time\n"
            "from scaletrain.train.preemption import Preemption\n"
            "p = Preemption(grace_seconds=0.5); p.install()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(30)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and "exiting without a checkpoint" in p.stderr
