"""LOBEF Byte-nCF and Byte-WSF front-ends (docs/MODELS.md §4, §5 and the §14 invariants)."""
from __future__ import annotations

import pytest
import torch

from scaletrain.errors import ScaletrainError
from scaletrain.models import ModelConfig, build_model, count_parameters
from scaletrain.models.config import LobefConfig
from scaletrain.models.lobef import NGramFusion, word_block_mask, word_groups
from scaletrain.vocab import BYTE_OFFSET, EOS, PAD

D = 16
V = 270
SPACE = torch.tensor([32 + BYTE_OFFSET])


def cfg(**kw):
    base = dict(d_model=D, n_heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=32, dropout=0.0, max_positions=64)
    base.update(kw)
    return ModelConfig(**base)


def ids(text: str) -> list[int]:
    return [b + BYTE_OFFSET for b in text.encode()]


# ---- Byte-nCF ------------------------------------------------------------------------------------
def fusion(seed=0):
    torch.manual_seed(seed)
    return NGramFusion(D, [1, 2, 3, 4]).eval()


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 7, 9, 12])
def test_ncf_output_length_equals_input_length(T):
    f = fusion()
    h = torch.randn(2, T, D)
    pad = torch.zeros(2, T, dtype=torch.bool)
    assert f(h, pad).shape == (2, T, D)
    assert f.streams(h, pad).shape == (2, T, D, 4)


def test_ncf_streams_are_constant_on_blocks_and_depend_only_on_their_block():
    f = fusion()
    T = 11
    h = torch.randn(1, T, D)
    pad = torch.zeros(1, T, dtype=torch.bool)
    U = f.streams(h, pad)
    torch.testing.assert_close(U[..., 0], h)  # n = 1 is the identity
    for j, n in enumerate([2, 3, 4], start=1):
        for t in range(T):
            start = n * (t // n)
            torch.testing.assert_close(U[0, t, :, j], U[0, start, :, j])
            # perturb everything outside the block: U_n[t] does not change
            h2 = h.clone()
            outside = torch.ones(T, dtype=torch.bool)
            outside[start : start + n] = False
            h2[0, outside] += torch.randn(int(outside.sum()), D)
            torch.testing.assert_close(f.streams(h2, pad)[0, t, :, j], U[0, t, :, j])
            # and inside the block it does
            h3 = h.clone()
            h3[0, t] += 1.0
            assert (f.streams(h3, pad)[0, t, :, j] - U[0, t, :, j]).abs().max() > 1e-4
    # a window that runs past the end sees zeros (explicit hand computation for n = 4, last window)
    conv = f.convs["4"]
    window = torch.cat([h[0, 8:11], torch.zeros(1, D)]).T  # [D, 4]
    expected = (conv.weight * window[None]).sum(dim=(1, 2)) + conv.bias
    torch.testing.assert_close(U[0, 10, :, 3], expected, atol=1e-5, rtol=0)


def test_ncf_weights_1000_give_identity():
    f = fusion()
    with torch.no_grad():
        f.weights.weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    h = torch.randn(2, 7, D)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, 5:] = True
    out = f(h, pad)
    torch.testing.assert_close(out[~pad], h[~pad])
    assert out[pad].abs().sum() == 0


def test_ncf_right_padding_does_not_change_real_positions():
    f = fusion()
    h = torch.randn(1, 6, D)
    short = f(h, torch.zeros(1, 6, dtype=torch.bool))
    padded_h = torch.cat([h, torch.randn(1, 5, D) * 10], 1)  # garbage states at the pad positions
    pad = torch.zeros(1, 11, dtype=torch.bool)
    pad[0, 6:] = True
    torch.testing.assert_close(f(padded_h, pad)[:, :6], short, atol=1e-6, rtol=0)


def test_ncf_parameter_delta():
    assert sum(p.numel() for p in NGramFusion(512, [1, 2, 3, 4]).parameters()) == 2_360_836
    assert sum(p.numel() for p in NGramFusion(D, [1, 2, 3, 4]).parameters()) == 9 * D * D + 3 * D + 4
    m = build_model(cfg(arch="byte_ncf", lobef=LobefConfig(byte_layers=2), encoder_layers=1), V)
    c = count_parameters(m)
    dense3 = build_model(cfg(encoder_layers=3), V)
    assert c["total"] - count_parameters(dense3)["total"] == 9 * D * D + 3 * D + 4
    assert c["variant"] == 9 * D * D + 3 * D + 4
    assert len(m.frontend.layers) == 2 and len(m.encoder_layers) == 1


