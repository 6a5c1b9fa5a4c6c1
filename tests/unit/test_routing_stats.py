"""Routing metrics summed over ranks: the counts are summed before any share is formed, in one collective
(the 2-rank end-to-end check is tests/integration/test_expert_parallel.py's routing test)."""
from __future__ import annotations

import pytest
import torch

from scaletrain.models import ModelConfig, build_model
from scaletrain.models.config import ConvConfig, MoCEConfig, MoEConfig
from scaletrain.models.routing_stats import has_routing, routing_metrics
from scaletrain.vocab import PAD

V = 270  # 10 language tags


def _model():
    torch.manual_seed(0)
    cfg = ModelConfig(arch="moce", d_model=32, n_heads=4, encoder_layers=2, decoder_layers=1, ffn_dim=64, dropout=0.0,
                      max_positions=64, conv=ConvConfig(kernels=[0, 1, 3, 5], layers=[0, 1]), moce=MoCEConfig(top_k=2))
    return build_model(cfg, V, moe=MoEConfig(num_experts=4, top_k=2, every=1, capacity_factor=0.5)).eval()


def _batch(seed: int, tags: list[int]):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 260, (len(tags), 9), generator=g)
    src[:, 0] = torch.tensor(tags)
    src[0, 6:] = PAD
    return src, torch.randint(4, 260, (len(tags), 5), generator=g)


@torch.no_grad()
def test_routing_metrics_sum_every_rank_before_the_shares():
    langs = [f"l{i}" for i in range(10)]
    a, b = _batch(1, [260, 261]), _batch(2, [261, 262, 262])  # "rank 1" has a language rank 0 has not
    rank0, rank1, both = _model(), _model(), _model()
    rank0(*a)
    rank1(*b)
    both(*a)
    both(*b)
    other = []
    routing_metrics(rank1, langs, reduce=lambda v: other.extend(v) or v)
    calls = []

    def reduce(values):  # the all-reduce of 2 ranks: this rank's counts + the other's
        calls.append(len(values))
        assert len(values) == len(other)
        return [x + y for x, y in zip(values, other)]

    got = routing_metrics(rank0, langs, reduce=reduce)
    want = routing_metrics(both, langs)
    assert len(calls) == 1  # MoCE and MoE counts in one collective
    assert {k.split("/")[2] for k in want if k.startswith("routing/")} == {"l0", "l1", "l2", "all"}
    assert got.keys() == want.keys() and any(k.startswith("moe/") for k in got)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-7), k
    assert routing_metrics(rank0, langs, reduce=lambda v: v) == {}  # reset by the read


@torch.no_grad()
def test_a_rank_with_nothing_routed_still_takes_part():
    """Every rank hands the collective the same number of values, whether or not it routed tokens."""
    langs = [f"l{i}" for i in range(10)]
    idle, busy = _model(), _model()
    busy(*_batch(1, [260, 263]))
    sizes = []
    out_busy = routing_metrics(busy, langs, reduce=lambda v: sizes.append(len(v)) or v)
    out_idle = routing_metrics(idle, langs, reduce=lambda v: sizes.append(len(v)) or v)
    assert sizes[0] == sizes[1] > 0 and out_busy and out_idle == {}


def test_has_routing_tells_dense_models_from_routed_ones():
    """A dense Transformer (whose ``routing_stats`` gathers nothing) has no routing, so the training unit skips
    the statistics' collective on log steps; MoCE's routed attention and MoE feed-forward layers have it."""
    base = dict(d_model=32, n_heads=4, encoder_layers=2, decoder_layers=1, ffn_dim=64, dropout=0.0, max_positions=64)
    dense = build_model(ModelConfig(**base), V)
    moe = build_model(ModelConfig(**base), V, moe=MoEConfig(num_experts=4, top_k=2, every=1))
    assert not has_routing(dense) and routing_metrics(dense) == {}
    assert has_routing(moe) and has_routing(_model())
