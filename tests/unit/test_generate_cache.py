"""Incremental decoding of every registered architecture against the full forward pass, and beam search
on the real Transformer when sentences finish at different steps (the cache is shrunk and reordered)."""
from __future__ import annotations

import pytest
import torch

from helpers import full_forward_logprob
from scaletrain.eval import generate as G
from scaletrain.data.batch import Example, collate
from scaletrain.models import ModelConfig, available_models, build_model
from scaletrain.models.config import ConvConfig, LobefConfig
from scaletrain.errors import ScaletrainError
from scaletrain.vocab import EOS, ByteVocab

VOCAB = ByteVocab(["en", "de", "th"])
EXAMPLES = [
    Example(0, 1, b"hello world", b"hallo welt"),
    Example(1, 0, b"guten tag, wie geht es dir?", b"good day"),
    Example(0, 2, b"a", "ก".encode()),
    Example(2, 0, "สวัสดี".encode(), b"hi"),
    Example(1, 2, b"ja", b""),
]


def tiny(arch: str, seed=0) -> torch.nn.Module:
    torch.manual_seed(seed)
    conv = ConvConfig(kernels=[0, 1, 3, 5]) if arch in ("msc", "msha") else ConvConfig()  # one kernel per head
    cfg = ModelConfig(arch=arch, d_model=32, n_heads=4, encoder_layers=2, decoder_layers=2, ffn_dim=64,
                      max_positions=64, dropout=0.0, lobef=LobefConfig(byte_layers=1), conv=conv)
    return build_model(cfg, VOCAB.size).eval()


@pytest.mark.parametrize("arch", available_models())
def test_incremental_logits_equal_full_forward(arch):
    model = tiny(arch)
    batch = collate(EXAMPLES)
    T = batch.tgt_in.shape[1]
    with torch.no_grad():
        full = model(batch.src, batch.tgt_in)  # [B, T, V]
        enc = model.encode(batch.src)
        cache = None
        for t in range(T):
            logits, cache = model.decode_step(batch.tgt_in[:, t], t, enc, cache)
            real = batch.tgt_in[:, t] != 0  # positions past a row's end are padding: not compared
            torch.testing.assert_close(logits[real], full[real, t], atol=1e-4, rtol=1e-4)
    assert T >= 10


class EosBias(torch.nn.Module):
    """The real Transformer with a fixed bonus on the EOS logit, so sentences end at different lengths."""

    def __init__(self, inner, bonus):
        super().__init__()
        self.inner, self.bonus, self.max_positions = inner, bonus, inner.cfg.max_positions

    def _b(self, logits):
        return logits + torch.nn.functional.one_hot(torch.tensor(EOS), logits.shape[-1]) * self.bonus

    def encode(self, src):
        return self.inner.encode(src)

    def decode_step(self, tokens, step, enc, cache):
        logits, cache = self.inner.decode_step(tokens, step, enc, cache)
        return self._b(logits), cache

    def reorder_cache(self, cache, index):
        return self.inner.reorder_cache(cache, index)

    def forward(self, src, tgt_in):
        return self._b(self.inner(src, tgt_in))


@pytest.mark.parametrize("beam", [2, 4])
def test_real_beam_with_rows_finishing_at_different_steps(beam):
    model = EosBias(tiny("transformer", seed=4), bonus=3.0)
    batch = collate(EXAMPLES)
    tags = batch.tgt_in[:, 0]
    hyps = G.generate_with_scores(model, batch.src, tags, beam=beam, lenpen=1.3, max_len_a=0, max_len_b=12)
    lens = [len(h.tokens) for h in hyps]
    assert len(set(lens)) >= 3, lens  # sentences leave the batch at different steps
    for i, ex in enumerate(EXAMPLES):
        one = collate([ex])
        single = G.generate_with_scores(model, one.src, one.tgt_in[:, 0], beam=beam, lenpen=1.3, max_len_a=0,
                                        max_len_b=12)[0]
        assert single.tokens == hyps[i].tokens and single.score == pytest.approx(hyps[i].score, abs=1e-5)
        ref = full_forward_logprob(model, one.src, int(one.tgt_in[0, 0]), hyps[i].tokens) / (lens[i] + 1) ** 1.3
        assert hyps[i].score == pytest.approx(ref, abs=1e-4)


