"""Sparse MoE feed-forward layers in one process: routing, aux loss by hand, capacity drops, the
dense model unchanged when moe is off, config errors, the loss and optimizer wiring."""
from __future__ import annotations

import math
import re

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.engine.optim import param_groups
from scaletrain.errors import ScaletrainError
from scaletrain.models import ModelConfig, build_model
from scaletrain.models.config import MoEConfig
from scaletrain.models.moe import MoEFeedForward, is_expert_param
from scaletrain.train.unit import TranslationUnit

LN3 = math.log(3.0)


def _tiny() -> ModelConfig:
    return ModelConfig(d_model=16, n_heads=2, encoder_layers=2, decoder_layers=2, ffn_dim=24, dropout=0.0)


def _layer(**kw) -> MoEFeedForward:
    torch.manual_seed(0)
    return MoEFeedForward(2, MoEConfig(**kw), 3, "relu", 0.0, "torch")


def test_aux_loss_and_top1_weights_by_hand():
    layer = _layer(num_experts=2, top_k=1, aux_loss_coef=1.0)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(2))
    x = torch.tensor([[LN3, 0.0], [0.0, LN3], [LN3, 0.0]])  # probabilities (3/4, 1/4), (1/4, 3/4), (3/4, 1/4)
    y = layer(x[None])[0]
    # choices e0, e1, e0: f = (2/3, 1/3); mean probabilities P = (7/12, 5/12); E * sum f P = 2 * 19/36
    assert layer.aux_loss.item() == pytest.approx(19 / 18, rel=1e-6)
    ex = layer.experts
    for i, e in enumerate((0, 1, 0)):  # top-1: the output is the raw probability times the expert
        expert_out = torch.relu(x[i] @ ex.w1[e] + ex.b1[e]) @ ex.w2[e] + ex.b2[e]
        torch.testing.assert_close(y[i], 0.75 * expert_out)
    assert layer.moe_stats() == {"pairs": 3, "dropped": 0, "load": [2, 1]}


def test_uniform_routing_gives_aux_loss_coef_and_top2_weights_sum_to_one():
    layer = _layer(num_experts=4, top_k=2, aux_loss_coef=0.5)
    with torch.no_grad():
        layer.router.weight.zero_()
    x = torch.randn(1, 8, 2)
    layer(x)
    assert layer.aux_loss.item() == pytest.approx(0.5)  # P_e = 1/4 each, f sums to 1
    idx, w, _ = layer.route(torch.randn(5, 2))
    torch.testing.assert_close(w.sum(-1), torch.ones(5))


def test_capacity_drops_are_counted_and_contribute_nothing():
    layer = _layer(num_experts=2, top_k=1, capacity_factor=0.5)
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]))
    x = torch.tensor([[[1.0, 0.5], [2.0, 0.1], [3.0, 0.0], [1.5, 1.0]]])  # all four pick expert 0
    assert layer.capacity(4) == 1
    y = layer(x)[0]
    assert layer.moe_stats() == {"pairs": 4, "dropped": 3, "load": [1, 0]}
    assert y[0].abs().sum() > 0 and torch.equal(y[1:], torch.zeros(3, 2))  # first in token order kept


def test_capacity_keeps_first_choices_before_second_choices():
    layer = _layer(num_experts=2, top_k=2, capacity_factor=0.5)  # capacity ceil(0.5 * 3 * 2 / 2) = 2
    idx = torch.tensor([[1, 0], [0, 1], [0, 1]])
    # expert 0 queue: tokens 1, 2 (first choices), then token 0 (second choice): token 0's slot dropped;
    # expert 1 queue: token 0 (first choice), then tokens 1, 2 (second choices): token 2's slot dropped
    assert layer.apply_capacity(idx).tolist() == [[1, -1], [0, 1], [0, -1]]


def test_pad_positions_are_not_routed():
    layer = _layer(num_experts=2, top_k=1)
    x = torch.randn(1, 4, 2)
    pad = torch.tensor([[False, False, True, True]])
    y = layer(x, pad)
    assert layer.moe_stats()["pairs"] == 2 and torch.equal(y[0, 2:], torch.zeros(2, 2))
    torch.testing.assert_close(y[:, :2], layer(x[:, :2]))


