"""A MoE feed-forward layer with its experts split over 2 gloo ranks (ep_size=2) equals the same
layer holding every expert in one process: outputs, aux loss, drops, and input / router / expert
gradients; each rank holds half of the experts."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers import assert_grad_close, run_ranks
from scaletrain.models.config import MoEConfig
from scaletrain.models.moe import MoEFeedForward
from scaletrain.parallel import ParallelContext, build_parallel_context

D, F, E = 8, 12, 4


def _layer(moe: MoEConfig, ctx: ParallelContext) -> MoEFeedForward:
    torch.manual_seed(0)
    return MoEFeedForward(D, moe, F, "relu", 0.0, "torch", ctx)


def _inputs(case: str, rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    if case == "one token":  # rank 0: a batch of one token; rank 1: only padding (sends nothing)
        x = torch.randn(1, 2, D, generator=g)
        return x, torch.tensor([[False, True]]) if rank == 0 else torch.tensor([[True, True]])
    x = torch.randn(2, 5, D, generator=g)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3 + rank:] = True
    if case == "all to one expert":
        x[..., 0] = x[..., 0].abs() + 1.0
    return x, pad


CASES = {
    "dropless top-2": MoEConfig(num_experts=E, top_k=2, ep_size=2, aux_loss_coef=0.1),
    "all to one expert": MoEConfig(num_experts=E, top_k=1, ep_size=2),
    "one token": MoEConfig(num_experts=E, top_k=2, ep_size=2, shared_expert=True),
    "capacity": MoEConfig(num_experts=E, top_k=2, ep_size=2, capacity_factor=0.5),
}


def _run(layer: MoEFeedForward, x0, pad, rank):
    x = x0.clone().requires_grad_()
    y = layer(x, pad)
    (y * torch.linspace(-1, 1, D)).sum().add(layer.aux_loss).backward()
    return y.detach(), x.grad, layer.aux_loss.detach(), layer.moe_stats()


def _check_case(case, moe, ctx, rank):
    ref, ep = _layer(moe, ParallelContext.single()), _layer(moe, ctx)
    mine = list(ctx.local_experts(E))
    n_ref = sum(p.numel() for p in ref.experts.parameters())
    assert sum(p.numel() for p in ep.experts.parameters()) * 2 == n_ref, f"{case}: rank holds half the experts"
    assert ep.experts.w1.shape[0] == E // 2 and ep.experts.first_expert == mine[0]
    for name, p in ep.experts.named_parameters():  # the same initial weights as the ep=1 layer's slice
        torch.testing.assert_close(p, getattr(ref.experts, name)[mine], rtol=0, atol=0)
    if case == "all to one expert":
        with torch.no_grad():
            for layer in (ref, ep):
                layer.router.weight.zero_()
                layer.router.weight[3, 0] = 5.0  # expert 3 (on rank 1) takes every token
    x, pad = _inputs(case, rank)
    r, e = _run(ref, x, pad, rank), _run(ep, x, pad, rank)
    for i, what in enumerate(("output", "input gradient", "aux loss")):
        torch.testing.assert_close(e[i], r[i], msg=f"{case}: {what}")
    assert e[3] == r[3], f"{case}: routed / dropped / per-expert counts"
    assert_grad_close(ep.router.weight.grad, ref.router.weight.grad, msg=f"{case}: router gradient")
    if ep.shared is not None:  # the shared expert: a dense FFN, every parameter reached
        ref_shared = dict(ref.shared.named_parameters())
        for name, p in ep.shared.named_parameters():
            assert_grad_close(p.grad, ref_shared[name].grad, msg=f"{case}: shared expert gradient {name}")
    for name, p in ep.experts.named_parameters():
        g_ref = getattr(ref.experts, name).grad
        assert g_ref is not None, f"{case}: expert {name} of the one-process layer got no gradient"
        dist.all_reduce(g_ref)  # the reference saw only this rank's tokens; EP experts saw both ranks'
        assert_grad_close(p.grad, g_ref[mine], msg=f"{case}: expert gradient {name}")
    return e[3]


def _ep_worker(rank, world):
    ctx = build_parallel_context(2)
    for case, moe in CASES.items():
        stats = _check_case(case, moe, ctx, rank)
        load = torch.tensor(stats["load"])
        dist.all_reduce(load)
        if case == "all to one expert":
            assert load.tolist()[:3] == [0, 0, 0] and load[3] > 0
        if case == "capacity":
            dropped = torch.tensor(stats["dropped"])
            dist.all_reduce(dropped)
            assert dropped > 0, "capacity 0.5 must drop pairs"


@pytest.mark.slow
def test_moe_layer_ep2_equals_one_process():
    run_ranks(_ep_worker, 2)
