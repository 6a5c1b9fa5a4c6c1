"""Properties every architecture must keep (tiny configs): shapes, padding invariance, incremental
decoding, eval determinism, training step, paper parameter counts."""
from __future__ import annotations

import pytest
import torch

from scaletrain.models import ModelConfig, available_models, build_model, count_parameters
from scaletrain.models.config import ConvConfig, LobefConfig, MoCEConfig
from scaletrain.models.loss import label_smoothed_ce
from scaletrain.vocab import PAD

V = 270

ARCHS = {
    "transformer": dict(),
    "transformer_onehot": dict(arch="transformer", embedding="onehot", d_model=288, n_heads=4, ffn_dim=64),
    "byte_ncf": dict(arch="byte_ncf", lobef=LobefConfig(byte_layers=2), encoder_layers=1),
    "byte_wsf": dict(arch="byte_wsf", lobef=LobefConfig(byte_layers=1), encoder_layers=1),
    "msc": dict(arch="msc", conv=ConvConfig(kernels=[0, 1, 3, 5], layers=[0, 1])),
    "msha": dict(arch="msha", conv=ConvConfig(kernels=[0, 1, 3, 5], layers=[0, 1])),
    "moce": dict(arch="moce", conv=ConvConfig(kernels=[0, 1, 3, 5, 7])),
    "moce_lid": dict(arch="moce", conv=ConvConfig(kernels=[0, 1, 3, 5, 7]), moce=MoCEConfig(lid=True, top_k=3)),
}


def make(name, seed=0, **kw):
    base = dict(d_model=32, n_heads=4, encoder_layers=2, decoder_layers=2, ffn_dim=64, dropout=0.0, max_positions=64)
    base.update(ARCHS[name])
    base.update(kw)
    torch.manual_seed(seed)
    return build_model(ModelConfig(**base), V).eval()


def pair(g, i, ls, lt, space_every=4):
    s = torch.randint(4 + 33, 260, (ls,), generator=g)
    s[space_every - 1 :: space_every] = 32 + 4  # some spaces for WSF
    return [260 + i] + s.tolist() + [2], [262 + i] + torch.randint(4, 260, (lt,), generator=g).tolist()