def test_dense_model_unchanged_when_moe_is_off():
    cfg = _tiny()
    src, tgt = torch.randint(4, 260, (2, 6)), torch.randint(4, 260, (2, 5))
    outs = []
    for moe in (None, MoEConfig(), MoEConfig(num_experts=0, every=1)):
        torch.manual_seed(0)
        m = build_model(cfg, 260, moe=moe)
        outs.append((sum(p.numel() for p in m.parameters()), m(src, tgt), m.last_aux_loss, list(m.state_dict())))
    for n, logits, aux, keys in outs[1:]:
        assert n == outs[0][0] and keys == outs[0][3] and aux is None
        assert torch.equal(logits, outs[0][1])


def test_moe_model_layers_parameters_and_aux_loss():
    cfg = _tiny()
    moe = MoEConfig(num_experts=4, top_k=2, every=2, ffn_dim=8, shared_expert=True)
    torch.manual_seed(0)
    m = build_model(cfg, 260, moe=moe)
    dense = build_model(cfg, 260)
    kinds = [type(l.ffn).__name__ for l in (*m.encoder_layers, *m.decoder_layers)]
    assert kinds == ["FeedForward", "MoEFeedForward"] * 2
    d, f = cfg.d_model, cfg.ffn_dim
    dense_ffn = d * f + f + f * d + d
    expert = d * 8 + 8 + 8 * d + d
    moe_ffn = 4 * expert + d * 4 + expert  # experts + router + shared expert (expert-sized)
    n = lambda mod: sum(p.numel() for p in mod.parameters())
    assert n(m) - n(dense) == 2 * (moe_ffn - dense_ffn)
    experts = [name for name, p in m.named_parameters() if is_expert_param(p)]
    assert experts and all(".ffn.experts." in name for name in experts)
    logits = m(torch.randint(4, 260, (2, 6)), torch.randint(4, 260, (2, 5)))
    layers = [l.ffn for l in (m.encoder_layers[1], m.decoder_layers[1])]
    torch.testing.assert_close(m.last_aux_loss, layers[0].aux_loss + layers[1].aux_loss)
    (logits.sum() + m.last_aux_loss).backward()
    assert m.encoder_layers[1].ffn.router.weight.grad.abs().sum() > 0
    groups = param_groups(m)
    assert [g["name"] for g in groups] == ["dense", "experts"]
    assert sum(p.numel() for p in groups[1]["params"]) == 2 * 4 * (d * 8 + 8 + 8 * d + d)


def test_unit_adds_aux_loss_times_target_tokens():
    torch.manual_seed(0)
    model = build_model(_tiny(), 260, moe=MoEConfig(num_experts=2, top_k=1, every=1))

    class Eng:
        module = model

        def forward(self, src, tgt_in, src_padded=True):
            return model(src, tgt_in, src_padded=src_padded)

    class B:
        src, tgt_in = torch.randint(4, 260, (2, 6)), torch.randint(4, 260, (2, 5))
        tgt_out = torch.randint(4, 260, (2, 5))
        src_padded = False

    loss, nll, ntok = TranslationUnit(Eng(), 0.0, 0, []).loss(B)
    assert int(ntok) == 10
    torch.testing.assert_close(loss, nll + model.last_aux_loss * 10)


def test_moe_config_section_and_errors():
    cfg = load_config("small", ["moe.num_experts=4", "moe.every=1"])
    assert cfg.moe.num_experts == 4 and cfg.moe.top_k == 2 and cfg.moe.capacity_factor == 0.0
    cases = {
        "moe.top_k=5": "moe.top_k: 5 is more than moe.num_experts=4",
        "moe.capacity_factor=-1": "moe.capacity_factor: must be a number >= 0",
        "moe.every=0": "moe.every: must be an integer >= 1",
        "moe.ep_size=3": "moe.num_experts: 4 experts cannot be split evenly over moe.ep_size=3",
        "moe.bogus=1": "unknown config key 'moe.bogus'",
    }
    for override, msg in cases.items():
        with pytest.raises(ScaletrainError, match=re.escape(msg)):
            load_config("small", ["moe.num_experts=4", override])
    assert load_config("small", ["moe.num_experts=4", "moe.ep_size=2"]).moe.ep_size == 2  # engines check the rest
    with pytest.raises(ScaletrainError, match="moe.ep_size: is 2 but moe.num_experts is 0"):
        load_config("small", ["moe.ep_size=2"])


