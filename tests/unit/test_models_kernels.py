"""The CPU kernel twins (bmm attention, bit-sliced dropout) against PyTorch's own ops."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from scaletrain.config import load_config
from scaletrain.errors import ScaletrainError
from scaletrain.models import build_model, kernels
from scaletrain.models.config import ModelConfig


def _qkv(dtype, B=3, H=4, T=7, S=9, Dh=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dh, generator=g).to(dtype)
    k = torch.randn(B, H, S, Dh, generator=g).to(dtype)
    v = torch.randn(B, H, S, Dh, generator=g).to(dtype)
    return q, k, v


def _grads(impl, q, k, v, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = kernels.attention(q, k, v, impl=impl, **kw)
    g = torch.Generator().manual_seed(1)
    o.backward(torch.randn(o.shape, generator=g).to(o.dtype))
    return o.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("masking", ["none", "keys", "causal", "full", "keys+scale"])
def test_bmm_attention_equals_sdpa_outputs_and_gradients(dtype, tol, masking):
    q, k, v = _qkv(dtype, S=7 if masking == "causal" else 9)
    kw = {}
    if masking.startswith("keys"):
        mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
        mask[0, ..., 6:] = False
        mask[2, ..., 1:] = False  # one real key only
        kw["mask"] = mask
    if masking == "causal":
        kw["is_causal"] = True
    if masking == "full":  # a per-head, per-query mask (WSF-style blocks) with the diagonal kept
        g = torch.Generator().manual_seed(3)
        mask = torch.rand(3, 4, 7, 9, generator=g) > 0.5
        mask[..., torch.arange(7), torch.arange(7)] = True
        kw["mask"] = mask
    if masking == "keys+scale":
        kw["scale"] = 0.37
    ref = _grads("sdpa", q, k, v, **kw)
    got = _grads("bmm", q, k, v, **kw)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ref, got):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= tol * max(1.0, a.float().abs().max().item()), (name, err)


def test_masked_keys_get_no_weight_on_the_bmm_path():
    q, k, v = _qkv(torch.float32)
    mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    mask[..., 4:] = False
    out = kernels.attention(q, k, v, mask=mask, impl="bmm")
    v2 = v.clone()
    v2[..., 4:, :] = 1e4  # masked values may be anything
    assert torch.equal(out, kernels.attention(q, k, v2, mask=mask, impl="bmm"))


def test_auto_picks_bmm_for_cpu_training_in_reduced_precision_and_for_few_queries(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k, v = (t.requires_grad_() for t in _qkv(torch.bfloat16))
    kernels.attention(q, k, v)
    assert calls == []  # bf16 with gradients: bmm
    with torch.no_grad():
        kernels.attention(*_qkv(torch.bfloat16, T=16))
        assert calls == [1]  # no gradients, many queries (encoder at inference): SDPA's fast forward
        kernels.attention(q, k, v)
    assert calls == [1]  # no gradients, at most 8 queries (a sentence's beams in beam search): bmm
    kernels.attention(*(t.float() for t in (q, k, v)))
    assert calls == [1, 1]  # fp32: SDPA
    kernels.attention(q, k, v, mode="torch")
    assert calls == [1, 1, 1]
    with torch.no_grad():  # one query per row (incremental decoding): bmm, in any precision
        out = kernels.attention(q[:, :, :1].float(), k.float(), v.float())
        assert calls == [1, 1, 1]
        ref = real(q[:, :, :1].float(), k.float(), v.float())
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_keep_mask_rate_lanes_and_independence():
    torch.manual_seed(0)
    n = 1 << 20
    m = kernels.keep_mask((n,), 0.1)
    assert m.dtype == torch.bool and m.shape == (n,)
    # keep probability 1 - round(0.1 * 2^15) / 2^15; binomial sd ~ 3e-4
    want = 1 - round(0.1 * 2**15) / 2**15
    assert abs(m.float().mean().item() - want) < 2e-3
    # every 16-bit lane of the 64-bit draws is unbiased (the int64 sign bit must not leak in)
    lanes = m.view(-1, 4).float().mean(0)
    assert (lanes - want).abs().max().item() < 4e-3
    # neighbours are independent: P(both kept) = p^2
    both = (m[:-1] & m[1:]).float().mean().item()
    assert abs(both - want * want) < 3e-3
    # odd sizes and shapes
    assert kernels.keep_mask((3, 5, 7), 0.5).shape == (3, 5, 7)


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_dropout_is_unbiased_and_zeroes_the_same_entries_in_backward(p):
    torch.manual_seed(0)
    x = torch.ones(512, 1024, requires_grad=True)
    y = kernels.dropout(x, p, True)
    kept = y != 0
    scale = 1 / (1 - round(p * 2**15) / 2**15)
    assert torch.allclose(y[kept], torch.full_like(y[kept], scale))
    assert abs(y.mean().item() - 1.0) < 0.01
    y.sum().backward()
    assert torch.equal(x.grad != 0, kept)
    assert kernels.dropout(x, p, False) is x
    assert kernels.dropout(x, 0.0, True) is x


def test_dropout_is_seeded_by_the_default_generator():
    x = torch.randn(64, 64)
    torch.manual_seed(5)
    a = kernels.dropout(x, 0.2, True)
    torch.manual_seed(5)
    b = kernels.dropout(x, 0.2, True)
    assert torch.equal(a, b)


def test_model_kernels_config_is_validated_and_applied():
    cfg = ModelConfig(d_model=32, n_heads=4, encoder_layers=1, decoder_layers=1, ffn_dim=64, max_positions=64)
    cfg.kernels = "fast"
    with pytest.raises(ScaletrainError, match="model.kernels"):
        build_model(cfg, 268)
    cfg.kernels = "torch"
    model = build_model(cfg, 268)
    assert {m.kernel_mode for m in model.modules() if hasattr(m, "kernel_mode")} == {"torch"}
    assert load_config("small").model.kernels == "auto"


def test_bf16_training_step_matches_between_kernel_families():
    """One model, same weights and batch, dropout off: the two families give the same loss and grads."""
    cfg = ModelConfig(d_model=64, n_heads=4, encoder_layers=2, decoder_layers=2, ffn_dim=128, max_positions=64,
                      dropout=0.0)
    torch.manual_seed(0)
    model = build_model(cfg, 268).to(torch.bfloat16).train()
    src = torch.randint(4, 268, (4, 11))
    src[1, 7:] = 0
    tgt = torch.randint(4, 268, (4, 9))
    out = {}
    for mode in ("torch", "auto"):
        kernels.set_mode(model, mode)
        model.zero_grad()
        logits = model(src, tgt)
        logits.float().logsumexp(-1).mean().backward()
        assert all(p.grad is not None for p in model.parameters()), mode  # every parameter is reached
        out[mode] = (logits.float(), [p.grad.float().clone() for p in model.parameters()])
    assert (out["torch"][0] - out["auto"][0]).abs().max().item() < 0.1
    for a, b in zip(out["torch"][1], out["auto"][1]):
        assert (a - b).norm().item() <= 0.05 * a.norm().item() + 1e-3
    assert math.isfinite(out["auto"][0].sum().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "autocast"])
def test_residual_dropout_is_x_plus_dropout_with_exact_scale_and_gradients(dtype):
    """``autocast``: an fp32 residual stream and a bf16 branch (a Linear's output under torch.autocast)."""
    x = torch.randn(256, 64).to(torch.float32 if dtype == "autocast" else dtype).requires_grad_()
    y = torch.randn(256, 64).to(torch.bfloat16 if dtype == "autocast" else dtype).requires_grad_()
    torch.manual_seed(7)
    out = kernels.residual_dropout(x, y, 0.2, True)
    torch.manual_seed(7)
    keep = kernels.keep_mask(y.shape, 0.2)
    scale = 1 / (1 - round(0.2 * 2**15) / 2**15)
    ref = x.detach().float() + y.detach().float() * keep.float() * scale  # one rounding at the end
    tol = 2.0**-7 * ref.abs().max().item() if dtype == torch.bfloat16 else 0
    assert out.dtype == x.dtype and (out.detach().float() - ref).abs().max().item() <= tol + 1e-6
    out.float().sum().backward()
    assert torch.equal(x.grad.float(), torch.ones(256, 64))
    assert torch.allclose(y.grad.float(), keep.float() * scale, rtol=2**-7)
    # off in eval mode / p = 0; the stock family gives x + F.dropout(y)
    assert torch.equal(kernels.residual_dropout(x, y, 0.2, False), x + y)
    torch.manual_seed(7)
    a = kernels.residual_dropout(x, y, 0.2, True, mode="torch")
    torch.manual_seed(7)
    assert torch.equal(a, x + torch.nn.functional.dropout(y, 0.2, True))


def test_a_second_model_with_other_kernels_leaves_the_first_unchanged():
    """``model.kernels`` lives on each model's modules: building a ``torch`` model after an ``auto`` one
    changes neither how the ``auto`` model computes (dropout masks, attention) nor its MoCE dispatch."""
    cfg = ModelConfig(arch="moce", d_model=32, n_heads=4, encoder_layers=1, decoder_layers=1, ffn_dim=64,
                      max_positions=64, dropout=0.2, attention_dropout=0.1)
    torch.manual_seed(0)
    first = build_model(cfg, 268).to(torch.bfloat16).train()
    src, tgt = torch.randint(4, 268, (3, 9)), torch.randint(4, 268, (3, 7))

    def run():
        torch.manual_seed(3)
        return first(src, tgt).float()

    before = run()
    torch.manual_seed(0)
    second = build_model(dataclasses.replace(cfg, kernels="torch"), 268).to(torch.bfloat16).train()
    assert torch.equal(run(), before)
    z = torch.zeros(3, 3, 4, 9, 8)
    assert first.encoder_layers[0].self_attn.variant.routed_path(z)  # auto: routed on CPU
    assert not second.encoder_layers[0].self_attn.variant.routed_path(z)  # torch: the dense bank
    torch.manual_seed(3)
    assert not torch.equal(second(src, tgt).float(), before)  # the torch family draws other masks
