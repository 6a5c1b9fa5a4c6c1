"""MSC, MSHA and Ada-MSHA / MoCE (docs/MODELS.md §6-§8 and the §14 invariants)."""
from __future__ import annotations

import pytest
import torch

from scaletrain.errors import ScaletrainError
from scaletrain.models import EncoderContext, ModelConfig, build_model
from scaletrain.models.config import ConvConfig, MoCEConfig
from scaletrain.models.convattn import AdaMSHAAttention, MoCEExperts, MSCAttention, MSHAAttention
from scaletrain.models.transformer import SelfAttention, SharedEmbeddings
from scaletrain.vocab import LANG_OFFSET, PAD

D, H, DH = 32, 4, 8
V = 270


def cfg(**kw):
    base = dict(d_model=D, n_heads=H, encoder_layers=2, decoder_layers=1, ffn_dim=64, dropout=0.0, max_positions=64)
    base.update(kw)
    return ModelConfig(**base)


def ctx_for(tokens, embeddings=None):
    return EncoderContext(tokens, tokens.eq(PAD), embeddings)


def tokens_and_x(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 260, (3, 10), generator=g)
    tokens[:, 0] = torch.tensor([260, 261, 262])
    tokens[0, 7:] = PAD
    tokens[1, 9:] = PAD
    x = torch.randn(3, 10, D, generator=g)
    x[tokens.eq(PAD)] = 0.0
    return tokens, x


def plain_copy(attn) -> SelfAttention:
    ref = SelfAttention(D, H, 0.0)
    ref.load_state_dict({k: v for k, v in attn.state_dict().items() if not k.startswith("variant.")})
    return ref.eval()


