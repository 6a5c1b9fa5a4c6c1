"""The token exchange (scaletrain/parallel/exchange.py) on 2 gloo ranks against one process.

Per-expert function y = x @ W_e; the reference computes every expert locally on each rank's own
tokens (no exchange); expert-parallel computes each expert on the rank that holds it."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers import run_ranks
from scaletrain.errors import ScaletrainError
from scaletrain.parallel import ParallelContext, build_parallel_context, ep_size_problem
from scaletrain.parallel.exchange import combine, dispatch, permute, unpermute

E, D, K = 4, 3, 2


def _pipeline(x, idx, w, weights, ctx: ParallelContext):
    xp, perm = permute(x, idx, E)
    xl, d = dispatch(xp, perm.counts, ctx)
    first = ctx.local_experts(E).start
    ys, start = [], 0
    for j, n in enumerate(d.local_counts):
        ys.append(xl[start:start + n] @ w[first + j])
        start += n
    y = combine(torch.cat(ys), d, ctx)
    return unpermute(y, perm, weights), d


# per case: a function (rank, generator) -> expert index [N, K] (-1 = dropped)
def _random(rank, g):
    return torch.randint(0, E, (int(torch.randint(1, 7, (1,), generator=g)), K), generator=g)


CASES = {
    "random": _random,
    "expert 1 gets nothing": lambda rank, g: torch.tensor([[0, 2], [3, 0], [2, 3], [0, 0]]),
    "rank 1 gets nothing": lambda rank, g: torch.tensor([[0, 1], [1, 0], [1, 1]]),
    "rank 0 sends nothing": lambda rank, g: torch.zeros(0 if rank == 0 else 3, K, dtype=torch.long) + 3,
    "one token, dropped slot": lambda rank, g: torch.tensor([[2, -1]]),
    "everything dropped": lambda rank, g: torch.full((2, K), -1),
}


def _exchange_worker(rank, world):
    ctx = build_parallel_context(2)
    assert (ctx.ep_size, ctx.ep_rank, ctx.edp_size) == (2, rank, 1)
    assert list(ctx.local_experts(E)) == ([0, 1] if rank == 0 else [2, 3])
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(E, D, D, generator=g)
    for name, make in CASES.items():
        gr = torch.Generator().manual_seed(10 + rank)
        idx = make(rank, gr)
        x0 = torch.randn(idx.shape[0], D, generator=gr)
        weights0 = torch.rand(idx.shape[0], K, generator=gr)
        runs = {}
        for mode, c in (("ref", ParallelContext.single()), ("ep", ctx)):
            x, w, weights = (t.clone().requires_grad_() for t in (x0, w0, weights0))
            out, d = _pipeline(x, idx, w, weights, c)
            (out * torch.arange(1.0, D + 1)).sum().backward()
            wg = w.grad if w.grad is not None else torch.zeros_like(w)
            runs[mode] = (out.detach(), x.grad, weights.grad, wg, d)
        ref, ep = runs["ref"], runs["ep"]
        torch.testing.assert_close(ep[0], ref[0], msg=f"{name}: output")
        torch.testing.assert_close(ep[1], ref[1], msg=f"{name}: input gradient")
        torch.testing.assert_close(ep[2], ref[2], msg=f"{name}: routing-weight gradient")
        dist.all_reduce(ref[3])  # the reference computed every expert here on this rank's tokens only
        mine = list(ctx.local_experts(E))
        torch.testing.assert_close(ep[3][mine], ref[3][mine], msg=f"{name}: expert gradient")
        assert ep[3][[e for e in range(E) if e not in mine]].abs().sum() == 0
        kept = torch.tensor([int((idx >= 0).sum()), ep[4].sent, ep[4].received])
        dist.all_reduce(kept)
        assert kept[0] == kept[1] == kept[2], f"{name}: rows sent/received {kept.tolist()}"
        if name == "rank 1 gets nothing" and rank == 1:
            assert ep[4].received == 0 and ep[4].local_counts == [0, 0]
        if name == "expert 1 gets nothing" and rank == 0:
            assert ep[4].local_counts[1] == 0


@pytest.mark.slow
def test_exchange_on_two_ranks_equals_one_process():
    run_ranks(_exchange_worker, 2)


def test_permute_unpermute_round_trip():
    x = torch.randn(5, D)
    idx = torch.tensor([[1, 0], [1, -1], [3, 1], [0, 0], [-1, -1]])
    xp, perm = permute(x, idx, E)
    assert perm.counts.tolist() == [3, 3, 0, 1]
    experts = torch.repeat_interleave(torch.arange(E), perm.counts)
    assert torch.equal(xp, x[perm.order // K])
    assert torch.equal(idx.reshape(-1)[perm.order], experts)  # grouped by expert, in expert order
    out = unpermute(xp, perm, torch.ones(5, K))
    torch.testing.assert_close(out, x * (idx >= 0).sum(1, keepdim=True).float())


def test_ep_size_must_divide_the_world_size():
    assert ep_size_problem(2, 4) is None
    msg = ep_size_problem(3, 4)
    assert "moe.ep_size=3" in msg and "(4)" in msg and "1, 2, 4" in msg and "\n" not in msg
    with pytest.raises(ScaletrainError, match="moe.ep_size=2 must divide the number of ranks"):
        build_parallel_context(2, world_size=3, rank=0)
    assert build_parallel_context(1) == ParallelContext.single()
