"""Transformer core, loss and incremental decoding (tiny configs, CPU, seconds)."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import decode_all
from scaletrain.errors import ScaletrainError
from scaletrain.models import (
    DecoderCache,
    EncoderContext,
    ModelConfig,
    build_model,
    count_parameters,
    estimate_flops_per_token,
)
from scaletrain.models.loss import label_smoothed_ce
from scaletrain.models.transformer import SelfAttention, SinusoidalPositions, sinusoidal_table
from scaletrain.vocab import PAD

V = 270  # 4 specials + 256 bytes + 10 language tags


def tiny(**kw) -> ModelConfig:
    base = dict(d_model=32, n_heads=4, encoder_layers=2, decoder_layers=2, ffn_dim=64, dropout=0.0, max_positions=64)
    base.update(kw)
    return ModelConfig(**base)


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return build_model(tiny(**kw), V).eval()


def rand_ids(gen, *shape):
    return torch.randint(4, 260, shape, generator=gen)


def batch_from(rows_src, rows_tgt, S=None, T=None):
    """Right-padded src / tgt_in from lists of id lists."""
    S = S or max(map(len, rows_src))
    T = T or max(map(len, rows_tgt))
    src = torch.zeros(len(rows_src), S, dtype=torch.long)
    tgt = torch.zeros(len(rows_tgt), T, dtype=torch.long)
    for i, r in enumerate(rows_src):
        src[i, : len(r)] = torch.tensor(r)
    for i, r in enumerate(rows_tgt):
        tgt[i, : len(r)] = torch.tensor(r)
    return src, tgt


def sentences(seed=1, n=3):
    g = torch.Generator().manual_seed(seed)
    srcs, tgts = [], []
    for i in range(n):
        ls, lt = 4 + 3 * i, 3 + 2 * i
        srcs.append([260 + i] + rand_ids(g, ls).tolist() + [2])
        tgts.append([261 + i] + rand_ids(g, lt).tolist())
    return srcs, tgts


# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("pre_ln", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_shapes_and_both_layer_norm_placements(pre_ln, activation):
    m = make(pre_ln=pre_ln, activation=activation)
    src, tgt = batch_from(*sentences())
    logits = m(src, tgt)
    assert logits.shape == (3, tgt.shape[1], V) and logits.dtype == torch.float32
    enc = m.encode(src)
    assert enc.out.shape == (3, src.shape[1], 32)
    assert torch.equal(enc.pad_mask, src.eq(PAD))
    step_logits, cache = m.decode_step(tgt[:, 0], 0, enc, None)
    assert step_logits.shape == (3, V) and isinstance(cache, DecoderCache)
    assert m.last_aux_loss is None
    # pre-LN stacks end with a LayerNorm, post-LN ones do not
    assert (m.encoder_norm is not None) == pre_ln and (m.decoder_norm is not None) == pre_ln
    # it trains: gradients reach every parameter and are finite
    m.train()
    loss, _, _ = label_smoothed_ce(m(src, tgt), torch.roll(tgt, -1, 1))
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert any(p.grad.abs().sum() > 0 for p in m.parameters())


def test_post_ln_and_pre_ln_compute_different_functions():
    a, b = make(seed=3, pre_ln=False), make(seed=3, pre_ln=True)
    src, tgt = batch_from(*sentences())
    assert not torch.allclose(a(src, tgt), b(src, tgt), atol=1e-3)


def test_causal_mask_future_targets_do_not_change_the_past():
    m = make()
    src, tgt = batch_from(*sentences())
    ref = m(src, tgt)
    g = torch.Generator().manual_seed(9)
    for t in range(1, tgt.shape[1]):
        changed = tgt.clone()
        changed[:, t:] = rand_ids(g, 3, tgt.shape[1] - t)
        out = m(src, changed)
        torch.testing.assert_close(out[:, :t], ref[:, :t], atol=1e-5, rtol=0)
        assert (out[:, t:] - ref[:, t:]).abs().max() > 1e-4  # the future did see the change


@pytest.mark.parametrize("pre_ln", [False, True])
def test_padding_invariance_extra_padding_and_longer_neighbour(pre_ln):
    m = make(pre_ln=pre_ln)
    srcs, tgts = sentences(n=2)
    src, tgt = batch_from(srcs, tgts)
    ref = m(src, tgt)
    # more right padding on both sides
    src2, tgt2 = batch_from(srcs, tgts, S=src.shape[1] + 7, T=tgt.shape[1] + 5)
    out2 = m(src2, tgt2)
    # a longer sentence joins the batch
    g = torch.Generator().manual_seed(5)
    long_src = [262] + rand_ids(g, 20).tolist() + [2]
    long_tgt = [263] + rand_ids(g, 15).tolist()
    src3, tgt3 = batch_from(srcs + [long_src], tgts + [long_tgt])
    out3 = m(src3, tgt3)
    for i, t in enumerate(tgts):
        n = len(t)
        torch.testing.assert_close(out2[i, :n], ref[i, :n], atol=1e-5, rtol=0)
        torch.testing.assert_close(out3[i, :n], ref[i, :n], atol=1e-5, rtol=0)
    # encoder states at real positions too
    for i, s in enumerate(srcs):
        torch.testing.assert_close(m.encode(src3).out[i, : len(s)], m.encode(src).out[i, : len(s)], atol=1e-5, rtol=0)


def test_left_and_right_padded_source_give_same_real_outputs():
    m = make()
    srcs, tgts = sentences(n=2)
    src, tgt = batch_from(srcs, tgts)
    left = torch.zeros_like(src)
    for i, s in enumerate(srcs):
        left[i, src.shape[1] - len(s) :] = torch.tensor(s)
    a, b = m(src, tgt), m(left, tgt)
    for i, t in enumerate(tgts):
        torch.testing.assert_close(a[i, : len(t)], b[i, : len(t)], atol=1e-5, rtol=0)


def test_pad_keys_are_masked_in_self_and_cross_attention():
    torch.manual_seed(0)
    attn = SelfAttention(32, 4, 0.0).eval()
    tokens = torch.tensor([[260, 10, 11, 2, 0, 0], [261, 12, 13, 14, 15, 2]])
    ctx = EncoderContext(tokens, tokens.eq(PAD), None)
    x = torch.randn(2, 6, 32)
    y = x.clone()
    y[0, 4:] = torch.randn(2, 32) * 100  # garbage at pad positions of row 0
    a, b = attn(x, ctx), attn(y, ctx)
    torch.testing.assert_close(a[0, :4], b[0, :4], atol=1e-6, rtol=0)
    torch.testing.assert_close(a[1], b[1], atol=1e-6, rtol=0)
    # unmasked, the garbage would have leaked
    ctx_nomask = EncoderContext(tokens, torch.zeros_like(ctx.pad_mask), None)
    assert (attn(x, ctx_nomask)[0, :4] - attn(y, ctx_nomask)[0, :4]).abs().max() > 1e-3

    m = make()
    src, tgt = batch_from(*sentences(n=2))
    enc = m.encode(src)
    ref = m.decode(tgt, enc)
    enc.out = enc.out.masked_fill(enc.pad_mask[..., None], 1e3)  # cross-attention keys/values at pads
    torch.testing.assert_close(m.decode(tgt, enc), ref, atol=1e-5, rtol=0)


def test_positions_are_zero_at_pads_and_count_real_tokens():
    pos = SinusoidalPositions(16, 32)
    tokens = torch.tensor([[5, 6, 7, 0, 0], [0, 0, 5, 6, 7]])
    e = pos(tokens)
    assert e[0, 3:].abs().sum() == 0 and e[1, :2].abs().sum() == 0
    torch.testing.assert_close(e[0, :3], e[1, 2:])
    table = sinusoidal_table(4, 16)
    # fairseq formula: position 1, first frequency -> sin(1), first cos column -> cos(1)
    assert math.isclose(table[1, 0].item(), math.sin(1.0), abs_tol=1e-6)
    assert math.isclose(table[1, 8].item(), math.cos(1.0), abs_tol=1e-6)
    assert math.isclose(table[2, 7].item(), math.sin(2 * 10000 ** (-7 / 7)), abs_tol=1e-6)
    with pytest.raises(ScaletrainError, match="max_positions"):
        pos(torch.ones(1, 33, dtype=torch.long))


# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("pre_ln", [False, True])
@pytest.mark.parametrize("share", [True, False])
def test_decode_step_matches_full_forward(pre_ln, share):
    m = make(pre_ln=pre_ln, share_embeddings=share)
    srcs, tgts = sentences(n=3)
    src, tgt = batch_from(srcs, tgts)
    full = m(src, tgt)
    inc = decode_all(m, src, tgt)
    for i, t in enumerate(tgts):  # real positions (incremental decoding never sees pads)
        torch.testing.assert_close(inc[i, : len(t)], full[i, : len(t)], atol=1e-5, rtol=0)
    with pytest.raises(ScaletrainError):
        m.decode_step(tgt[:, 1], 1, m.encode(src), None)


def test_reorder_cache_matches_decoding_the_reordered_batch():
    m = make()
    g = torch.Generator().manual_seed(2)
    src = torch.cat([torch.tensor([[260], [261], [262]]), rand_ids(g, 3, 6), torch.full((3, 1), 2)], 1)
    tgt = torch.cat([torch.tensor([[263], [264], [265]]), rand_ids(g, 3, 5)], 1)
    index = torch.tensor([2, 0, 0, 1])  # reorder + expand, as beam search does
    enc = m.encode(src)
    cache = None
    for t in range(3):
        _, cache = m.decode_step(tgt[:, t], t, enc, cache)
    enc_r = enc.index_select(index)
    cache_r = m.reorder_cache(cache, index)
    tgt_r = tgt[index]
    got = []
    for t in range(3, tgt.shape[1]):
        logits, cache_r = m.decode_step(tgt_r[:, t], t, enc_r, cache_r)
        got.append(logits)
    ref = m(src[index], tgt_r)[:, 3:]
    torch.testing.assert_close(torch.stack(got, 1), ref, atol=1e-5, rtol=0)
    # the original cache is untouched by reordering
    assert cache.layers[0]["k"].shape[0] == 3 and cache_r.layers[0]["k"].shape[0] == 4


# ---------------------------------------------------------------------------------------
def test_loss_ignores_padding_and_counts_real_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    target = torch.tensor([[4, 5, 6, 0, 0], [7, 8, 9, 10, 2]])
    loss, nll, n = label_smoothed_ce(logits, target, 0.1)
    assert n.item() == 8 and n.dtype == torch.int64
    other = logits.clone()
    other[0, 3:] = torch.randn(2, 11, generator=g) * 50
    loss2, nll2, n2 = label_smoothed_ce(other, target, 0.1)
    assert loss2.item() == pytest.approx(loss.item(), abs=1e-6) and nll2.item() == pytest.approx(nll.item(), abs=1e-6)
    # nll_sum is the plain summed cross entropy over real tokens
    ref = torch.nn.functional.cross_entropy(logits.view(-1, 11), target.view(-1), ignore_index=0, reduction="sum")
    assert nll.item() == pytest.approx(ref.item(), rel=1e-6)
    # epsilon 0 -> loss == nll
    l0, n0, _ = label_smoothed_ce(logits, target, 0.0)
    assert l0.item() == pytest.approx(n0.item(), rel=1e-7)


def test_label_smoothing_matches_hand_computation():
    logits = torch.tensor([[[1.0, 2.0, 0.5, -1.0, 3.0]]])  # V = 5, pad = 0
    target = torch.tensor([[2]])
    eps = 0.1
    z = math.log(sum(math.exp(v) for v in [1.0, 2.0, 0.5, -1.0, 3.0]))
    lp = [v - z for v in [1.0, 2.0, 0.5, -1.0, 3.0]]
    # q(c) = (1-eps)[c==y] + eps/(V-1) for c != pad, q(pad) = 0
    q = [0.0] + [eps / 4] * 4
    q[2] += 1 - eps
    expected = -sum(qc * l for qc, l in zip(q, lp))
    loss, nll, n = label_smoothed_ce(logits, target, eps)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert nll.item() == pytest.approx(-lp[2], rel=1e-6)
    assert n.item() == 1


def test_loss_is_fp32_for_bf16_logits():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 20, generator=g)
    target = torch.randint(1, 20, (3, 4), generator=g)
    loss_bf16, _, _ = label_smoothed_ce(logits.bfloat16(), target)
    loss_fp32, _, _ = label_smoothed_ce(logits.bfloat16().float(), target)
    assert loss_bf16.dtype == torch.float32
    assert loss_bf16.item() == pytest.approx(loss_fp32.item(), rel=1e-6)
    with pytest.raises(ScaletrainError):
        label_smoothed_ce(logits, target[:, :2])


# ---------------------------------------------------------------------------------------
def _layer_params(d, f, decoder):
    attn = 4 * (d * d + d)
    ffn = d * f + f + f * d + d
    return (2 * attn if decoder else attn) + ffn + (3 if decoder else 2) * 2 * d


def test_parameter_counts_tiny_and_paper_size():
    m = make()
    c = count_parameters(m)
    assert c["embeddings"] == V * 32
    assert c["encoder"] == 2 * _layer_params(32, 64, False)
    assert c["decoder"] == 2 * _layer_params(32, 64, True)
    assert c["frontend"] == 0 and c["variant"] == 0
    assert c["total"] == sum(p.numel() for p in m.parameters()) == c["trainable"]
    unshared = count_parameters(make(share_embeddings=False))
    assert unshared["embeddings"] == 3 * V * 32
    pre = count_parameters(make(pre_ln=True))
    assert pre["encoder"] == c["encoder"] + 64 and pre["decoder"] == c["decoder"] + 64  # final LayerNorms
    # paper size: byte Transformer (d 512, ffn 2048, 6+6, post-LN, shared) = 44.3M (MoCE Table; LOBEF Table 7)
    big = build_model(ModelConfig(), 360)  # OPUS-100: 4 + 256 + 100 tags
    n = count_parameters(big)["total"]
    assert n == 6 * _layer_params(512, 2048, False) + 6 * _layer_params(512, 2048, True) + 360 * 512
    assert abs(n - 44.3e6) / 44.3e6 < 0.01


def test_shared_embeddings_are_one_tensor():
    m = make()
    emb = m.embeddings
    w = emb.weight
    assert sum(1 for _ in m.parameters() if _ is w) == 1
    src, tgt = batch_from(*sentences(n=2))
    # encoder input, decoder input and output all read the same matrix
    loss, _, _ = label_smoothed_ce(m(src, tgt), torch.roll(tgt, -1, 1))
    loss.backward()
    enc_rows = src.unique()
    assert (w.grad[enc_rows[enc_rows != PAD]].abs().sum(-1) > 0).all()
    with torch.no_grad():
        before = m(src, tgt)
        w[src[0, 1]] += 1.0  # a source-only byte row
        after_src = m(src, tgt)
        assert (after_src - before).abs().max() > 1e-4
        w[tgt[0, 1]] += 1.0
        assert (m(src, tgt) - after_src).abs().max() > 1e-4
    # output projection == h @ E^T
    h = torch.randn(2, 3, 32)
    torch.testing.assert_close(emb.output(h), h @ w.T)
    # pad positions embed to exactly zero even if the shared pad row drifts (output-projection grads)
    with torch.no_grad():
        w[PAD] += 1.0
    assert emb.encoder_input(src)[src.eq(PAD)].abs().sum() == 0
    assert emb.decoder_input(tgt)[tgt.eq(PAD)].abs().sum() == 0
    fresh = make(seed=11)
    assert fresh.embeddings.weight[PAD].abs().sum() == 0
    std = build_model(ModelConfig(), 360).embeddings.weight[1:].std().item()
    assert std == pytest.approx(512**-0.5, rel=0.05)


def test_dropout_switches_and_eval_determinism():
    m = make(dropout=0.3, decoder_last_layer_dropout=False)
    assert m.decoder_layers[-1].residual_dropout == 0.0 and m.decoder_layers[0].residual_dropout == 0.3
    src, tgt = batch_from(*sentences(n=2))
    m.eval()
    torch.testing.assert_close(m(src, tgt), m(src, tgt))
    m.train()
    assert (m(src, tgt) - m(src, tgt)).abs().max() > 1e-4
    # encoder input dropout off: the embedded source is the same in train and eval mode
    m2 = make(dropout=0.5, encoder_input_dropout=False).train()
    torch.testing.assert_close(m2.embed_source(src), m2.eval().embed_source(src))
    m3 = make(dropout=0.5).train()
    assert (m3.embed_source(src) - m3.eval().embed_source(src)).abs().max() > 1e-3


@pytest.mark.parametrize(
    "kw,key",
    [
        (dict(arch="nope"), "model.arch"),
        (dict(n_heads=5), "model.n_heads"),
        (dict(dropout=1.5), "model.dropout"),
        (dict(activation="tanh"), "model.activation"),
        (dict(embedding="fancy"), "model.embedding"),
        (dict(decoder_layers=0), "model.decoder_layers"),
        (dict(pre_ln="yes"), "model.pre_ln"),
    ],
)
def test_bad_config_names_the_key(kw, key):
    with pytest.raises(ScaletrainError, match=key):
        build_model(tiny(**kw), V)


def test_flops_per_token_hand_count():
    cfg = tiny()
    S, T, d, f = 10, 8, 32, 64
    enc = S * (4 * d * d + 2 * d * f) + 2 * S * S * d
    dec = T * (6 * d * d + 2 * d * f) + S * 2 * d * d + 2 * T * T * d + 2 * T * S * d
    expected = 6 * (2 * enc + 2 * dec + T * d * V) / T
    assert estimate_flops_per_token(cfg, S, T, V) == pytest.approx(expected)
    # for long sequences of a big model the estimate is dominated by 6 * N (nanoGPT rule)
    big = ModelConfig()
    n_params = count_parameters(build_model(big, 360))["total"]
    fl = estimate_flops_per_token(big, 64, 64, 360)
    assert 6 * n_params * 0.9 < fl < 6 * n_params * 1.3
