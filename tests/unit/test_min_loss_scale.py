"""fp16's minimum loss scale stops the job with the same one line on both engines: DeepSpeed
raises its own bare Exception at fp16.min_loss_scale, Accelerate's GradScaler has no minimum and would halve its
scale forever. fp16 needs a GPU, so the backends' update runs here against stand-ins for DeepSpeed's engine and
Accelerate's accelerator/scaler."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scaletrain.engine.ddp_backend import DDPBackend
from scaletrain.engine.deepspeed_backend import DeepSpeedBackend
from scaletrain.errors import ScaletrainError

LINE = r"fp16 loss scale reached its minimum \(1\): the gradients overflow at every scale"


class FakeDS:
    """The parts of a DeepSpeed fp16 engine DeepSpeedBackend.update touches; step() fails as DeepSpeed's
    DynamicLossScaler does when the scale is at its minimum."""
    skipped_steps = 0

    def __init__(self):
        self.optimizer = SimpleNamespace(cur_scale=1.0)
        self.module = torch.nn.Linear(2, 2)

    def fp16_enabled(self):
        return True

    def step(self):
        raise Exception("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")


def test_deepspeed_minimum_scale_is_one_line():
    b = DeepSpeedBackend()
    b.e = FakeDS()
    with pytest.raises(ScaletrainError, match=LINE):
        b.update()


def _accelerate_backend(scale: float, skipped: bool) -> DDPBackend:
    """The update of the Accelerate DDP backend, without a launcher and process group."""
    b = DDPBackend()
    b.acc = SimpleNamespace(scaler=SimpleNamespace(get_scale=lambda: scale))
    b.wrapped_optimizer = SimpleNamespace(step=lambda: None, step_was_skipped=skipped,
                                          zero_grad=lambda set_to_none: None)
    b.fp16_min_loss_scale = 1.0
    return b


def test_accelerate_minimum_scale_is_the_same_line():
    with pytest.raises(ScaletrainError, match=LINE.replace(r"\(1\)", r"\(0.5\)")):
        _accelerate_backend(0.5, skipped=True).update()
    assert _accelerate_backend(2.0, skipped=True).update() == (True, None)  # an overflow above the minimum: go on