def identity_init(module) -> None:
    with torch.no_grad():
        for w in module.weights:
            w.zero_()
            w[:, :, w.shape[-1] // 2] = torch.eye(w.shape[0])
        for b in module.biases:
            b.zero_()


def real(t, tokens):
    return t[tokens.ne(PAD)]


# ---- MSC / MSHA -----------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [MSCAttention, MSHAAttention])
def test_all_zero_kernels_equal_plain_attention(cls):
    torch.manual_seed(0)
    attn = cls(cfg(conv=ConvConfig(kernels=[0, 0, 0, 0]))).eval()
    assert sum(p.numel() for p in attn.variant.parameters()) == 0
    tokens, x = tokens_and_x()
    ctx = ctx_for(tokens)
    out = attn(x, ctx)
    assert out.shape == x.shape
    torch.testing.assert_close(real(out, tokens), real(plain_copy(attn)(x, ctx), tokens), atol=1e-6, rtol=0)


@pytest.mark.parametrize("cls", [MSCAttention, MSHAAttention])
def test_identity_initialised_convolutions_equal_plain_attention(cls):
    torch.manual_seed(0)
    attn = cls(cfg(conv=ConvConfig(kernels=[1, 3, 0, 5]))).eval()
    tokens, x = tokens_and_x()
    ctx = ctx_for(tokens)
    different = attn(x, ctx)
    identity_init(attn.variant)
    same = attn(x, ctx)
    ref = plain_copy(attn)(x, ctx)
    torch.testing.assert_close(real(same, tokens), real(ref, tokens), atol=1e-5, rtol=0)
    assert (real(different, tokens) - real(ref, tokens)).abs().max() > 1e-3


def test_msha_heads_with_kernel_zero_are_untouched_and_pads_do_not_leak():
    torch.manual_seed(0)
    attn = MSHAAttention(cfg(conv=ConvConfig(kernels=[3, 0, 5, 0]))).eval()
    tokens, x = tokens_and_x()
    ctx = ctx_for(tokens)
    q, k, v = (attn.split(p(x)) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    q2, k2, v2 = attn.transform_qkv(q, k, v, ctx)
    keep = tokens.ne(PAD)[:, None, :, None]
    for before, after in ((q, q2), (k, k2), (v, v2)):
        assert after.shape == before.shape
        for h in (1, 3):
            torch.testing.assert_close(after[:, h] * keep[:, 0], before[:, h] * keep[:, 0])
        for h in (0, 2):
            assert (after[:, h] - before[:, h]).abs().max() > 1e-3
    # garbage at pad positions of the *input* does not reach real positions (zeroed before the conv)
    y = x.clone()
    y[tokens.eq(PAD)] = 50.0
    torch.testing.assert_close(real(attn(x, ctx), tokens), real(attn(y, ctx), tokens), atol=1e-5, rtol=0)


def test_msc_convolves_the_input_per_head_chunk():
    torch.manual_seed(0)
    attn = MSCAttention(cfg(conv=ConvConfig(kernels=[0, 3, 0, 1]))).eval()
    tokens, x = tokens_and_x()
    ctx = ctx_for(tokens)
    xt = attn.transform_input(x, ctx)
    keep = tokens.ne(PAD)[..., None]
    torch.testing.assert_close((xt * keep)[..., 0:8], (x * keep)[..., 0:8])  # head 0: kernel 0
    torch.testing.assert_close((xt * keep)[..., 16:24], (x * keep)[..., 16:24])  # head 2: kernel 0
    # head 3, kernel 1: a per-position affine map of the chunk
    w, b = attn.variant.weights[1], attn.variant.biases[1]
    expected = x[..., 24:32] @ w[:, :, 0].T + b
    torch.testing.assert_close(xt[..., 24:32][tokens.ne(PAD)], expected[tokens.ne(PAD)], atol=1e-5, rtol=0)
    # head 1, kernel 3: position t mixes t-1, t, t+1 of its own sentence, zero beyond the sentence end
    w = attn.variant.weights[0]
    xs = x[0, :7, 8:16]  # sentence 0 has 7 real tokens
    padded = torch.cat([torch.zeros(1, 8), xs, torch.zeros(1, 8)])
    exp = sum(padded[j : j + 7] @ w[:, :, j].T for j in range(3)) + attn.variant.biases[0]
    torch.testing.assert_close(xt[0, :7, 8:16], exp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch,kernels", [("msc", [0, 0, 2, 3]), ("msha", [0, 1, 3]), ("moce", [0, -1]), ("moce", [])])
def test_bad_kernels_are_rejected(arch, kernels):
    with pytest.raises(ScaletrainError, match="model.conv.kernels"):
        build_model(cfg(arch=arch, conv=ConvConfig(kernels=kernels)), V)


def test_bad_layers_are_rejected():
    with pytest.raises(ScaletrainError, match="model.conv.layers"):
        build_model(cfg(arch="moce", conv=ConvConfig(layers=[2])), V)


# ---- Ada-MSHA / MoCE ---------------------------------------------------------------------------
def experts(kernels=(0, 1, 3, 5), top_k=2, lid=False, seed=0):
    torch.manual_seed(seed)
    return MoCEExperts(list(kernels), DH, top_k, lid, n_langs=10).eval()


def z_and_pads(seed=0, B=2, T=9):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(3, B, H, T, DH, generator=g)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, 6:] = True
    return z, pad


def test_routing_weights_are_a_top_k_distribution():
    for k in (1, 2, 3):
        ex = experts(top_k=k)
        z, _ = z_and_pads()
        w = ex.route(z, None)
        assert w.shape == (3, 2, H, 9, 4)
        assert (w >= 0).all()
        assert (w.gt(0).sum(-1) == k).all()
        torch.testing.assert_close(w.sum(-1), torch.ones(3, 2, H, 9))
        # top-k first, then softmax over the selected logits
        logits = ex.router(z)
        top = logits.topk(k, -1)
        torch.testing.assert_close(w.gather(-1, top.indices), torch.softmax(top.values, -1))


def test_identity_experts_give_plain_attention_for_any_router():
    c = cfg(arch="moce", conv=ConvConfig(kernels=[0, 1, 3, 5]))
    torch.manual_seed(0)
    attn = AdaMSHAAttention(c, V).eval()
    identity_init(attn.variant)
    tokens, x = tokens_and_x()
    emb = SharedEmbeddings(V, D, True)
    ref = plain_copy(attn)(x, ctx_for(tokens, emb))
    for seed in range(3):
        torch.manual_seed(seed)
        torch.nn.init.normal_(attn.variant.router.weight, std=3.0)
        out = attn(x, ctx_for(tokens, emb))
        torch.testing.assert_close(real(out, tokens), real(ref, tokens), atol=1e-5, rtol=0)


def test_delta_zero_single_identity_expert_equals_plain_attention():
    m = build_model(cfg(arch="moce", conv=ConvConfig(kernels=[0]), moce=MoCEConfig(top_k=2)), V).eval()
    attn = m.encoder_layers[0].self_attn
    assert attn.variant.top_k == 1  # clamped to the number of experts
    tokens, x = tokens_and_x()
    ctx = ctx_for(tokens, m.embeddings)
    torch.testing.assert_close(real(attn(x, ctx), tokens), real(plain_copy(attn)(x, ctx), tokens), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dispatch", ["dense", "routed"])
def test_all_experts_with_zero_router_average_uniformly(dispatch):
    ex = experts(kernels=(0, 1, 3, 5), top_k=4)
    ex.dispatch = dispatch
    with torch.no_grad():
        ex.router.weight.zero_()
    z, pad = z_and_pads()
    out = ex(z, pad, None, None)
    pad5 = pad[None, :, None, :, None]
    zz = z.masked_fill(pad5, 0.0)
    conv = ex.conv_outputs(zz.reshape(-1, 9, DH)).view(3, 2, H, 9, 3, DH)
    expected = ((zz + conv.sum(-2)) / 4).masked_fill(pad5, 0.0)  # pad rows are 0 on both paths
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_experts_and_router_are_shared_across_heads():
    ex = experts(lid=True)
    z, pad = z_and_pads()
    lid = torch.randn(2, H, DH)
    lang = torch.tensor([0, 1])
    out = ex(z, pad, lid, lang)
    perm = torch.tensor([2, 0, 3, 1])
    out_p = ex(z[:, :, perm], pad, lid[:, perm], lang)
    torch.testing.assert_close(out_p, out[:, :, perm], atol=1e-6, rtol=0)
    w = ex.route(z, lid[None, :, :, None, :])
    w_p = ex.route(z[:, :, perm], lid[None, :, perm, None, :])
    torch.testing.assert_close(w_p, w[:, :, perm])


def test_lid_router_input_is_head_slice_of_raw_source_tag_embedding():
    c = cfg(arch="moce", conv=ConvConfig(kernels=[0, 1, 3]), moce=MoCEConfig(lid=True))
    m = build_model(c, V).eval()
    attn = m.encoder_layers[0].self_attn
    ex = attn.variant
    assert ex.router.in_features == 2 * DH
    seen = {}
    ex.register_forward_hook(lambda mod, inp, out: seen.update(z=inp[0], lid=inp[2]))
    tokens, x = tokens_and_x()
    attn(x, ctx_for(tokens, m.embeddings))
    z, lid = seen["z"], seen["lid"]  # [3, B, H, T, DH], [B, H, DH]
    raw = m.embeddings.weight[tokens[:, 0]]  # unscaled row of the source tag, no position
    for h in range(H):
        torch.testing.assert_close(lid[:, h], raw[:, h * DH : (h + 1) * DH])
    # the query part is the scaled query (fidelity: routed after the Dh^-1/2 scaling)
    q = attn.split(attn.q_proj(x)) * DH**-0.5
    keep = tokens.ne(PAD)
    torch.testing.assert_close(z[0].transpose(1, 2)[keep], q.transpose(1, 2)[keep])
    # the router's logits are W_r [z; lid] with lid repeated at every position (split product)
    lid5 = lid[None, :, :, None, :]
    cat = torch.cat([z, lid5.expand(*z.shape[:-1], DH)], -1)
    torch.testing.assert_close(ex.router_logits(z, lid5), ex.router(cat), atol=1e-6, rtol=1e-6)


def test_lid_changes_routing_not_expert_outputs():
    ex = experts(lid=True)
    z, pad = z_and_pads()
    lid_a, lid_b = torch.randn(2, H, DH), torch.randn(2, H, DH) * 5
    wa = ex.route(z, lid_a[None, :, :, None, :])
    wb = ex.route(z, lid_b[None, :, :, None, :])
    assert (wa - wb).abs().max() > 1e-3
    assert not torch.equal(ex(z, pad, lid_a, None), ex(z, pad, lid_b, None))
    # the experts themselves never see the lid
    conv = ex.conv_outputs(z.reshape(-1, 9, DH))
    torch.testing.assert_close(conv, ex.conv_outputs(z.reshape(-1, 9, DH)))


def test_exactly_one_ada_msha_at_encoder_layer_0_by_default():
    m = build_model(cfg(arch="moce", encoder_layers=3), V)
    kinds = [type(layer.self_attn) for layer in m.encoder_layers]
    assert kinds == [AdaMSHAAttention, SelfAttention, SelfAttention]
    assert sum(isinstance(mod, MoCEExperts) for mod in m.modules()) == 1
    m2 = build_model(cfg(arch="moce", encoder_layers=3, conv=ConvConfig(layers=[1, 2])), V)
    assert [type(layer.self_attn) for layer in m2.encoder_layers] == [SelfAttention, AdaMSHAAttention, AdaMSHAAttention]


@pytest.mark.parametrize("kernels,lid", [([0, 1, 3, 5, 7, 9], False), ([0, 1, 3, 5, 7, 9, 11], True), ([0, 3], False)])
def test_parameter_delta_formula(kernels, lid):
    dense = sum(p.numel() for p in build_model(cfg(), V).parameters())
    m = build_model(cfg(arch="moce", conv=ConvConfig(kernels=kernels), moce=MoCEConfig(lid=lid)), V)
    n_conv = sum(1 for k in kernels if k)
    expected = DH**2 * sum(kernels) + DH * n_conv + len(kernels) * DH * (2 if lid else 1)
    assert sum(p.numel() for p in m.parameters()) - dense == expected


def test_pads_do_not_leak_into_expert_convolutions():
    ex = experts(kernels=(0, 3, 5), top_k=2)
    z, pad = z_and_pads()
    z2 = z.clone()
    z2[:, 0, :, 6:] = 100.0  # garbage in the pad positions of sentence 0
    a, b = ex(z, pad, None, None), ex(z2, pad, None, None)
    torch.testing.assert_close(a[:, 0, :, :6], b[:, 0, :, :6])
    # sentence 0 alone, without any padding, gives the same real outputs
    alone = ex(z[:, :1, :, :6], torch.zeros(1, 6, dtype=torch.bool), None, None)
    torch.testing.assert_close(alone[:, 0], a[:, 0, :, :6], atol=1e-6, rtol=0)


def test_routing_stats_per_source_language():
    m = build_model(cfg(arch="moce", conv=ConvConfig(kernels=[0, 1, 3, 5]), moce=MoCEConfig(top_k=2)), V).eval()
    tokens, _ = tokens_and_x()  # tags 260, 261, 262 -> languages 0, 1, 2
    tgt = torch.full((3, 2), 265)
    m(tokens, tgt)
    m(tokens[:1], tgt[:1])
    stats = m.routing_stats()
    (name, s), = stats.items()
    assert name == "encoder_layers.0.self_attn.variant"
    n_real = tokens.ne(PAD).sum(1).tolist()  # 7, 9, 10
    expected_tokens = [3 * H * (2 * n_real[0]), 3 * H * n_real[1], 3 * H * n_real[2]]
    assert s["tokens"][:3] == expected_tokens and all(t == 0 for t in s["tokens"][3:])
    for lang in range(3):
        assert sum(s["selection"][lang]) == pytest.approx(2.0)  # top-2: two experts per slot
        assert 0.0 <= s["mean_radius"][lang] <= 2.0  # kernel 5 has radius 2
    assert len(s["selection"]) == V - LANG_OFFSET
    assert m.routing_stats()[name]["tokens"] == []  # reset after reading
    # mean radius is the routing-weighted (k-1)/2, averaged over routed slots
    ex = experts(kernels=(0, 1, 3, 5), top_k=2)
    z, pad = z_and_pads()
    w = ex.route(z.masked_fill(pad[None, :, None, :, None], 0.0), None)
    ex(z, pad, None, torch.tensor([4, 4]))
    s = ex.routing_stats()
    keep = (~pad)[None, :, None, :]
    radius = (w * torch.tensor([0.0, 0.0, 1.0, 2.0])).sum(-1)
    assert s["mean_radius"][4] == pytest.approx((radius * keep).sum().item() / (keep.sum().item() * 3 * H), rel=1e-5)
    sel = (w > 0).float().mul(keep[..., None]).sum(dim=(0, 1, 2, 3)) / (keep.sum() * 3 * H)
    assert s["selection"][4] == pytest.approx(sel.tolist(), rel=1e-5)


def test_moce_router_and_convs_get_gradients_and_no_aux_loss():
    m = build_model(cfg(arch="moce", conv=ConvConfig(kernels=[0, 1, 3])), V).train()
    tokens, _ = tokens_and_x()
    tgt = torch.randint(4, 260, (3, 5))
    m(tokens, tgt).sum().backward()
    ex = m.encoder_layers[0].self_attn.variant
    assert ex.router.weight.grad.abs().sum() > 0
    assert all(w.grad.abs().sum() > 0 for w in ex.weights)
    assert m.last_aux_loss is None


@pytest.mark.parametrize("dispatch", ["dense", "routed"])
@pytest.mark.parametrize("kernels,top_k", [((0, 1, 3, 5, 7), 2), ((3, 0, 1, 0, 5), 3), ((1, 3), 1), ((0, 0), 2)])
def test_gathered_topk_mixture_equals_dense_mixture_with_gradients(kernels, top_k, dispatch):
    """Both fast paths (one conv + gather of the k picked outputs; or only the routed slots
    computed) give sum_e route(z)_e * expert_e(z) at real rows, in any expert order, forward and backward."""
    ex = experts(kernels=kernels, top_k=top_k)
    ex.dispatch = dispatch
    with torch.no_grad():
        torch.nn.init.normal_(ex.router.weight, std=2.0)
    z, pad = z_and_pads()
    z1 = z.clone().requires_grad_()
    out = ex(z1, pad, None, None)
    z2 = z.clone().requires_grad_()
    zz = z2.masked_fill(pad[None, :, None, :, None], 0.0)
    w = ex.route(zz, None)  # dense [3, B, H, T, E]
    assert ((w > 0).sum(-1) == min(top_k, len(kernels))).all()
    if ex.conv_kernels:
        conv = ex.conv_outputs(zz.reshape(-1, 9, DH)).view(3, 2, H, 9, len(ex.conv_kernels), DH)
    parts, j = [], 0
    for k in kernels:
        if k == 0:
            parts.append(zz)
        else:
            parts.append(conv[..., j, :])
            j += 1
    expected = torch.einsum("...e,...ed->...d", w, torch.stack(parts, -2)).masked_fill(pad[None, :, None, :, None], 0.0)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [z1, *ex.parameters()], g)
    grads_ref = torch.autograd.grad(expected, [z2, *ex.parameters()], g)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ---- routed (CPU) vs dense expert evaluation --------------------------------------------------
def _grads_both_paths(ex, z, pad, lid, lang, dtype):
    ex = ex.to(dtype)
    res = {}
    g = torch.randn(z.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    for dispatch in ("dense", "routed"):
        ex.dispatch = dispatch
        zi = z.to(dtype).clone().requires_grad_()
        li = None if lid is None else lid.to(dtype).clone().requires_grad_()
        out = ex(zi, pad, li, lang)
        inputs = [zi, *ex.parameters()] + ([li] if li is not None else [])
        res[dispatch] = [out, *torch.autograd.grad(out, inputs, g)]
    return res


@pytest.mark.parametrize("kernels,top_k,lid", [((0, 1, 3, 5, 7, 9), 2, False), ((0, 1, 3, 5, 7, 9), 2, True),
                                               ((5, 0, 1, 0, 3), 3, False), ((0,), 2, False), ((9, 1), 1, False)])
def test_routed_path_equals_dense_path_in_float64(kernels, top_k, lid):
    """Outputs and every gradient (input, conv weights and biases, router, lid) of the CPU routed
    path equal the dense one-conv path: longer sequences than the widest kernel, left and right
    padding, a fully padded row, and routing that uses every expert."""
    ex = experts(kernels=kernels, top_k=top_k, lid=lid)
    with torch.no_grad():
        torch.nn.init.normal_(ex.router.weight, std=2.0)
    z, _ = z_and_pads(seed=3, B=3, T=23)
    pad = torch.zeros(3, 23, dtype=torch.bool)
    pad[0, 15:] = True
    pad[1, :4] = True  # left padding (the reference pads the source on the left)
    lid_t = torch.randn(3, H, DH) if lid else None
    res = _grads_both_paths(ex, z, pad, lid_t, torch.tensor([0, 1, 1]), torch.float64)
    dense, routed = res["dense"], res["routed"]
    def at(t, mask):  # [3, B, H, T, ...] -> rows of the (b, t) positions in mask
        return t.transpose(2, 3)[:, mask]

    assert (at(routed[0], ~pad) != 0).any() and (at(routed[0], pad) == 0).all()
    for a, b in zip(dense, routed):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10)
    # the gradient reaching z at pad positions is 0 on both paths (pads are zeroed before the experts)
    assert (at(routed[1], pad) == 0).all()
    if len(ex.conv_kernels) > 0:
        used = (ex.route_topk(z.double().masked_fill(pad[None, :, None, :, None], 0.0),
                                 None if lid_t is None else lid_t.double()[None, :, :, None, :])[1])
        used = set(at(used, ~pad).unique().tolist())
        assert len(used) == len(kernels)  # every expert took part, so every weight gradient was compared


def test_routed_path_equals_dense_path_in_bfloat16():
    ex = experts(kernels=(0, 1, 3, 5, 7, 9), top_k=2)
    z, pad = z_and_pads(seed=4, B=2, T=17)
    res = _grads_both_paths(ex, z, pad, None, None, torch.bfloat16)
    for a, b in zip(res["dense"], res["routed"]):
        assert b.dtype == torch.bfloat16
        torch.testing.assert_close(b.float(), a.float(), atol=0.05, rtol=0.05)


def test_cpu_default_is_the_routed_path_and_kernels_torch_keeps_the_dense_one(monkeypatch):
    from scaletrain.models import moce_routed

    calls = []
    real_apply = moce_routed.RoutedExperts.apply
    monkeypatch.setattr(moce_routed.RoutedExperts, "apply", lambda *a: calls.append(1) or real_apply(*a))
    ex = experts(kernels=(0, 1, 3), top_k=2)
    z, pad = z_and_pads()
    ex(z, pad, None, None)
    assert calls == [1]
    ex.kernel_mode = "torch"  # model.kernels: torch
    ex(z, pad, None, None)
    assert calls == [1]


def test_moce_model_training_step_is_the_same_on_both_paths():
    """A whole MoCE(+lid) model: loss and every parameter gradient agree between the paths."""
    torch.manual_seed(0)
    m = build_model(cfg(arch="moce", conv=ConvConfig(kernels=[0, 1, 3, 5, 7, 9]), moce=MoCEConfig(lid=True)), V).double().train()
    tokens, _ = tokens_and_x()
    tgt = torch.randint(4, 260, (3, 6), generator=torch.Generator().manual_seed(1))
    ex = m.encoder_layers[0].self_attn.variant
    res = {}
    for dispatch in ("dense", "routed"):
        ex.dispatch = dispatch
        torch.manual_seed(7)  # dropout 0 here, but keep any randomness aligned
        loss = m(tokens, tgt).log_softmax(-1)[..., 5].mean()
        res[dispatch] = [loss, *torch.autograd.grad(loss, list(m.parameters()), allow_unused=True)]
    names = ["loss", *(n for n, _ in m.named_parameters())]
    for name, a, b in zip(names, res["dense"], res["routed"]):
        assert a is not None and b is not None, f"{name}: no gradient"  # every parameter is reached on both paths
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10, msg=lambda msg, name=name: f"{name}: {msg}")


def test_moce_dispatch_option_reaches_the_expert_bank_and_is_validated():
    for d in ("auto", "dense", "routed"):
        m = build_model(cfg(arch="moce", moce=MoCEConfig(dispatch=d)), V)
        assert m.encoder_layers[0].self_attn.variant.dispatch == d
    with pytest.raises(ScaletrainError, match="model.moce.dispatch"):
        build_model(cfg(arch="moce", moce=MoCEConfig(dispatch="sparse")), V)


def test_experts_that_receive_no_slots_get_zero_gradients_on_both_paths():
    ex = experts(kernels=(0, 1, 3, 5), top_k=2).double()
    with torch.no_grad():  # the router only ever picks the identity (0) and kernel 5 (3)
        ex.router.weight.zero_()
        ex.router.weight[0, 0] = ex.router.weight[3, 0] = 5.0
    z, pad = z_and_pads()
    z = z.double()
    z[..., 0] = z[..., 0].abs() + 1.0
    res = _grads_both_paths(ex, z, pad, None, None, torch.float64)
    assert ex.route_topk(z, None)[1].unique().tolist() == [0, 3]
    for a, b in zip(res["dense"], res["routed"]):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10)
    grads = dict(zip([n for n, _ in ex.named_parameters()], res["routed"][2:]))
    assert grads["weights.0"].abs().max() == 0 and grads["weights.1"].abs().max() == 0  # k=1, k=3 unused
    assert grads["weights.2"].abs().max() > 0