def test_ncf_bad_ngrams_rejected():
    with pytest.raises(ScaletrainError, match="model.lobef.ngrams"):
        build_model(cfg(arch="byte_ncf", lobef=LobefConfig(ngrams=[1, 0])), V)


# ---- Byte-WSF ------------------------------------------------------------------------------------
def test_word_blocks_line_up_with_separators():
    # "ab cde" with tag, EOS and two pads: {tag a b} {space} {c d e EOS} {pad} {pad}
    row = [260] + ids("ab cde") + [EOS, PAD, PAD]
    g = word_groups(torch.tensor([row]), SPACE)[0].tolist()
    assert g[0] == g[1] == g[2]
    assert len({g[0], g[3], g[4], g[8], g[9]}) == 5
    assert g[4] == g[5] == g[6] == g[7]
    m = word_block_mask(torch.tensor([row]), SPACE)[0, 0]
    allowed = {(i, j) for i in range(10) for j in range(10) if m[i, j]}
    words = [[0, 1, 2], [3], [4, 5, 6, 7], [8], [9]]
    assert allowed == {(i, j) for w in words for i in w for j in w}


def test_word_mask_properties():
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(4 + 33, 260, (4, 20), generator=g)
    rows[:, ::5] = 32 + BYTE_OFFSET
    rows[1, 15:] = PAD
    rows[2, 1:4] = 32 + BYTE_OFFSET  # consecutive separators
    m = word_block_mask(rows, SPACE)
    assert m.shape == (4, 1, 20, 20)
    assert torch.equal(m, m.transpose(-1, -2))  # symmetric
    assert m[..., torch.arange(20), torch.arange(20)].all()  # diagonal allowed
    groups = word_groups(rows, SPACE)
    torch.testing.assert_close(m[:, 0], groups[:, :, None] == groups[:, None, :])
    # real queries never see pad keys
    assert not m[1, 0, :15, 15:].any()
    # a separator sees only itself
    assert m[0, 0, 5].sum() == 1


def test_sentence_without_separators_is_one_block():
    row = torch.tensor([[260] + ids("没有空格的句子") + [EOS, PAD]])
    m = word_block_mask(row, SPACE)[0, 0]
    n = row.ne(PAD).sum().item()
    assert m[:n, :n].all()
    assert not m[:n, n:].any()


def test_wsf_mask_is_applied_per_sentence_and_per_head():
    torch.manual_seed(0)
    m = build_model(cfg(arch="byte_wsf", lobef=LobefConfig(byte_layers=2), encoder_layers=1, n_heads=2), V).eval()
    a = [260] + ids("ab cde fg") + [EOS]
    b = [261] + ids("hello") + [EOS]
    src = torch.zeros(2, len(a), dtype=torch.long)
    src[0, : len(a)] = torch.tensor(a)
    src[1, : len(b)] = torch.tensor(b)

    def frontend_out(tokens):
        from scaletrain.models import EncoderContext

        ctx = EncoderContext(tokens, tokens.eq(PAD), m.embeddings)
        return m.frontend(m.embed_source(tokens), ctx)[0]

    out = frontend_out(src)
    # each sentence gets its own mask, independent of its batch neighbours
    torch.testing.assert_close(out[0], frontend_out(src[:1])[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(out[1, : len(b)], frontend_out(src[1:, : len(b)])[0], atol=1e-6, rtol=0)
    # changing the word "fg" does not change the byte-layer states of "cde" (positions 4..6)
    src2 = src.clone()
    src2[0, 8:10] = torch.tensor(ids("xy"))
    out2 = frontend_out(src2)
    torch.testing.assert_close(out2[0, 4:7], out[0, 4:7], atol=1e-6, rtol=0)
    assert (out2[0, 8:10] - out[0, 8:10]).abs().max() > 1e-4
    # ... while the full-attention layers after the front-end do mix words
    enc1, enc2 = m.encode(src).out, m.encode(src2).out
    assert (enc1[0, 4:7] - enc2[0, 4:7]).abs().max() > 1e-4


def test_wsf_adds_no_parameters_and_rejects_bad_separators():
    m = build_model(cfg(arch="byte_wsf", lobef=LobefConfig(byte_layers=2), encoder_layers=1), V)
    dense = build_model(cfg(encoder_layers=3), V)
    assert count_parameters(m)["total"] == count_parameters(dense)["total"]
    with pytest.raises(ScaletrainError, match="model.lobef.separators"):
        build_model(cfg(arch="byte_wsf", lobef=LobefConfig(separators=[300])), V)
