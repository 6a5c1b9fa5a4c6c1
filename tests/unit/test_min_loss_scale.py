"""fp16's minimum loss scale stops the job with the same one line on both engines: DeepSpeed
raises its own bare Exception at fp16.min_loss_scale, Accelerate's GradScaler has no minimum and would halve its
scale forever. fp16 needs a GPU, so the engines' step() runs here against stand-ins for DeepSpeed's engine and
Accelerate's accelerator/scaler."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scaletrain.engine.ddp_driver import DDPDriver
from scaletrain.engine.deepspeed_driver import DeepSpeedDriver
from scaletrain.errors import ScaletrainError
from scaletrain.parallel import ParallelContext

LINE = r"fp16 loss scale reached its minimum \(1\): the gradients overflow at every scale"


class FakeDS:
    """The parts of a DeepSpeed fp16 engine DeepSpeedDriver.step touches; step() fails as DeepSpeed's
    DynamicLossScaler does when the scale is at its minimum."""
    skipped_steps = 0

    def __init__(self):
        self.optimizer = SimpleNamespace(cur_scale=1.0)
        self.module = torch.nn.Linear(2, 2)

    def fp16_enabled(self):
        return True

    bfloat16_enabled = zero_optimization = fp16_enabled

    def step(self):
        raise Exception("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")


def test_deepspeed_minimum_scale_is_one_line():
    with pytest.raises(ScaletrainError, match=LINE):
        DeepSpeedDriver(FakeDS(), ParallelContext.single()).step()


def _accelerate_engine(scale: float, skipped: bool) -> DDPDriver:
    """The step logic of the Accelerate DDP engine (its driver), without a launcher and process group."""
    model = torch.nn.Linear(2, 2)
    ep = SimpleNamespace(active=False)  # no expert parallelism
    acc = SimpleNamespace(sync_gradients=True, clip_grad_norm_=lambda params, clip: torch.tensor(float("inf")),
                          scaler=SimpleNamespace(get_scale=lambda: scale))
    optimizer = SimpleNamespace(step=lambda: None, step_was_skipped=skipped, zero_grad=lambda set_to_none: None,
                                param_groups=[{"lr": 0.1}])
    scheduler = SimpleNamespace(step=lambda: None)
    return DDPDriver(acc, model, optimizer, scheduler, ep, clip_norm=1.0, grad_accum=1, fp16_min_loss_scale=1.0)


def test_accelerate_minimum_scale_is_the_same_line():
    with pytest.raises(ScaletrainError, match=LINE.replace(r"\(1\)", r"\(0.5\)")):
        _accelerate_engine(0.5, skipped=True).step()
    info = _accelerate_engine(2.0, skipped=True).step()  # an overflow above the minimum: skipped, go on
    assert info.skipped and not info.nonfinite
