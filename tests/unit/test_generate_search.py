"""Greedy / beam search against a tiny recurrent toy model that implements the decoding API."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from scaletrain.eval import generate as G
from scaletrain.eval.beam import beam_search
from scaletrain.eval.bounds import max_output_lengths
from scaletrain.eval.decode_step import allowed_mask
from scaletrain.eval.requests import translate_examples
from scaletrain.data.batch import Example, collate
from scaletrain.data.batching import decode_batches
from scaletrain.errors import ScaletrainError
from scaletrain.vocab import BOS, BYTE_OFFSET, EOS, LANG_OFFSET, PAD, UNK, ByteVocab

LANGS = ["en", "de", "th"]
V = LANG_OFFSET + len(LANGS)


@dataclass
class ToyEncoderOut:
    out: torch.Tensor  # [B, S, D]
    pad_mask: torch.Tensor  # [B, S] True = pad

    def index_select(self, index: torch.Tensor) -> "ToyEncoderOut":
        return ToyEncoderOut(self.out.index_select(0, index), self.pad_mask.index_select(0, index))


class ToyModel(nn.Module):
    """h_t = tanh(W h_{t-1} + E[tok_t] + P[t] + S * mean(enc)); logits = scale * (U h_t) + bias.

    Padding-invariant by construction (masked mean), float64 so batch composition cannot flip ties.
    ``allowed``: if given, every other logit is -inf (a tiny effective vocabulary for exhaustive search).
    """

    def __init__(self, seed=0, d=8, scale=3.0, allowed=None, bias=None, max_positions=512, dropout=0.0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
        self.emb = nn.Parameter(r(V, d) * 0.8)
        self.pos = nn.Parameter(r(max_positions, d) * 0.3)
        self.enc_w = nn.Parameter(r(d, d) / math.sqrt(d))
        self.w = nn.Parameter(r(d, d) / math.sqrt(d))
        self.s = nn.Parameter(r(d, d) / math.sqrt(d))
        self.u = nn.Parameter(r(V, d))
        self.scale = scale
        b = torch.zeros(V, dtype=torch.float64) if bias is None else bias.to(torch.float64)
        self.register_buffer("bias", b)
        self.allowed = None if allowed is None else torch.tensor(sorted(allowed))
        self.max_positions = max_positions
        self.drop = nn.Dropout(dropout)
        self.modes_seen: set[bool] = set()

    def encode(self, src):
        # lazily created state updated in place (like routing statistics in MoCE)
        if getattr(self, "n_encoded", None) is None:
            self.n_encoded = torch.zeros((), dtype=torch.int64)
        self.n_encoded.add_(src.shape[0])
        pad = src == PAD
        out = torch.tanh(self.emb[src] @ self.enc_w)
        return ToyEncoderOut(out, pad)

    def _summary(self, enc):
        keep = (~enc.pad_mask).unsqueeze(-1).to(enc.out.dtype)
        return (enc.out * keep).sum(1) / keep.sum(1)

    def _logits(self, h):
        logits = self.scale * (h @ self.u.T) + self.bias
        if self.allowed is not None:
            m = torch.full((V,), -math.inf, dtype=logits.dtype)
            m[self.allowed] = 0.0
            logits = logits + m
        return logits

    def decode_step(self, tokens, step, enc, cache):
        self.modes_seen.add(self.training)
        assert tokens.shape == (enc.out.shape[0],)
        prev = torch.zeros_like(enc.out[:, 0]) if cache is None else cache
        assert step == 0 or cache is not None
        h = torch.tanh(prev @ self.w + self.emb[tokens] + self.pos[step] + self._summary(enc) @ self.s)
        h = self.drop(h)
        return self._logits(h), h

    def reorder_cache(self, cache, index):
        return cache.index_select(0, index)

    def forward(self, src, tgt_in):
        enc = self.encode(src)
        h, outs = None, []
        for t in range(tgt_in.shape[1]):
            lg, h = self.decode_step(tgt_in[:, t], t, enc, h)
            outs.append(lg)
        return torch.stack(outs, 1)


def make_src(lang_idx: int, data: bytes, pad_to: int | None = None) -> torch.Tensor:
    ids = [LANG_OFFSET + lang_idx] + [b + BYTE_OFFSET for b in data] + [EOS]
    if pad_to:
        ids += [PAD] * (pad_to - len(ids))
    return torch.tensor([ids])


def seq_logprob(model, src_row, tag, out_tokens) -> float:
    """log p(out_tokens + [EOS] | src) by a full forward pass with the generation mask."""
    tgt_in = torch.tensor([[tag] + list(out_tokens)])
    with torch.no_grad():
        lp = torch.log_softmax(model(src_row, tgt_in).double(), -1)[0]
    mask = allowed_mask(V, "cpu", torch.float64)
    lp = lp + mask
    targets = list(out_tokens) + [EOS]
    return float(sum(lp[t, tok] for t, tok in enumerate(targets)))


A, B_ = BYTE_OFFSET + ord("a"), BYTE_OFFSET + ord("b")
TAG_DE = LANG_OFFSET + 1


def exhaustive_best(model, src_row, tag, max_len, lenpen, min_len=0):
    """Score every output over {a, b} of min_len..max_len bytes (+EOS) with one batched full forward."""
    seqs = [list(seq) for n in range(min_len, max_len + 1) for seq in itertools.product([A, B_], repeat=n)]
    tgt_in = torch.tensor([[tag] + q + [A] * (max_len - len(q)) for q in seqs])  # filler after the end is causal-safe
    with torch.no_grad():
        lp = torch.log_softmax(model(src_row.expand(len(seqs), -1), tgt_in).double(), -1)
    lp = lp + allowed_mask(V, "cpu", torch.float64)
    best = None
    for r, q in enumerate(seqs):
        total = float(sum(lp[r, t, tok] for t, tok in enumerate(q + [EOS])))
        sc = total / float(len(q) + 1) ** lenpen
        if best is None or sc > best[0]:
            best = (sc, q)
    # cross-check the batched scoring against the single-sequence scorer for the winner
    assert best[0] * float(len(best[1]) + 1) ** lenpen == pytest.approx(seq_logprob(model, src_row, tag, best[1]))
    return best


@pytest.mark.parametrize("lenpen", [0.0, 1.0, 1.5, 4.0])
def test_beam_with_beam_at_least_vocab_finds_exhaustive_optimum(lenpen):
    # effective vocabulary {a, b, EOS}; outputs of up to 3 bytes -> 15 sequences, beam 16 keeps them all
    srcs = [b"xy", b"hello there", b"q", b"zzzz"]
    found_nonempty = 0
    for seed in range(3):
        model = ToyModel(seed=seed, allowed={A, B_, EOS})
        S = max(len(s) for s in srcs) + 2
        src = torch.cat([make_src(0, s, S) for s in srcs])
        hyps = G.generate_with_scores(model, src, TAG_DE, beam=16, lenpen=lenpen, max_len_a=0, max_len_b=3)
        for i, s in enumerate(srcs):
            score, seq = exhaustive_best(model, make_src(0, s), TAG_DE, 3, lenpen)
            assert hyps[i].tokens == seq, (seed, s, hyps[i], seq)
            assert hyps[i].score == pytest.approx(score, abs=1e-5)
            found_nonempty += bool(seq)
    assert found_nonempty > 0  # the optimum is not trivially the empty output


def test_beam_respects_min_len_against_exhaustive():
    model = ToyModel(seed=5, allowed={A, B_, EOS}, bias=torch.zeros(V).index_fill(0, torch.tensor([EOS]), 10.0))
    src = make_src(0, b"abc")
    free = G.generate(model, src, TAG_DE, beam=16, max_len_a=0, max_len_b=3)
    assert free == [[]]  # EOS is strongly favoured ...
    hyps = G.generate_with_scores(model, src, TAG_DE, beam=16, lenpen=1.0, max_len_a=0, max_len_b=3, min_len=2)
    score, seq = exhaustive_best(model, src, TAG_DE, 3, 1.0, min_len=2)
    assert len(hyps[0].tokens) >= 2  # ... but min_len forbids it before 2 bytes
    assert hyps[0].tokens == seq and hyps[0].score == pytest.approx(score, abs=1e-5)
    greedy = G.generate(model, src, TAG_DE, beam=1, max_len_a=0, max_len_b=3, min_len=2)
    assert greedy[0] == manual_greedy(model, src, TAG_DE, 3, min_len=2) and len(greedy[0]) >= 2


def manual_greedy(model, src_row, tag, max_len, min_len=0):
    out = []
    mask = allowed_mask(V, "cpu", torch.float64)
    while True:
        with torch.no_grad():
            lp = torch.log_softmax(model(src_row, torch.tensor([[tag] + out])).double()[0, -1], -1) + mask
        if len(out) >= max_len:
            return out
        if len(out) < min_len:
            lp[EOS] = -math.inf
        tok = int(lp.argmax())
        if tok == EOS:
            return out
        out.append(tok)


def _random_batch(seed, n=6, langs=(0, 1, 2)):
    g = torch.Generator().manual_seed(seed)
    srcs = []
    for i in range(n):
        L = int(torch.randint(0, 12, (1,), generator=g))
        srcs.append(bytes(torch.randint(97, 123, (L,), generator=g).tolist()))
    S = max(len(s) for s in srcs) + 2
    src = torch.cat([make_src(langs[i % len(langs)], s, S) for i, s in enumerate(srcs)])
    tags = torch.tensor([LANG_OFFSET + (i + 1) % len(LANGS) for i in range(n)])
    return srcs, src, tags


def test_greedy_matches_full_forward_argmax_and_beam1_path():
    model = ToyModel(seed=1, bias=torch.zeros(V).index_fill(0, torch.tensor([EOS]), 8.0))
    srcs, src, tags = _random_batch(0)
    greedy = G.generate(model, src, tags, beam=1, max_len_a=0.5, max_len_b=6)
    max_lens = max_output_lengths(src, 0.5, 6).tolist()
    for i in range(len(srcs)):
        single = make_src(int(src[i, 0]) - LANG_OFFSET, srcs[i])
        assert greedy[i] == manual_greedy(model, single, int(tags[i]), max_lens[i])
    # the general beam-search code with one beam gives the same tokens and scores as the greedy fast path
    for lenpen in (0.5, 1.0, 2.0):
        with torch.no_grad():
            ml = max_output_lengths(src, 0.5, 6)
            a = G._greedy(model, src, tags, ml, 0, lenpen)
            b = beam_search(model, src, tags, ml, 0, 1, lenpen)
        assert [h.tokens for h in a] == [h.tokens for h in b] == greedy
        for ha, hb in zip(a, b):
            assert ha.score == pytest.approx(hb.score, abs=1e-4)
    assert any(len(h) > 0 for h in greedy) and any(len(h) < m for h, m in zip(greedy, max_lens))


@pytest.mark.parametrize("beam", [1, 3])
def test_batch_equals_single_sentence(beam):
    model = ToyModel(seed=2, bias=torch.zeros(V).index_fill(0, torch.tensor([EOS]), 8.0))
    srcs, src, tags = _random_batch(1, n=7)
    batch = G.generate(model, src, tags, beam=beam, lenpen=1.2, max_len_a=1.0, max_len_b=5)
    lens = []
    for i, s in enumerate(srcs):
        single = make_src(int(src[i, 0]) - LANG_OFFSET, s)
        one = G.generate(model, single, int(tags[i]), beam=beam, lenpen=1.2, max_len_a=1.0, max_len_b=5)
        assert batch[i] == one[0]
        lens.append(len(one[0]))
        padded = make_src(int(src[i, 0]) - LANG_OFFSET, s, pad_to=len(s) + 9)  # extra padding
        assert G.generate(model, padded, int(tags[i]), beam=beam, lenpen=1.2, max_len_a=1.0, max_len_b=5) == one
    assert len(set(lens)) >= 3  # rows finish at different steps (exercises dropping finished rows)
    # every returned score is the full-forward log-prob of the returned tokens, normalised (cache is right)
    hyps = G.generate_with_scores(model, src, tags, beam=beam, lenpen=1.2, max_len_a=1.0, max_len_b=5)
    for i, (h, s) in enumerate(zip(hyps, srcs)):
        single = make_src(int(src[i, 0]) - LANG_OFFSET, s)
        ref = seq_logprob(model, single, int(tags[i]), h.tokens) / (len(h.tokens) + 1) ** 1.2
        assert h.score == pytest.approx(ref, abs=1e-4)


@pytest.mark.parametrize("beam", [1, 4])
def test_max_len_respected_and_reached(beam):
    # EOS is essentially impossible -> every output runs to exactly its limit floor(a*src_bytes + b)
    model = ToyModel(seed=3, bias=torch.zeros(V).index_fill(0, torch.tensor([EOS]), -30.0))
    srcs, src, tags = _random_batch(2, n=5)
    out = G.generate(model, src, tags, beam=beam, max_len_a=0.5, max_len_b=3)
    assert [len(o) for o in out] == [math.floor(0.5 * len(s) + 3) for s in srcs]
    # max_positions caps the decoder input (tag + bytes): at most max_positions - 1 bytes
    out = G.generate(model, src, tags, beam=beam, max_len_a=10, max_len_b=100, max_positions=5)
    assert [len(o) for o in out] == [4] * len(srcs)
    # the model's own max_positions is picked up when none is given
    model.max_positions = 7
    out = G.generate(model, src, tags, beam=beam, max_len_a=10, max_len_b=100)
    assert [len(o) for o in out] == [6] * len(srcs)


def test_default_length_limit_leaves_room_for_long_scripts():
    src = make_src(0, b"x" * 100)
    lim = int(max_output_lengths(src)[0])
    assert lim >= 3 * 100 + 200  # a 3x UTF-8 expansion of a 100-byte English sentence still fits


@pytest.mark.parametrize("beam", [1, 5])
def test_tags_and_specials_never_emitted(beam):
    bias = torch.zeros(V)
    bias[[PAD, BOS, UNK]] = 40.0
    bias[LANG_OFFSET:] = 40.0  # the model would love to emit these
    model = ToyModel(seed=4, bias=bias)
    srcs, src, tags = _random_batch(3, n=4)
    with torch.no_grad():
        raw = model(src, tags.unsqueeze(1))[:, 0].argmax(-1)
    assert not bool(((raw >= BYTE_OFFSET) & (raw < LANG_OFFSET)).any())  # unmasked argmax is a special
    out = G.generate(model, src, tags, beam=beam, max_len_a=0, max_len_b=8)
    for o in out:
        assert all(BYTE_OFFSET <= t < LANG_OFFSET for t in o)
        assert tags.tolist()[0] not in o


def test_eval_mode_no_grad_and_training_flag_restored():
    model = ToyModel(seed=6, dropout=0.5)
    model.train()
    srcs, src, tags = _random_batch(4, n=3)
    a = G.generate(model, src, tags, beam=2, max_len_a=0, max_len_b=6)
    b = G.generate(model, src, tags, beam=2, max_len_a=0, max_len_b=6)
    assert a == b  # dropout off
    assert model.modes_seen == {False}
    assert model.training  # restored
    # state created during decoding is a normal tensor: training can keep updating it in place
    model.n_encoded.add_(1)
    model(src, tags.unsqueeze(1)).sum().backward()
    assert model.emb.grad is not None


def test_early_finish_stops_decoding():
    # EOS is overwhelmingly likely: every beam finishes at step 0, no further decoder step is run
    calls = []
    model = ToyModel(seed=7, bias=torch.zeros(V).index_fill(0, torch.tensor([EOS]), 60.0))
    orig = model.decode_step
    model.decode_step = lambda *a, **k: (calls.append(a[1]), orig(*a, **k))[1]
    srcs, src, tags = _random_batch(5, n=3)
    out = G.generate(model, src, tags, beam=4, max_len_a=0, max_len_b=50)
    assert out == [[], [], []]
    # step 0 finalises the first beam's EOS; the other beams' EOS candidates finish at step 1
    assert max(calls) <= 1


def test_bad_inputs_raise():
    model = ToyModel()
    src = make_src(0, b"ab")
    with pytest.raises(ScaletrainError, match="tag"):
        G.generate(model, src, BYTE_OFFSET + 5)
    with pytest.raises(ScaletrainError, match="beam"):
        G.generate(model, src, TAG_DE, beam=0)
    with pytest.raises(ScaletrainError, match="target tags"):
        G.generate(model, src, [TAG_DE, TAG_DE])
    with pytest.raises(ScaletrainError, match="src"):
        G.generate(model, torch.zeros(3), TAG_DE)


def test_length_batches_respect_budget_and_cover_everything():
    lengths = [5, 40, 3, 17, 17, 2, 60, 9, 1, 33]
    batches = decode_batches(lengths, batch_tokens=100, beam=2, max_sentences=3)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or len(b) * 2 * max(lengths[i] for i in b) <= 100
    assert len(batches[0]) == 1  # 60 * 2 > 100 / 2 -> alone


def test_translate_examples_restores_order_and_counts_invalid():
    vocab = ByteVocab(LANGS)
    model = ToyModel(seed=8, bias=torch.zeros(V).index_fill(0, torch.tensor([EOS]), 8.0))
    g = torch.Generator().manual_seed(0)
    exs = []
    for i in range(9):
        L = int(torch.randint(0, 15, (1,), generator=g))
        exs.append(Example(i % 3, (i + 1) % 3, bytes(torch.randint(97, 123, (L,), generator=g).tolist()), b"ref"))
    done = []
    res = translate_examples(model, exs, vocab, batch_tokens=60, beam=2, max_len_a=0.5, max_len_b=4,
                               progress=done.append, stop_invalid_utf8=False)
    assert sum(done) == len(exs) and len(done) > 1  # several batches
    for ex, toks, text, inv in zip(exs, res.tokens, res.texts, res.invalid):
        b = collate([ex])
        assert G.generate(model, b.src, b.tgt_in[:, 0], beam=2, max_len_a=0.5, max_len_b=4)[0] == toks
        d = vocab.decode_counting(toks)
        assert (text, inv) == (d.text, d.invalid)

    # a model that can only say byte 0xFF (never valid UTF-8): every byte is one invalid sequence
    ff = ToyModel(seed=9, allowed={BYTE_OFFSET + 0xFF, EOS},
                  bias=torch.zeros(V).index_fill(0, torch.tensor([EOS]), -30.0))
    res = translate_examples(ff, exs[:3], vocab, batch_tokens=1000, beam=1, max_len_a=0, max_len_b=2,
                               stop_invalid_utf8=False)
    assert res.texts == ["\ufffd\ufffd"] * 3
    assert res.invalid == [2, 2, 2] and res.n_invalid == 6 and res.n_invalid_lines == 3


def test_translate_examples_truncates_long_sources_instead_of_dropping():
    vocab = ByteVocab(LANGS)
    model = ToyModel(seed=10, max_positions=16, bias=torch.zeros(V).index_fill(0, torch.tensor([EOS]), 1.0))
    exs = [Example(0, 1, b"a" * 40, b""), Example(0, 2, b"bc", b"")]
    res = translate_examples(model, exs, vocab, batch_tokens=500, beam=3, max_len_a=0, max_len_b=50)
    assert len(res.texts) == 2
    assert all(len(t) <= 15 for t in res.tokens)  # capped by max_positions - 1
    # the long source was cut to max_positions - 2 bytes (tag + EOS fit)
    cut = collate([Example(0, 1, b"a" * 14, b"")])
    assert G.generate(model, cut.src, cut.tgt_in[:, 0], beam=3, max_len_a=0, max_len_b=50,
                      stop_invalid_utf8=True)[0] == res.tokens[0]
