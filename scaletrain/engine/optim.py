"""Optimizer and LR schedule, built the same way by every engine (so checkpoints and runs agree)."""
from __future__ import annotations

import math

import torch


def inverse_sqrt_factor(lr: float, warmup: int, warmup_init_lr: float):
    """LambdaLR factor so that update number k (1-based) runs at fairseq's lr(k).

    lr(k) = init + (lr - init) * k / warmup for k < warmup, lr * sqrt(warmup / k) after.
    """

    def f(i: int) -> float:  # i = number of scheduler.step() calls so far = updates done
        k = i + 1
        if warmup > 0 and k < warmup:
            return (warmup_init_lr + (lr - warmup_init_lr) * k / warmup) / lr
        return math.sqrt(max(warmup, 1) / k)

    return f


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


def build_scheduler(optimizer, cfg):
    o = cfg.optim
    return torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt_factor(o.lr, o.warmup_steps, o.warmup_init_lr))


def own_grad_norm(params) -> float:
    """Global L2 norm of the gradients of ``params`` (for the paths where DeepSpeed does not report it)."""
    grads = [p.grad for p in params if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
