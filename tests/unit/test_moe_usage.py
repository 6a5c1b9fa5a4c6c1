"""MoE expert usage per source language: the hooks' counts agree with the MoE layers' own expert loads
(dropless: every choice is kept) and with the routed source tokens of each language."""
from __future__ import annotations

import torch

from scaletrain.models import ModelConfig, build_model
from scaletrain.models.config import MoEConfig
from scaletrain.train.moe_usage import MoeLanguageUsage


def test_counts_match_the_layers_loads_and_each_languages_tokens():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, n_heads=2, encoder_layers=2, decoder_layers=1, ffn_dim=32, dropout=0.0)
    model = build_model(cfg, 260, moe=MoEConfig(num_experts=4, top_k=2, every=1)).train()
    usage = MoeLanguageUsage.for_model(model, n_langs=3)
    assert [n for n, _ in usage.layers] == ["encoder_layers.0.ffn", "encoder_layers.1.ffn"]
    for name, mod in usage.layers:
        mod.moe_stats(reset=True)
    src = torch.randint(4, 260, (5, 7))
    src[1, 4:] = 0  # padding: not routed, not counted
    src[3, 2:] = 0
    langs = torch.tensor([0, 2, 2, 1, 0])
    usage.set_batch(langs)
    model(src, torch.randint(4, 260, (5, 6))).sum().backward()
    tokens = {lang: int((src[langs == lang] != 0).sum()) for lang in range(3)}
    for name, mod in usage.layers:
        c = usage.counts[name]
        assert c.sum(1).tolist() == [2.0 * tokens[lang] for lang in range(3)]  # top_k choices per routed token
        assert c.sum(0).tolist() == [float(x) for x in mod.moe_stats(reset=True)["load"]]  # the layer's own count
    with torch.no_grad():  # validation forwards are not counted
        model(src, torch.randint(4, 260, (5, 6)))
    before = {n: usage.counts[n].clone() for n, _ in usage.layers}
    m = usage.metrics(["de", "fr", "ja"], reduce=lambda xs: [2 * x for x in xs])  # as if two equal ranks
    for n, _ in usage.layers:
        assert torch.equal(before[n], usage.counts[n] + before[n])  # reset to zero after reporting
    row = before["encoder_layers.0.ffn"][2]
    assert [m[f"moe_usage/encoder.0/ja/share_e{e}"] for e in range(4)] == [float(x) / float(row.sum()) for x in row]
    assert abs(sum(m[f"moe_usage/encoder.1/all/share_e{e}"] for e in range(4)) - 1) < 1e-12
