"""MoCE's conv experts spread over 2 gloo ranks (ep_size=2, ``scaletrain.models.moce_ep``) equal the
same layer holding every expert in one process: outputs, input / router / expert gradients, for
ordinary routing, every slot sent to one expert of the other rank, a rank with only padding (it sends
and receives nothing but still joins both exchanges) and a one-token batch; each rank holds only its
experts, and consolidation gives back the one-process weights."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers import assert_grad_close, run_ranks
from scaletrain.models import ModelConfig, build_model
from scaletrain.models.config import ConvConfig, MoEConfig
from scaletrain.models.convattn import MoCEExperts
from scaletrain.models.moce_ep import conv_owners
from scaletrain.parallel import ParallelContext, build_parallel_context
from scaletrain.parallel.state import consolidate_state_dict, shard_state_dict

KERNELS = [0, 1, 3, 5, 7, 9]  # MoCE Δ=5: identity + 5 conv experts
DH, LANGS = 6, 3


def _layer(ctx: ParallelContext) -> MoCEExperts:
    torch.manual_seed(0)
    return MoCEExperts(KERNELS, DH, 2, lid=False, n_langs=LANGS, dispatch="routed", parallel=ctx)


def _inputs(case: str, rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    B, T = (1, 1) if case == "one token" else (2, 7)
    z = torch.randn(3, B, 2, T, DH, generator=g)  # (q|k|v, sentence, head, position, Dh)
    pad = torch.zeros(B, T, dtype=torch.bool)
    if B > 1:
        pad[1, 4 + rank:] = True
    if case == "rank 1 only padding" and rank == 1:
        pad[:] = True
    return z, pad, torch.tensor([rank % LANGS] * B)


def _run(layer: MoCEExperts, z0, pad, lang):
    z = z0.clone().requires_grad_()
    y = layer(z, pad, None, lang)
    (y * torch.linspace(-1, 1, DH)).sum().backward()
    return y.detach(), z.grad


def _check(case: str, ctx: ParallelContext, rank: int) -> None:
    ref, ep = _layer(ParallelContext.single()), _layer(ctx)
    owners = conv_owners(KERNELS[1:], 2)
    mine = [j for j, o in enumerate(owners) if o == rank]
    held = [j for j, w in enumerate(ep.weights) if w.numel()]
    assert held == mine, f"{case}: rank {rank} holds conv experts {held}, owns {mine}"
    for j in mine:
        torch.testing.assert_close(ep.weights[j], ref.weights[j], rtol=0, atol=0)
    if case == "all to one expert":  # kernel 7 (conv expert 3, on rank 1) takes every slot
        with torch.no_grad():
            for layer in (ref, ep):
                layer.router.weight.zero_()
                layer.router.weight[4, 0] = 5.0
                layer.router.weight[0, 0] = 4.0  # second choice: the identity
    z, pad, lang = _inputs(case, rank)
    (y_ref, gz_ref), (y_ep, gz_ep) = _run(ref, z, pad, lang), _run(ep, z, pad, lang)
    torch.testing.assert_close(y_ep, y_ref, msg=f"{case}: output")
    torch.testing.assert_close(gz_ep, gz_ref, msg=f"{case}: input gradient")
    assert_grad_close(ep.router.weight.grad, ref.router.weight.grad, msg=f"{case}: router gradient")
    for j in range(len(owners)):
        for name, plist_ep, plist_ref in (("weight", ep.weights, ref.weights), ("bias", ep.biases, ref.biases)):
            g_ref = plist_ref[j].grad if plist_ref[j].grad is not None else torch.zeros_like(plist_ref[j])
            dist.all_reduce(g_ref)  # the reference saw this rank's rows only; the owner sees both ranks'
            if j in mine:
                assert_grad_close(plist_ep[j].grad, g_ref, msg=f"{case}: expert {j} {name} gradient")
            else:
                assert plist_ep[j].numel() == 0


def _model(moe: MoEConfig, ctx: ParallelContext):
    torch.manual_seed(0)
    cfg = ModelConfig(arch="moce", d_model=16, n_heads=2, encoder_layers=2, decoder_layers=1, ffn_dim=24,
                      dropout=0.0, max_positions=32, conv=ConvConfig(kernels=KERNELS, layers=[0, 1]))
    return build_model(cfg, 20, moe=moe, parallel=ctx)


def _check_model(ctx: ParallelContext, rank: int) -> None:
    """A whole MoCE model with moe.moce_partition: the same loss and gradients as one process."""
    part = MoEConfig(ep_size=2, moce_partition=True)
    ref, ep = _model(MoEConfig(), ParallelContext.single()), _model(part, ctx)
    # moce_partition off (default) with MoE-FFN experts over 2 ranks: every rank holds every conv expert
    replicated = _model(MoEConfig(num_experts=2, top_k=1, ep_size=2), ctx)
    conv = [p for n, p in replicated.named_parameters() if ".variant.weights." in n]
    assert conv and all(p.numel() and getattr(p, "ep_owner", None) is None for p in conv)
    assert sum(p.numel() for p in ep.parameters()) < sum(p.numel() for p in ref.parameters())
    g = torch.Generator().manual_seed(rank)
    src = torch.randint(4, 20, (3, 9), generator=g)
    tgt = torch.randint(4, 20, (3, 6), generator=g)
    losses = []
    for m in (ref, ep):
        loss = m(src, tgt).float().logsumexp(-1).mean()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0])
    params = dict(ref.named_parameters())
    for name, p in ep.named_parameters():
        g_ref = params[name].grad
        if getattr(p, "ep_owner", None) is None:
            assert_grad_close(p.grad, g_ref, msg=name)
        else:
            g_ref = g_ref.clone() if g_ref is not None else torch.zeros_like(params[name])
            dist.all_reduce(g_ref)
            if p.numel():
                assert_grad_close(p.grad, g_ref, msg=name)


def _worker(rank, world):
    ctx = build_parallel_context(2)
    for case in ("routed top-2", "all to one expert", "rank 1 only padding", "one token"):
        _check(case, ctx, rank)
    _check_model(ctx, rank)
    # consolidation: the owners' weights, everywhere; shard_state_dict cuts a full state dict back
    ep = _layer(ctx)
    full = {k: v.clone() for k, v in consolidate_state_dict(ep, ctx).items()}  # (dense entries are views)
    ref = dict(_layer(ParallelContext.single()).named_parameters())
    assert sorted(n for n in full if n.startswith(("weights.", "biases."))) == \
        sorted(n for n in ref if n.startswith(("weights.", "biases.")))
    for name in ref:
        torch.testing.assert_close(full[name], ref[name], rtol=0, atol=0)
    with torch.no_grad():
        for p in ep.parameters():
            p.zero_()
    ep.load_state_dict(shard_state_dict(full, ep))
    for name, p in ep.named_parameters():
        if p.numel():
            torch.testing.assert_close(p, ref[name], rtol=0, atol=0)
        else:
            assert p.ep_owner != rank and p.full_shape == tuple(ref[name].shape), name


def test_owners_balance_taps_and_cover_every_rank():
    assert conv_owners([1, 3, 5, 7, 9], 2) == [0, 0, 1, 1, 0]  # 9+3+1 = 13 taps vs 7+5 = 12
    assert sorted(conv_owners([1, 3, 5, 7, 9], 5)) == [0, 1, 2, 3, 4]
    with pytest.raises(Exception, match="moe.ep_size=3 is larger than the 2 conv experts"):
        conv_owners([1, 3], 3)


@pytest.mark.slow
def test_moce_experts_ep2_equal_one_process():
    run_ranks(_worker, 2)


def test_moce_partition_config_is_checked():
    cfg = ModelConfig(arch="transformer", d_model=16, n_heads=2)
    with pytest.raises(Exception, match="moe.moce_partition: is true but model.arch is 'transformer'"):
        MoEConfig(ep_size=2, moce_partition=True).validate(cfg)
    with pytest.raises(Exception, match="moe.ep_size: is 2 but moe.num_experts is 0 and moe.moce_partition is false"):
        MoEConfig(ep_size=2).validate(cfg)