def right(rows, L=None):
    L = L or max(map(len, rows))
    out = torch.zeros(len(rows), L, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def left(rows, L=None):
    L = L or max(map(len, rows))
    out = torch.zeros(len(rows), L, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, L - len(r) :] = torch.tensor(r)
    return out


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [pair(g, 0, 9, 5), pair(g, 1, 13, 7)]
    return [p[0] for p in ps], [p[1] for p in ps]


def test_every_registered_architecture_is_covered():
    assert set(available_models()) <= {a.get("arch", "transformer") for a in ARCHS.values()} | {"transformer"}


@pytest.mark.parametrize("name", list(ARCHS))
def test_padding_invariance_and_incremental_decoding(name):
    m = make(name)
    # one-hot logits are ~sqrt(288)-scaled, so float32 noise is ~2e-5 there; 1e-5 elsewhere
    tol = dict(atol=1e-4 if name == "transformer_onehot" else 1e-5, rtol=0)
    srcs, tgts = data()
    src, tgt = right(srcs), right(tgts)
    ref = m(src, tgt)
    assert ref.shape == (2, tgt.shape[1], V) and torch.isfinite(ref).all()
    # more padding, and a longer neighbour
    g = torch.Generator().manual_seed(7)
    ls, lt = pair(g, 0, 25, 11)
    out_pad = m(right(srcs, src.shape[1] + 6), right(tgts, tgt.shape[1] + 3))
    out_nb = m(right(srcs + [ls]), right(tgts + [lt]))
    for i, t in enumerate(tgts):
        torch.testing.assert_close(out_pad[i, : len(t)], ref[i, : len(t)], **tol)
        torch.testing.assert_close(out_nb[i, : len(t)], ref[i, : len(t)], **tol)
    # left-padded source: only the stride-aligned n-gram windows of nCF need right padding
    if name != "byte_ncf":
        out_left = m(left(srcs, src.shape[1] + 3), tgt)
        for i, t in enumerate(tgts):
            torch.testing.assert_close(out_left[i, : len(t)], ref[i, : len(t)], **tol)
    # incremental decoding == full forward
    enc = m.encode(src)
    cache = None
    for t in range(tgt.shape[1]):
        logits, cache = m.decode_step(tgt[:, t], t, enc, cache)
        for i, tg in enumerate(tgts):
            if t < len(tg):
                torch.testing.assert_close(logits[i], ref[i, t], **tol)
    # eval is deterministic
    torch.testing.assert_close(m(src, tgt), ref, atol=0, rtol=0)


@pytest.mark.parametrize("name", list(ARCHS))
def test_one_training_step_reaches_every_parameter(name):
    m = make(name, dropout=0.1).train()
    srcs, tgts = data(1)
    src, tgt = right(srcs), right(tgts)
    loss, _, n = label_smoothed_ce(m(src, tgt), torch.roll(tgt, -1, 1).masked_fill(tgt.eq(PAD), PAD))
    loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing
    assert m.last_aux_loss is None


# ---- paper-size parameter counts (d 512, 8 heads, ffn 2048, 6+6 layers, OPUS-100 vocab 360) -------------
PAPER = [
    # (config, paper total, exact delta vs dense byte Transformer)
    (dict(), 44.3e6, 0),
    (dict(arch="byte_ncf", lobef=LobefConfig(byte_layers=4), encoder_layers=2), 46.7e6, 9 * 512**2 + 3 * 512 + 4),
    (dict(arch="byte_wsf", lobef=LobefConfig(byte_layers=2), encoder_layers=4), 44.1e6, 0),
    (dict(arch="moce", conv=ConvConfig(kernels=[0, 1, 3, 5, 7, 9])), 44.4e6, 64**2 * 25 + 5 * 64 + 6 * 64),
    (dict(arch="moce", conv=ConvConfig(kernels=[0, 1, 3, 5, 7, 9]), moce=MoCEConfig(lid=True)), 44.4e6, 64**2 * 25 + 5 * 64 + 6 * 128),
    (dict(arch="moce", conv=ConvConfig(kernels=[0, 1, 3, 5, 7, 9, 11])), 44.5e6, 64**2 * 36 + 6 * 64 + 7 * 64),
    # MoCE paper's MSC row (44.4M) matches MSC in ONE layer; MSHA is not in the paper
    (dict(arch="msc", conv=ConvConfig(kernels=[0, 0, 3, 3, 5, 5, 7, 7], layers=[0])), 44.4e6, 64**2 * 30 + 6 * 64),
    (dict(arch="msha", conv=ConvConfig(kernels=[0, 0, 1, 1, 3, 5, 7, 9], layers=[0])), None, 64**2 * 26 + 6 * 64),
]


@pytest.mark.parametrize("kw,paper,delta", PAPER)
def test_paper_parameter_counts(kw, paper, delta):
    dense = 44_322_816  # 6 * 3,152,384 + 6 * 4,204,032 + 360 * 512 (checked in test_models_transformer)
    c = count_parameters(build_model(ModelConfig(**kw), 360))
    assert c["total"] - dense == delta
    assert c["variant"] == delta
    if paper is not None:
        if kw.get("arch") == "byte_wsf":
            # LOBEF Table 7: dense Byte-WSF is listed as 44.1M, the same as the one-hot models; WSF adds no
            # parameters, so with dense embeddings it has the dense byte model's 44.3M (the table's dense
            # byte row). Check against the one-hot number without embeddings instead.
            assert abs(c["total"] - c["embeddings"] - paper) / paper < 0.01
        else:
            assert abs(c["total"] - paper) / paper < 0.01


def test_flops_estimate_counts_the_variant_extras():
    from scaletrain.models import estimate_flops_per_token

    S, T = 100, 80
    base = estimate_flops_per_token(ModelConfig(), S, T, 360)
    moce = estimate_flops_per_token(ModelConfig(arch="moce", conv=ConvConfig(kernels=[0, 1, 3, 5, 7, 9])), S, T, 360)
    assert moce - base == pytest.approx(6 * 3 * S * 8 * 64 * 64 * 25 / T)
    msc = estimate_flops_per_token(ModelConfig(arch="msc", conv=ConvConfig(kernels=[0, 0, 3, 3, 5, 5, 7, 7])), S, T, 360)
    assert msc - base == pytest.approx(6 * S * 64 * 64 * 30 / T)
    ncf = estimate_flops_per_token(ModelConfig(arch="byte_ncf", lobef=LobefConfig(byte_layers=4), encoder_layers=2), S, T, 360)
    assert ncf - base == pytest.approx(6 * S * 512 * 512 * 3 / T)
    wsf = estimate_flops_per_token(ModelConfig(arch="byte_wsf", lobef=LobefConfig(byte_layers=2), encoder_layers=4), S, T, 360)
    assert wsf == pytest.approx(base)


@pytest.mark.parametrize("name", ["transformer", "transformer_onehot", "byte_ncf", "byte_wsf", "msc", "moce_lid"])
def test_bf16_weights_train_with_fp32_loss(name):
    m = make(name).bfloat16().train()
    srcs, tgts = data(2)
    src, tgt = right(srcs), right(tgts)
    logits = m(src, tgt)
    assert logits.dtype == torch.bfloat16
    loss, nll, n = label_smoothed_ce(logits, torch.roll(tgt, -1, 1).masked_fill(tgt.eq(PAD), PAD))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad.float()).all() for p in m.parameters())
