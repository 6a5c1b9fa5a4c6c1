"""Optimizer and LR schedule, built the same way for every backend (so checkpoints and runs agree).

Clipping and withholding an update on the device (:func:`grad_norm`, :func:`clip_`, :func:`nonfinite_flag`,
:func:`withheld_if`): the non-finite check of a training step without a host read.

A NaN/inf gradient gives a non-finite global norm. Reading the norm to decide on the host costs a
blocking device-to-host copy every step (the GPU drains its queue and idles while the host catches up).
Instead the norm's finiteness becomes a device flag that the fused AdamW kernel reads itself: torch's
``found_inf`` argument, the mechanism ``torch.amp.GradScaler`` uses. Where the flag is 1 the kernel
leaves parameters and moments as they are and the optimizer's step count is put back (torch subtracts
the flag from it). Clipping multiplies the gradients by ``min(1, max_norm / (norm + 1e-6))`` on the
device (torch's ``clip_grads_with_norm_``; no ``if`` on a device value). The LR schedule counts only the
updates applied (:meth:`UpdateSchedule.advance` adds ``1 - flag`` on the device), so a withheld update
never moves it and nothing has to be put back.

Only the fused torch Adam/AdamW take the flag (``optim.fused``, the default on CPU and CUDA); with any other
optimizer :func:`can_skip_on_device` is False and the engines read the norm on the host as before.
"""
from __future__ import annotations

import contextlib
import math

import torch


def inverse_sqrt_factor(lr: float, warmup: int, warmup_init_lr: float):
    """The factor of ``lr`` for the update after ``i`` applied ones: update number k = i + 1 runs at
    fairseq's lr(k) = init + (lr - init) * k / warmup for k < warmup, lr * sqrt(warmup / k) after.
    ``i``: a number, or a float64 tensor (the same IEEE operations, so the same values)."""

    def f(i):
        k = i + 1
        if torch.is_tensor(k):
            warm = (warmup_init_lr + (lr - warmup_init_lr) * k / max(warmup, 1)) / lr
            return torch.where(k < warmup, warm, torch.sqrt(torch.full_like(k, float(max(warmup, 1))) / k))
        if warmup > 0 and k < warmup:
            return (warmup_init_lr + (lr - warmup_init_lr) * k / warmup) / lr
        return math.sqrt(max(warmup, 1) / k)

    return f


