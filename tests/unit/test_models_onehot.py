"""Embeddingless one-hot model (Shaham & Levy 2021; docs/MODELS.md §3 and the §14 invariants)."""
from __future__ import annotations

import math

import pytest
import torch

from scaletrain.errors import ScaletrainError
from scaletrain.models import ModelConfig, build_model, count_parameters
from scaletrain.models.config import OneHotConfig
from scaletrain.models.loss import label_smoothed_ce
from scaletrain.vocab import PAD

V = 40  # small vocabulary so one-hot fits in a tiny d_model (real runs: V=270 <= d=512)
D = 48


def cfg(**kw) -> ModelConfig:
    base = dict(
        d_model=D,
        n_heads=4,
        encoder_layers=2,
        decoder_layers=2,
        ffn_dim=64,
        dropout=0.0,
        max_positions=64,
        embedding="onehot",
        encoder_input_dropout=False,
        decoder_last_layer_dropout=False,
    )
    base.update(kw)
    return ModelConfig(**base)


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return build_model(cfg(**kw), V)


def toks(seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, V, (3, 9), generator=g)
    tgt = torch.randint(4, V, (3, 7), generator=g)
    src[0, 6:] = PAD
    tgt[0, 4:] = PAD
    return src, tgt


def test_table_is_identity_with_zero_pad_row_and_no_gradient():
    m = make()
    E = m.embeddings.table
    assert E.shape == (V, D) and not E.requires_grad
    assert all(p is not E for p in m.parameters())
    for i in range(1, V):
        expected = torch.zeros(D)
        expected[i] = 1.0
        assert torch.equal(E[i], expected)
    assert E[PAD].abs().sum() == 0
    assert "embeddings.table" not in m.state_dict()  # derived, not saved


def test_exactly_three_learnable_scalars_input_ones_at_sqrt_d_output_at_one():
    m = make()
    emb_params = list(m.embeddings.parameters())
    assert len(emb_params) == 3 and all(p.numel() == 1 for p in emb_params)
    e = m.embeddings
    assert e.encoder_scale.item() == pytest.approx(math.sqrt(D))
    assert e.decoder_scale.item() == pytest.approx(math.sqrt(D))
    # the logit scale starts at 1 like a tied model's (docs/MODELS.md §3), not at sqrt(d)
    assert e.output_scale.item() == 1.0
    dense = build_model(cfg(embedding="learned"), V)
    # relative to a learned shared embedding: -V*d + 3
    assert count_parameters(m)["total"] == count_parameters(dense)["total"] - V * D + 3
    # and they learn
    src, tgt = toks()
    loss, _, _ = label_smoothed_ce(m.train()(src, tgt), torch.roll(tgt, -1, 1))
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().item() > 0 for p in emb_params)


def test_constant_scales_option():
    m = make(onehot=OneHotConfig(learnable_scales=False))
    assert len(list(m.embeddings.parameters())) == 0
    src, _ = toks()
    x = m.embeddings.encoder_input(src)
    assert x[0, 0, src[0, 0]].item() == pytest.approx(math.sqrt(D))


def test_encoder_input_identical_in_train_and_eval_mode():
    m = make(dropout=0.5)
    src, _ = toks()
    torch.testing.assert_close(m.train().embed_source(src), m.eval().embed_source(src))


def test_last_decoder_layer_has_no_residual_dropout():
    m = make(dropout=0.3)
    assert m.decoder_layers[-1].residual_dropout == 0.0
    assert all(layer.residual_dropout == 0.3 for layer in m.decoder_layers[:-1])


def test_logits_are_scaled_first_v_coordinates_and_pad_logit_is_zero():
    m = make().eval()
    with torch.no_grad():
        m.embeddings.output_scale.fill_(3.5)
    src, tgt = toks()
    h_holder = {}
    # capture the decoder's final hidden state (post-LN: output of the last layer)
    m.decoder_layers[-1].register_forward_hook(lambda mod, i, o: h_holder.update(h=o))
    logits = m(src, tgt)
    h = h_holder["h"]
    expected = 3.5 * h[..., :V].clone()
    expected[..., PAD] = 0.0
    torch.testing.assert_close(logits, expected)
    assert logits[..., PAD].abs().max() == 0