def test_kv_cache_grows_in_place_and_reorder_keeps_the_room():
    """The self-attention cache is written into a buffer with spare room (no copy of the whole cache per
    step); beam reordering keeps that room; the values are those of concatenation."""
    from scaletrain.models.transformer import kv_append, kv_index_select

    torch.manual_seed(0)
    steps = [torch.randn(3, 2, 1, 4) for _ in range(40)]
    k, ptrs = None, []
    for i, new in enumerate(steps):
        k = kv_append(k, new)
        ptrs.append(k.data_ptr())
        torch.testing.assert_close(k, torch.cat(steps[:i + 1], dim=2), rtol=0, atol=0)
    assert len(set(ptrs)) == 2  # one buffer of 32 positions, then one of 66: two allocations in 40 steps
    idx = torch.tensor([2, 2, 0])
    r = kv_index_select(k, idx)
    torch.testing.assert_close(r, torch.cat(steps, dim=2).index_select(0, idx), rtol=0, atol=0)
    before = r.data_ptr()
    r2 = kv_append(r, steps[0])  # room kept: no reallocation
    assert r2.data_ptr() == before and r2.shape == (3, 2, 41, 4)
    plain = torch.randn(3, 2, 5, 4)  # a tensor that is not our buffer is never written past its end
    grown = kv_append(plain, steps[0])
    assert grown.data_ptr() != plain.data_ptr() and torch.equal(grown[:, :, :5], plain)


@pytest.mark.parametrize("arch", available_models())
def test_shared_encoder_rows_for_beams_equal_copied_rows(arch):
    from scaletrain.models.transformer import _kv_capacity

    """``EncoderOut.expand_beams`` (one encoder row and one cross-attention K/V per sentence, read by all
    its beams; self-attention K/V per sentence in per-beam slots) decodes like copying the row for every
    beam, through reorders that keep the sentence blocks (beam moves, a dropped sentence) and one that does
    not (every row gets its own encoder row and K/V again)."""
    model = tiny(arch)
    batch = collate(EXAMPLES[:3])
    K = 2
    enc = model.encode(batch.src)
    shared, copied = enc.expand_beams(K, 40), enc.index_select(torch.arange(3).repeat_interleave(K))
    tok = batch.tgt_in[:, 0].repeat_interleave(K)
    c_sh = c_cp = None
    reorders = {2: [1, 1, 2, 3, 5, 4], 3: [2, 3, 4, 5], 4: [3, 0, 2, 1]}  # beams; drop sentence 0; mixed
    with torch.no_grad():
        for t in range(6):
            a, c_sh = model.decode_step(tok, t, shared, c_sh)
            b, c_cp = model.decode_step(tok, t, copied, c_cp)
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            if t == 0:  # the K/V buffers have room for max_steps = 40 positions from the start
                assert _kv_capacity(c_sh.layers[0]["k"]) == 40 and c_sh.layers[0]["k"].shape[2] == 1
            if t in reorders:
                idx = torch.tensor(reorders[t])
                k_before = c_sh.layers[0]["k"]
                shared, c_sh = shared.index_select(idx), model.reorder_cache(c_sh, idx)
                if t == 2:  # beams moved within their sentences: no K/V copied, only the slot table
                    assert c_sh.layers[0]["k"] is k_before and c_sh.slots.shape == (6, 3)
                copied, c_cp = copied.index_select(idx), model.reorder_cache(c_cp, idx)
                tok = tok[idx]
            tok = (tok + 1) % 200 + 3
    assert shared.beams == 1 and c_sh.beams == 1 and shared.out.shape[0] == 4  # the mixed reorder undid sharing
    with pytest.raises(ScaletrainError, match="decoder rows"):
        model.decode_step(tok[:3], 0, enc.expand_beams(K), None)
