"""The token exchange of expert parallelism, usable (and tested) without a model.

One routed layer on one rank, with N tokens, top-k routing and E experts per layer spread over an
expert-parallel group of P ranks (E/P local experts each, see ``context.py``):

    x [N, D], expert index [N, k]  --permute-->  rows sorted by global expert [n, D], counts [E]
        --dispatch-->  (counts exchanged first, then a variable-size all-to-all)
    rows for this rank's experts, sorted by local expert [m, D], rows per local expert
        --experts-->  y [m, D]  --combine-->  (the reverse all-to-all)  y [n, D]
        --unpermute-->  sum over each token's k slots of weight * y  [N, D]

``all_to_all_v`` is an autograd function whose backward is the reverse exchange, so gradients of
the expert inputs travel back to the ranks that own the tokens. Dispatch is dropless: every kept
(token, slot) pair is sent; a pair is dropped only where the caller marks it with expert index -1
(capacity mode). With ``ctx.ep_size == 1`` dispatch and combine are the identity (no collective).

Every rank of an EP group must call ``dispatch`` and ``combine`` the same number of times, in the
same order, even with no tokens (empty tensors are exchanged).

Host reads (device syncs on an accelerator): ``permute(trim=False)`` and ``unpermute`` read nothing
(counts by ``scatter_add``, not ``bincount``, which sizes its output from the data); ``dispatch``
reads once: the counts it needs for the split sizes (over EP: this rank's and the exchanged ones in
one copy). A single-rank MoE layer whose experts run as one grouped GEMM (``scaletrain.models.moe``)
needs no split sizes and skips ``dispatch``: no read at all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from scaletrain.parallel.context import ParallelContext


# ---------------------------------------------------------------------------------------
# permute / unpermute (local, no communication)
# ---------------------------------------------------------------------------------------
@dataclass
class Permutation:
    order: torch.Tensor  # [n] indices into the flat (token, slot) pairs, sorted by expert (stable), dropped last
    counts: torch.Tensor  # [E] int64, pairs per expert (dropped pairs excluded), on x's device
    n_tokens: int
    top_k: int
    expert: Optional[torch.Tensor] = None  # [n] expert of each permuted row (E: a dropped pair); trim=False only


def expert_counts(key: torch.Tensor, num_bins: int) -> torch.Tensor:
    """How often each of 0..num_bins-1 occurs in ``key`` (int64, on key's device). ``torch.bincount``
    without a host read: bincount sizes its output from the data (a device sync on CUDA)."""
    return torch.zeros(num_bins, dtype=torch.int64, device=key.device).scatter_add_(0, key, torch.ones_like(key))


def permute(x: torch.Tensor, expert_idx: torch.Tensor, num_experts: int,
            trim: bool = True) -> tuple[torch.Tensor, Permutation]:
    """Rows of ``x`` [N, D] once per kept (token, slot) pair, grouped by expert in expert order
    (within an expert: token order, then slot order). ``expert_idx`` [N, k] int64; -1 = dropped.

    ``trim=False``: no host read; every one of the N*k pairs gets a row, the dropped ones last (their
    expert in ``Permutation.expert`` is ``num_experts``), for callers that run a static number of rows
    (``unpermute`` gives dropped rows weight 0) or trim later with counts they read anyway (``dispatch``)."""
    n_tokens, top_k = expert_idx.shape
    flat = expert_idx.reshape(-1)
    key = torch.where(flat < 0, torch.full_like(flat, num_experts), flat)
    expert, order = torch.sort(key, stable=True)
    counts = expert_counts(key, num_experts + 1)[:num_experts]
    if trim:
        order, expert = order[: int(counts.sum())], None
    return x.index_select(0, order // top_k), Permutation(order, counts, n_tokens, top_k, expert)


def unpermute(y: torch.Tensor, perm: Permutation, weights: torch.Tensor) -> torch.Tensor:
    """[N, D]: for each token, the sum over its kept slots of weight * the expert output row.
    ``y`` [m, D] in ``permute``'s order: the kept rows, or (``trim=False``) all N*k rows, whose dropped
    rows get weight 0; ``weights`` [N, k] (cast to y's dtype)."""
    order = perm.order[: y.shape[0]]
    w = weights.reshape(-1).index_select(0, order).to(y.dtype)
    if perm.expert is not None and y.shape[0] > 0 and y.shape[0] == perm.expert.shape[0]:
        w = torch.where(perm.expert < perm.counts.shape[0], w, torch.zeros_like(w))
    out = y.new_zeros((perm.n_tokens,) + tuple(y.shape[1:]))
    return out.index_add(0, order // perm.top_k, y * w.view(-1, *([1] * (y.dim() - 1))))


# ---------------------------------------------------------------------------------------
# the variable-size all-to-all
# ---------------------------------------------------------------------------------------
class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (list(output_splits), list(input_splits)), group
        x = x.contiguous()
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, list(output_splits), list(input_splits), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        grad = grad.contiguous()
        out = grad.new_empty((sum(input_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad, input_splits, output_splits, group=ctx.group)
        return out, None, None, None


def all_to_all_v(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group=None) -> torch.Tensor:
    """Send ``x``'s rows in blocks of ``input_splits`` (one block per rank of ``group``, in rank
    order) and receive blocks of ``output_splits``; differentiable (backward = the reverse exchange)."""
    return _AllToAllV.apply(x, output_splits, input_splits, group)


def exchange_counts(counts: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """``counts`` [E]: rows this rank sends to each global expert. Returns [P, E/P]: row p = the rows
    EP rank p sends to each of this rank's experts."""
    P = ctx.ep_size
    counts = counts.to(torch.int64).contiguous()
    if P == 1:
        return counts.view(1, -1)
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=ctx.ep_group)
    return recv.view(P, -1)


# ---------------------------------------------------------------------------------------
# dispatch / combine
# ---------------------------------------------------------------------------------------
@dataclass
class Dispatch:
    local_counts: list[int]  # rows per local expert, after the exchange
    input_splits: Optional[list[int]] = None  # rows sent to each EP rank (None: no exchange)
    output_splits: Optional[list[int]] = None  # rows received from each EP rank
    local_order: Optional[torch.Tensor] = None  # received rows -> rows sorted by local expert

    @property
    def sent(self) -> int:
        return sum(self.input_splits) if self.input_splits is not None else sum(self.local_counts)

    @property
    def received(self) -> int:
        return sum(self.output_splits) if self.output_splits is not None else sum(self.local_counts)


def dispatch(x: torch.Tensor, counts: torch.Tensor, ctx: ParallelContext) -> tuple[torch.Tensor, Dispatch]:
    """Send permuted rows ``x`` (grouped by global expert, ``counts`` [E] per expert; rows past the
    counted ones, e.g. the dropped pairs of ``permute(trim=False)``, are left out) to the EP ranks that
    hold their experts. Returns the rows for this rank's experts grouped by local expert, and what
    ``combine`` needs to send the results back. Reads the host once (the split sizes: this rank's
    counts and, over EP, the exchanged ones, in one copy)."""
    P = ctx.ep_size
    if P == 1:
        local = counts.tolist()
        return x[: sum(local)], Dispatch(local_counts=local)
    recv = exchange_counts(counts, ctx)  # [P, E_local]
    e_local = recv.shape[1]
    host = torch.cat([counts.to(torch.int64).reshape(-1), recv.reshape(-1).to(counts.device)]).tolist()
    sent, got = host[: P * e_local], [host[P * e_local + p * e_local:P * e_local + (p + 1) * e_local] for p in range(P)]
    input_splits = [sum(sent[p * e_local:(p + 1) * e_local]) for p in range(P)]
    output_splits = [sum(row) for row in got]
    x = all_to_all_v(x[: sum(input_splits)], output_splits, input_splits, ctx.ep_group)
    # received: per source rank, rows grouped by local expert -> group by local expert over all sources
    local_expert = torch.repeat_interleave(torch.arange(e_local, device=x.device).repeat(P), recv.flatten().to(x.device),
                                           output_size=sum(output_splits))
    order = torch.argsort(local_expert, stable=True)
    d = Dispatch([sum(row[j] for row in got) for j in range(e_local)], input_splits, output_splits, order)
    return x.index_select(0, order), d


def combine(y: torch.Tensor, d: Dispatch, ctx: ParallelContext) -> torch.Tensor:
    """The reverse of ``dispatch``: expert outputs ``y`` (grouped by local expert) back to the ranks
    and rows they came from, in ``permute``'s order."""
    if d.input_splits is None:
        return y
    y = torch.zeros_like(y).index_copy(0, d.local_order, y)
    return all_to_all_v(y, d.input_splits, d.output_splits, ctx.ep_group)