@pytest.mark.parametrize("kind", ["output", "encoder", "decoder"])
def test_scale_gradients_are_reduced_in_fp32_under_fp16_autocast(kind):
    """A learnable scale's gradient sums over every element it multiplies; loss-scaled (65536) that sum
    leaves fp16's range, so it must be reduced in fp32 (else inf and a skipped step every time)."""
    m = make()
    e = m.embeddings
    g = torch.Generator().manual_seed(3)
    scale = {"output": e.output_scale, "encoder": e.encoder_scale, "decoder": e.decoder_scale}[kind]
    tokens = torch.randint(4, V, (16, 64), generator=g)
    h = torch.randn(16, 64, D, generator=g)
    grads = []
    for dtype in (torch.float16, None):
        scale.grad = None
        with torch.autocast("cpu", dtype=torch.float16, enabled=dtype is not None):
            x = e.output(h.half() if dtype else h) if kind == "output" else e(tokens, kind)
        seed = torch.Generator().manual_seed(4)
        (x.float() * torch.rand(x.shape, generator=seed) * 32768.0).sum().backward()
        grads.append(scale.grad.clone())
    assert abs(float(grads[1])) > 65504  # the sum is out of fp16's range, and still exact enough
    assert torch.isfinite(grads[0]).all()
    torch.testing.assert_close(grads[0], grads[1], rtol=2e-3, atol=0)


def test_decoder_input_dropout_deletes_about_half_the_tokens():
    m = make(dropout=0.5).train()
    torch.manual_seed(1)
    tokens = torch.randint(4, V, (64, 64))
    e = m.embeddings.decoder_input(tokens)
    pos = m.positions(tokens)
    x = m._decoder_input(tokens, pos)
    # the token coordinate of x is either dropped (only the position encoding part remains, times 0)
    # or kept (scaled by 1/(1-p)); check the one-hot coordinate
    coord = x.gather(-1, tokens[..., None]).squeeze(-1)
    kept = coord.ne(0)
    frac_dropped = 1 - kept.float().mean().item()
    assert 0.45 < frac_dropped < 0.55
    expected_kept = (e + pos).gather(-1, tokens[..., None]).squeeze(-1) / 0.5
    torch.testing.assert_close(coord[kept], expected_kept[kept])


def test_onehot_unshared_output_is_learned_matrix_lobef_style():
    m = make(share_embeddings=False, onehot=OneHotConfig(learnable_scales=False), encoder_input_dropout=True)
    c = count_parameters(m)
    assert c["embeddings"] == V * D  # only the learned output projection
    src, tgt = toks()
    assert m(src, tgt).shape == (3, 7, V)


def test_onehot_needs_vocab_not_larger_than_d_model():
    with pytest.raises(ScaletrainError, match="model.embedding"):
        build_model(cfg(d_model=32, n_heads=4), V + 10)


def test_onehot_decode_step_matches_forward():
    m = make().eval()
    src, tgt = toks()
    full = m(src, tgt)
    enc = m.encode(src)
    cache = None
    for t in range(tgt.shape[1]):
        logits, cache = m.decode_step(tgt[:, t], t, enc, cache)
        torch.testing.assert_close(logits[1:], full[1:, t], atol=1e-5, rtol=0)


@pytest.mark.parametrize("learnable", [True, False])
def test_runs_when_an_engine_casts_only_the_parameters_to_bf16(learnable):
    """DeepSpeed ZeRO-1/2 in bf16 casts the parameters and leaves buffers (the one-hot table) in fp32: the
    model must still run, in the parameters' dtype, and match the fp32 model within bf16 round-off."""
    from scaletrain.models.config import OneHotConfig

    m = make(onehot=OneHotConfig(learnable_scales=learnable))
    m.eval()
    src, tgt = toks()
    with torch.no_grad():
        ref = m(src, tgt).float()
        for p in m.parameters():
            p.data = p.data.to(torch.bfloat16)
        assert m.embeddings.table.dtype == torch.float32  # the buffer stays as such an engine leaves it
        out = m(src, tgt)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.05)