class UpdateSchedule:
    """The learning rate of each update, keyed on the updates *applied* before it (``optim.lr``,
    ``warmup_steps``, ``warmup_init_lr``: :func:`inverse_sqrt_factor`), written into the optimizer's
    parameter groups before the update that uses it; never rewound.

    An update can be withheld after the fact: fp16's loss scaler skips an overflow, and a non-finite gradient
    is withheld by the fused AdamW on the device (:func:`withheld_if` below), where the host learns of it only when
    the step's values are read, steps later. So the count of applied updates is kept where the decision is:
    :meth:`advance` adds ``1 - withheld`` to it after each update, ``withheld`` a host bool or the update's
    device flag. Where updates may be withheld on the device (:meth:`on_device`) the count, and the LR the
    fused AdamW reads, are device tensors (the LR one per parameter device: float64 on CPU, whose fused kernel
    reads it as a double, float32 on CUDA, whose kernel reads a float): the next LR follows from the flag
    without a host read, so an update after a withheld one runs at the same LR whenever the host reads the
    flag (log_every changes nothing). Elsewhere the LR is a Python float (torch's other optimizers do not
    take a tensor LR).

    The count is the schedule's whole state (:meth:`state_dict`, in each checkpoint's ``engine.json``); a
    checkpoint of a ``LambdaLR`` (``last_epoch``: also the updates applied, once every skip is known) is read
    as one (:meth:`load_state_dict`).
    """

    def __init__(self, optimizer, lr: float, warmup: int, warmup_init_lr: float):
        self.optimizer, self.base = optimizer, float(lr)
        self.factor = inverse_sqrt_factor(lr, warmup, warmup_init_lr)
        self.applied: int | torch.Tensor = 0  # updates applied so far: a number, or a float64 device tensor
        self._holders: dict[torch.device, torch.Tensor] = {}  # the LR the fused kernels read, per device
        self.install()

    @property
    def tensor_lr(self) -> bool:
        """The count and the LR are device tensors (:meth:`on_device`)."""
        return torch.is_tensor(self.applied)

    def on_device(self, device: torch.device) -> None:
        """Count on ``device`` and hand the optimizer tensor LRs (updates may be withheld on the device)."""
        self.applied = torch.tensor(float(self.applied), dtype=torch.float64, device=device)
        self.install()

    def next_lr(self):
        """The LR of the next update: a float64 tensor where the count is one, else a number."""
        return self.base * self.factor(self.applied)

    def install(self) -> None:
        """Write the LR of the next update into every parameter group (again after the optimizer loaded a
        state dict, which replaces the groups' values)."""
        lr = self.next_lr()
        for g in self.optimizer.param_groups:
            if not torch.is_tensor(lr):
                g["lr"] = lr
                continue
            device = g["params"][0].device if g["params"] else lr.device
            holder = self._holders.get(device)
            if holder is None:
                dtype = torch.float32 if device.type == "cuda" else torch.float64
                holder = self._holders[device] = torch.zeros((), dtype=dtype, device=device)
            holder.copy_(lr)  # another device (an offloaded optimizer's CPU copy): one copy, blocking
            g["lr"] = holder

    def advance(self, withheld) -> None:
        """After an update: count it unless ``withheld`` (a bool, or the update's device flag: 1.0 withheld),
        and install the next LR."""
        if torch.is_tensor(withheld):
            if not self.tensor_lr:
                raise RuntimeError("a device flag needs the count on the device (UpdateSchedule.on_device)")
            self.applied.add_(1.0 - withheld.to(self.applied.device, torch.float64))
        elif not withheld:
            self.applied += 1  # in place where it is a tensor
        self.install()

    def value(self) -> float:
        """The LR of the next update as a number (one host read where the count is on the device)."""
        return float(self.next_lr())

    def state_dict(self) -> dict:
        return {"applied": int(self.applied)}

    def load_state_dict(self, state: dict) -> None:
        """``{"applied": n}``, or a ``LambdaLR`` state dict (``last_epoch``: updates applied)."""
        n = int(state["applied"] if "applied" in state else state["last_epoch"])
        if self.tensor_lr:
            self.applied.fill_(float(n))
        else:
            self.applied = n
        self.install()


def param_groups(model: torch.nn.Module) -> list[dict]:
    """The optimizer's parameter groups: every trainable parameter in one group, except expert
    parameters (marked ``p.expert = True``, see scaletrain.models.moe), which get a group of their own
    named "experts" (their gradients are reduced over another process group under expert parallelism);
    under DeepSpeed's MoE path (ZeRO-1/2, ``experts.expert_setup``) the group carries DeepSpeed's
    name for the expert groups and ``moe: True``, so ZeRO partitions it over the expert-data-parallel group."""
    params = [p for p in model.parameters() if p.requires_grad]
    experts = [p for p in params if getattr(p, "expert", False)]
    if not experts:
        return [{"params": params}]
    dense = [p for p in params if not getattr(p, "expert", False)]
    if getattr(experts[0], "allreduce", True) is False:  # DeepSpeed's MoE path (experts.expert_setup)
        return [{"params": dense, "name": "dense"}, {"params": experts, "name": experts[0].group_name, "moe": True}]
    return [{"params": dense, "name": "dense"}, {"params": experts, "name": "experts"}]


def build_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    o = cfg.optim
    groups = param_groups(model)
    params = [p for g in groups for p in g["params"]]
    kw = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    fusable = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    if getattr(o, "fused", True) and fusable:
        return torch.optim.AdamW(groups, fused=True, **kw)
    return torch.optim.AdamW(groups, **kw)


# ---- the non-finite check on the device ---------------------------------------------------------------------

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