def test_incremental_decoding_matches_full_forward_and_moce_with_moe():
    cfg = _tiny()
    moce = ModelConfig(**{**cfg.__dict__, "arch": "moce", "conv": type(cfg.conv)(kernels=[0, 1, 3], layers=[0])})
    for mcfg in (cfg, moce):
        torch.manual_seed(0)
        m = build_model(mcfg, 260, moe=MoEConfig(num_experts=4, top_k=2, every=1)).eval()
        assert sum(type(l.ffn).__name__ == "MoEFeedForward" for l in (*m.encoder_layers, *m.decoder_layers)) == 4
        src, tgt = torch.randint(4, 260, (2, 6)), torch.randint(4, 260, (2, 5))
        with torch.no_grad():
            full = m(src, tgt)
            enc, cache = m.encode(src), None
            for t in range(tgt.shape[1]):  # dropless routing is per token: one token at a time gives the same
                step, cache = m.decode_step(tgt[:, t], t, enc, cache)
                torch.testing.assert_close(step, full[:, t], atol=1e-5, rtol=1e-5)


def test_activation_checkpointing_same_gradients_and_counts_once():
    from types import SimpleNamespace

    from scaletrain.engine.model_prep import prepare_model

    src, tgt = torch.randint(4, 260, (2, 6)), torch.randint(4, 260, (2, 5))
    runs = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        m = build_model(_tiny(), 260, moe=MoEConfig(num_experts=4, top_k=2, every=1))
        if ckpt:
            prepare_model(m, SimpleNamespace(engine=SimpleNamespace(activation_checkpointing=True, compile=False)))
        (m(src, tgt).square().mean() + m.last_aux_loss).backward()
        runs.append((m.encoder_layers[0].ffn.moe_stats(), [p.grad.clone() for p in m.parameters()]))
    assert runs[0][0] == runs[1][0] and runs[0][0]["pairs"] == 2 * 6 * 2
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b)


def test_decoder_pads_are_not_routed():
    torch.manual_seed(0)
    m = build_model(_tiny(), 260, moe=MoEConfig(num_experts=2, top_k=1, every=2))
    src, tgt = torch.randint(4, 260, (2, 6)), torch.randint(4, 260, (2, 5))
    src[1, 4:] = 0
    tgt[0, 3:] = 0
    logits = m(src, tgt)
    assert m.encoder_layers[1].ffn.moe_stats()["pairs"] == 10 and m.decoder_layers[1].ffn.moe_stats()["pairs"] == 8
    short = m(src[:1], tgt[:1, :3])  # the real positions do not depend on the padding
    torch.testing.assert_close(short, logits[:1, :3], atol=1e-5, rtol=1e-5)


def test_moe_metrics_sum_the_counts_before_the_shares():
    from scaletrain.models.routing_stats import moe_metrics

    torch.manual_seed(0)
    m = build_model(_tiny(), 260, moe=MoEConfig(num_experts=2, top_k=1, every=2, capacity_factor=0.5))
    m(torch.randint(4, 260, (2, 6)), torch.randint(4, 260, (2, 5)))
    local = {n: mod.moe_stats(reset=False) for n, mod in m.named_modules() if hasattr(mod, "moe_stats")}
    seen = []

    def reduce(values):  # a pretend second rank with the same counts plus one dropped pair per layer
        seen.append(list(values))
        return [2 * v + (1 if i % 4 == 1 else 0) for i, v in enumerate(values)]

    out = moe_metrics(m, reset=True, reduce=reduce)
    assert len(seen) == 1 and len(seen[0]) == 2 * (2 + 2)  # one collective: pairs, dropped, load[2] per layer
    st = local["encoder_layers.1.ffn"]
    assert out["moe/encoder.1/dropped"] == pytest.approx((2 * st["dropped"] + 1) / (2 * st["pairs"]))
    assert moe_metrics(m) == {}  # reset
