"""The engine seam: both engines hand the step API to a driver (``scaletrain.engine.driver``).

Both drivers provide every member of the ``Driver`` protocol; ``DrivenEngine`` forwards each of them to
its driver and returns what the driver returns; the two engine classes only start the run, wrap the
model and choose a driver (no step API of their own to drift apart).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain.engine.accelerate_engine import AccelerateEngine
from scaletrain.engine.ddp_driver import DDPDriver
from scaletrain.engine.deepspeed_driver import DeepSpeedDriver
from scaletrain.engine.deepspeed_engine import DeepSpeedEngine
from scaletrain.engine.driver import DrivenEngine, Driver

MEMBERS = sorted(n for n in vars(Driver) if not n.startswith("_"))
PROPERTIES = {n for n in MEMBERS if isinstance(vars(Driver)[n], property)}


def test_the_protocol_is_the_whole_step_api():
    assert set(MEMBERS) == {"module", "zero_stage", "train", "forward", "backward", "step", "abandon_step", "lr",
                            "loss_scale", "partitioned", "full_state_dict", "save", "load"}


@pytest.mark.parametrize("driver", [DeepSpeedDriver, DDPDriver])
def test_each_driver_has_every_member(driver):
    missing = [n for n in MEMBERS if not hasattr(driver, n)]
    assert not missing, f"{driver.__name__} lacks {missing}"
    kinds = {n for n in MEMBERS if isinstance(getattr(driver, n), property)}
    assert kinds == PROPERTIES, f"{driver.__name__}: properties {sorted(kinds)} != {sorted(PROPERTIES)}"


class Recorder:
    """A driver that records each call and answers with the member's name."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if name in PROPERTIES:
            self.calls.append((name, ()))
            return f"<{name}>"

        def call(*args):
            self.calls.append((name, args))
            return f"<{name}>"

        return call


@pytest.mark.parametrize("name", MEMBERS)
def test_driven_engine_forwards_every_member(name):
    eng = object.__new__(DeepSpeedEngine)  # no launcher, no process group: the forwarding only
    eng.driver = rec = Recorder()
    args = {"train": (False,), "forward": ("src", "tgt", False), "backward": ("loss",), "abandon_step": (1,),
            "save": (Path("d"), "t"), "load": (Path("d"), "t")}.get(name, ())
    got = getattr(eng, name) if name in PROPERTIES else getattr(eng, name)(*args)
    assert got == f"<{name}>" or (name in ("train", "backward", "abandon_step", "save", "load") and got is None)
    assert rec.calls == [(name, args)]


@pytest.mark.parametrize("engine", [DeepSpeedEngine, AccelerateEngine])
def test_engines_only_start_wrap_and_choose_a_driver(engine):
    assert issubclass(engine, DrivenEngine)
    own = {n for n in vars(engine) if not n.startswith("_")}
    assert not own & set(MEMBERS), f"{engine.__name__} defines step API itself: {sorted(own & set(MEMBERS))}"
    assert own <= {"setup"}, own
