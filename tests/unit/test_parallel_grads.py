"""Expert-gradient reduction and the clipping norm on 4 gloo ranks (ep_size=2: EP groups {0,1} and
{2,3}, expert-data-parallel groups {0,2} and {1,3}) equal data parallel with every expert on every rank
(ep_size=1): the update does not depend on ep_size."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from helpers import assert_grad_close, run_ranks
from scaletrain.models.config import MoEConfig
from scaletrain.models.moe import MoEFeedForward
from scaletrain.parallel import ParallelContext, build_parallel_context
from scaletrain.parallel.grads import clip_grad_norm, grad_norm, reduce_expert_gradients

D, F, E = 6, 8, 4


def _backward(ctx: ParallelContext, rank: int, world: int) -> MoEFeedForward:
    torch.manual_seed(0)
    layer = MoEFeedForward(D, MoEConfig(num_experts=E, top_k=2), F, "gelu", 0.0, "torch", ctx)
    x = torch.randn(3 + rank, D, generator=torch.Generator().manual_seed(rank))
    loss = (layer(x[None]) ** 2).sum() + layer.aux_loss
    (loss * world / 20.0).backward()  # the loop's scaling: the engine then averages over the world
    for p in layer.router.parameters():  # dense parameters: what DDP / DeepSpeed do
        dist.all_reduce(p.grad)
        p.grad.div_(world)
    return layer


def _grads_worker(rank, world):
    ep_ctx = build_parallel_context(2)
    assert (ep_ctx.ep_rank, ep_ctx.edp_size, ep_ctx.edp_rank) == (rank % 2, 2, rank // 2)
    dp_ctx = build_parallel_context(1)
    assert (ep_ctx.world_size, ep_ctx.rank, dp_ctx.world_size, dp_ctx.edp_size) == (world, rank, world, world)
    ref, ep = _backward(dp_ctx, rank, world), _backward(ep_ctx, rank, world)
    reduce_expert_gradients(ref.experts.parameters(), dp_ctx)  # ep=1: over the whole world, like DDP
    reduce_expert_gradients(ep.experts.parameters(), ep_ctx)
    mine = list(ep_ctx.local_experts(E))
    assert_grad_close(ep.router.weight.grad, ref.router.weight.grad, msg="router")
    for name, p in ep.experts.named_parameters():
        g_ref = getattr(ref.experts, name).grad
        assert g_ref is not None, name
        assert_grad_close(p.grad, g_ref[mine], msg=name)
    n_ref = grad_norm(ref.router.parameters(), ref.experts.parameters(), dp_ctx)
    n_ep = grad_norm(ep.router.parameters(), ep.experts.parameters(), ep_ctx)
    assert math.isclose(n_ep, n_ref, rel_tol=1e-6), (n_ep, n_ref)
    dense, experts = list(ep.router.parameters()), list(ep.experts.parameters())
    assert clip_grad_norm(dense, experts, n_ref / 2, ep_ctx) == pytest.approx(n_ref)
    assert grad_norm(dense, experts, ep_ctx) == pytest.approx(n_ref / 2, rel=1e-5)


@pytest.mark.slow
def test_expert_gradients_and_norm_at_ep2_equal_ep1_on_four_ranks():
    run_ranks(_grads_worker, 4)
