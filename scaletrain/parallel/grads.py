"""Gradient reduction and norms with expert parallelism (what an engine does after backward).

Data parallel averages every gradient over the W ranks (DDP, DeepSpeed): the loop scales each rank's
loss so that this average is the gradient of the global mean loss (``scaletrain.train.unit``). Under
expert parallelism (``context.py``) an expert's gradient on its rank already sums the contributions
of the tokens of all P ranks of its EP group (the all-to-all's backward brought them there), so the
ep_size=1 average (1/W) * sum over all ranks is reached by summing over the expert-data-parallel
group only and dividing by W, not by the EDP size: dividing by W/P would make expert gradients P
times too large (DeepSpeed #5618, #6545).

The gradient norm for clipping counts each expert once: the dense part is the same on every rank
after reduction; the expert parts of the P ranks of an EP group are summed (their squares).
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist

from scaletrain.parallel.context import ParallelContext


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for p in params:
        if p.grad is None:  # every rank must take part in the same reduction: an unused expert counts 0
            p.grad = torch.zeros_like(p)
        out.append(p.grad)
    return out


def _all_reduce_div(grads: list[torch.Tensor], group, group_size: int, divisor: int) -> None:
    """Sum ``grads`` over ``group`` (skipped for a group of one) and divide by ``divisor``, in place,
    in one flat collective."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group_size > 1:
        dist.all_reduce(flat, group=group)
    flat.div_(divisor)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def reduce_expert_gradients(expert_params: Iterable[torch.Tensor], ctx: ParallelContext) -> None:
    """Sum expert gradients over the EDP group (the whole world when ep_size == 1) and divide by the
    world size, in place, in one collective. Call on every rank after backward."""
    grads = _grads(expert_params)
    if ctx.world_size == 1:
        return
    edp_group = ctx.edp_group if ctx.ep_size > 1 else None  # None = the default (whole-world) group
    _all_reduce_div(grads, edp_group, ctx.edp_size, ctx.world_size)


def reduce_dense_gradients(dense_params: Iterable[torch.Tensor], ctx: ParallelContext) -> None:
    """Average the gradients of the replicated (non-expert) parameters over the whole world, in
    place, in one collective: what DDP / DeepSpeed do for them, for an engine whose own reduction is
    switched off under expert parallelism (DeepSpeed ZeRO-0)."""
    grads = _grads(dense_params)
    if ctx.world_size > 1:
        _all_reduce_div(grads, None, ctx.world_size, ctx.world_size)


def split_expert_params(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(dense, expert) trainable parameters of ``model`` (experts: marked ``p.expert = True``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return ([p for p in params if not getattr(p, "expert", False)],
            [p for p in params if getattr(p, "expert", False)])


def grad_norm(dense_params: Iterable[torch.Tensor], expert_params: Iterable[torch.Tensor],
              ctx: ParallelContext) -> float:
    """L2 norm of the whole model's (reduced) gradient, each expert counted once: collective over the
    EP group when ep_size > 1."""
    dense = [p.grad.detach().double() for p in dense_params if p.grad is not None]
    experts = [p.grad.detach().double() for p in expert_params if p.grad is not None]
    sq = torch.zeros(2, dtype=torch.float64)
    sq[0] = sum((g.pow(2).sum() for g in dense), torch.zeros((), dtype=torch.float64))
    sq[1] = sum((g.pow(2).sum() for g in experts), torch.zeros((), dtype=torch.float64))
    if ctx.ep_size > 1:
        e = sq[1:].clone()
        dist.all_reduce(e, group=ctx.ep_group)
        sq[1] = e[0]
    return math.sqrt(float(sq.sum()))


def clip_grad_norm(dense_params: list[torch.Tensor], expert_params: list[torch.Tensor], max_norm: float,
                   ctx: ParallelContext) -> float:
    """Scale every gradient by min(1, max_norm / norm) with the norm of ``grad_norm`` (the same factor
    on every rank); returns the norm before clipping."""
    norm = grad_norm(dense_params, expert_params, ctx)
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in (*dense_params, *expert_params):
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


class ExpertParallelGrads:
    """What an engine does with gradients under expert parallelism, for a model built with the
    ``ParallelContext`` ``ctx`` (the engine's ``Engine.parallel``), ``active`` at ep_size > 1: the
    engine's own all-reduce must skip the expert parameters (DDP: ignored parameters; DeepSpeed ZeRO-0: its backward all-reduce switched off), and
    at the accumulation boundary ``reduce`` sums expert gradients over the EDP group / W (and, where
    the engine reduces nothing itself, averages the dense ones over the world); ``clip`` clips with
    the norm that counts each expert once. ``snapshot`` / ``restore`` keep this rank's experts through
    an engine's start-up broadcast of rank 0's parameters."""

    def __init__(self, model: torch.nn.Module, ctx: ParallelContext):
        self.ctx = ctx
        self.dense, self.experts = split_expert_params(model)
        self.expert_names = [n for n, p in model.named_parameters() if getattr(p, "expert", False)]

    @property
    def active(self) -> bool:
        return self.ctx.ep_size > 1

    def reduce(self, dense: bool) -> None:
        if dense:
            reduce_dense_gradients(self.dense, self.ctx)
        reduce_expert_gradients(self.experts, self.ctx)

    def clip(self, max_norm: float) -> float:
        return clip_grad_norm(self.dense, self.experts, max_norm, self.ctx)

    def snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.experts]

    @torch.no_grad()
    def restore(self, saved: list[torch.Tensor]) -> None:
        for p, s in zip(self.experts, saved):
            p.copy_(s)
