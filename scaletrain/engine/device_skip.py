"""Clip and withhold an update on the device: the non-finite check of a training step without a host read.

A NaN/inf gradient gives a non-finite global norm. Reading the norm to decide on the host costs a
blocking device-to-host copy every step (the GPU drains its queue and idles while the host catches up).
Instead the norm's finiteness becomes a device flag that the fused AdamW kernel reads itself: torch's
``found_inf`` argument, the mechanism ``torch.amp.GradScaler`` uses. Where the flag is 1 the kernel
leaves parameters and moments as they are and the optimizer's step count is put back (torch subtracts
the flag from it). Clipping multiplies the gradients by ``min(1, max_norm / (norm + 1e-6))`` on the
device (torch's ``clip_grads_with_norm_``; no ``if`` on a device value). The LR schedule counts only the
updates applied (``engine.optim.UpdateSchedule.advance`` adds ``1 - flag`` on the device), so a withheld update
never moves it and nothing has to be put back.

Only the fused torch Adam/AdamW take the flag (``optim.fused``, the default on CPU and CUDA); with any other
optimizer :func:`can_skip_on_device` is False and the engines read the norm on the host as before.
"""
from __future__ import annotations

import contextlib

import torch


def can_skip_on_device(optimizer) -> bool:
    """The optimizer applies ``found_inf`` itself (fused torch Adam/AdamW)."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and bool(optimizer.defaults.get("fused"))


def grad_norm(params) -> torch.Tensor:
    """The global L2 norm of the gradients of ``params`` as a device tensor (0 when none)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads, foreach=None)


def nonfinite_flag(norm: torch.Tensor) -> torch.Tensor:
    """A float32 scalar: 1.0 where ``norm`` is NaN/inf (the update must be withheld), else 0.0 (the shape of
    the optimizer's step counters, from which torch subtracts it)."""
    return (~torch.isfinite(norm.detach())).float().reshape(())


def clip_(params, max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients to at most ``max_norm`` given their global ``norm`` (on the device)."""
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, norm)


@contextlib.contextmanager
def withheld_if(optimizer, flag: torch.Tensor):
    """Inside, ``optimizer.step()`` leaves everything unchanged where ``flag`` is 1 (``can_skip_on_device``)."""
    device = next((p.device for g in optimizer.param_groups for p in g["params"]), flag.device)
    optimizer.found_inf = flag.to(device)  # an offloaded optimizer (CPU parameters): one copy, blocking
    try:
        yield
    finally:
        del optimizer.found_inf

