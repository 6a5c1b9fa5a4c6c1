"""The MoE layer's shared expert (``moe.shared_expert``): a dense FFN whose output is added to the routed
experts' for every real token, and which trains (its parameters get the gradient of that sum)."""
from __future__ import annotations

import torch

from helpers import assert_grad_close
from scaletrain.models import ModelConfig, build_model
from scaletrain.models.config import MoEConfig
from scaletrain.models.moe import MoEFeedForward
from scaletrain.parallel import ParallelContext

D, F, E = 8, 12, 4


def _layer(shared: bool) -> MoEFeedForward:
    torch.manual_seed(0)  # the router and experts are built before the shared expert: the same draws
    moe = MoEConfig(num_experts=E, top_k=2, shared_expert=shared, aux_loss_coef=0.0)
    return MoEFeedForward(D, moe, F, "relu", 0.0, "torch", ParallelContext.single()).double()


def _inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, D, generator=g, dtype=torch.float64)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    return x, pad


def test_shared_expert_adds_a_dense_ffn_of_every_real_token():
    with_shared, routed_only = _layer(True), _layer(False)
    for name, p in routed_only.named_parameters():  # the same router and experts
        torch.testing.assert_close(p, dict(with_shared.named_parameters())[name], rtol=0, atol=0)
    x, pad = _inputs()
    y, y_routed = with_shared(x, pad), routed_only(x, pad)
    real = ~pad
    s = with_shared.shared
    by_hand = s.fc2(torch.relu(s.fc1(x)))  # the shared expert's FFN, written out: fc1 -> relu -> fc2
    torch.testing.assert_close(y[real], y_routed[real] + by_hand[real], rtol=1e-12, atol=1e-12)
    assert float(by_hand[real].detach().abs().min()) > 0  # a contribution on every real token
    assert float(y[pad].detach().abs().max()) == 0.0  # pads: neither routed nor given the shared output


def test_shared_expert_parameters_get_the_gradient_of_their_output():
    layer, x_pad = _layer(True), _inputs()
    x, pad = x_pad
    w = torch.randn(D, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (layer(x, pad) * w).sum().backward()
    # reference: the shared FFN alone on the real rows, with the same upstream gradient w
    ref = _layer(True).shared
    (ref(x[~pad]) * w).sum().backward()
    ref_grads = dict(ref.named_parameters())
    names = [n for n, _ in layer.shared.named_parameters()]
    assert {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"} <= set(names)
    for name, p in layer.shared.named_parameters():
        assert_grad_close(p.grad, ref_grads[name].grad, msg=f"shared expert {name}", rtol=1e-12, atol=1e-12)
        assert float(p.grad.abs().max()) > 0, name


def test_a_model_with_a_shared_expert_trains_it():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, n_heads=2, encoder_layers=2, decoder_layers=2, ffn_dim=32, dropout=0.0,
                      max_positions=32)
    m = build_model(cfg, 270, moe=MoEConfig(num_experts=4, top_k=2, every=2, shared_expert=True))
    src, tgt = torch.randint(4, 260, (3, 7)), torch.randint(4, 260, (3, 5))
    m(src, tgt).float().logsumexp(-1).mean().backward()
    shared = [(n, p) for n, p in m.named_parameters() if ".ffn.shared." in n]
    assert len(shared) == 2 * 4  # one MoE layer on each side (every=2 of 2), fc1/fc2 weight and bias
    for name, p in shared:
        assert p.grad is not None and float(p.grad.abs().max()) > 0, name
