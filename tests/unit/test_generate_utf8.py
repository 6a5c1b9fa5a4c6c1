"""Decoding stops a hypothesis at the first byte that makes it invalid UTF-8 (``stop_invalid_utf8``):
the guard agrees with a reference built on Python's decoder, models that write valid UTF-8 decode
bit for bit as without it, and a model forced into an invalid sequence stops there and is counted."""
from __future__ import annotations

import codecs
import random

import pytest
import torch
from torch import nn

from scaletrain.data.batch import Example, collate
from scaletrain.eval import generate as G
from scaletrain.eval.requests import translate_examples
from scaletrain.eval.utf8_guard import HostUtf8Guard, Utf8Guard, complete_prefix
from scaletrain.models import ModelConfig, build_model
from scaletrain.vocab import BYTE_OFFSET, EOS, LANG_OFFSET, ByteVocab
from toy_decoders import LogitsOnly

VOCAB = ByteVocab(["en", "de", "ja"])
SEQ_LEN = {**{b: 2 for b in range(0xC2, 0xE0)}, **{b: 3 for b in range(0xE0, 0xF0)}, **{b: 4 for b in range(0xF0, 0xF5)}}


def completable(prefix: bytes) -> bool:
    """Reference: some continuation turns ``prefix`` into valid UTF-8 (Python's strict decoder decides)."""
    try:
        _, used = codecs.utf_8_decode(prefix, "strict", False)
    except UnicodeDecodeError:
        return False
    tail = prefix[used:]
    if not tail:
        return True
    missing = SEQ_LEN.get(tail[0], 0) - len(tail)
    if missing <= 0:
        return False
    fills = [bytes([x]) + b"\x80" * (missing - 1) for x in range(0x80, 0xC0)] if len(tail) == 1 else [b"\x80" * missing]
    for f in fills:
        try:
            codecs.utf_8_decode(tail + f, "strict", True)
            return True
        except UnicodeDecodeError:
            pass
    return False


def first_bad(data: bytes) -> int | None:
    """Index of the first byte at which ``data[:i+1]`` can no longer be completed, by the guard of beam
    search (on the device); the host guard of greedy decoding must agree."""
    guard, host = Utf8Guard(1, "cpu"), HostUtf8Guard(1)
    found = None
    for i, b in enumerate(data):
        ok, guard.state = guard.next(None, torch.tensor([b + BYTE_OFFSET]))
        status = [0]
        host.advance([b + BYTE_OFFSET], status)
        assert (status[0] == 2) == (not bool(ok[0])), (data.hex(), i)
        if not bool(ok[0]):
            found = i
            break
    return found


def test_guard_matches_python_decoder_on_valid_and_random_bytes():
    text = "Datei öffnen · Открыть файл · ファイルを開く · 打开 · 파일 · ფაილი · မြန်မာ · 🙂𝄞"
    assert first_bad(text.encode()) is None
    rng = random.Random(0)
    # bytes drawn mostly from the interesting ranges: ASCII, continuation, every lead class, never-valid
    pool = [0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1, 0xED, 0xEE, 0xEF,
            0xF0, 0xF1, 0xF4, 0xF5, 0xFF]
    for _ in range(3000):
        data = bytes(rng.choice(pool) for _ in range(rng.randint(1, 6)))
        ref = next((i for i in range(len(data)) if not completable(data[: i + 1])), None)
        assert first_bad(data) == ref, data.hex()
    for bad, at in ((b"a\x80", 1), (b"\xc0\xaf", 0), (b"\xed\xa0\x80", 1), (b"\xf4\x90\x80\x80", 1),
                    (b"\xe3\x81a", 2), (b"\xe3\xe3", 1), (b"\xf5", 0)):
        assert first_bad(bad) == at, bad.hex()


@pytest.mark.parametrize("toks, want", [
    ([0x61, 0xC3, 0xA9], [0x61, 0xC3, 0xA9]), ([0x61, 0xE4, 0xB8], [0x61]), ([0x61, 0xE4], [0x61]),
    ([0xF0, 0x9F, 0x99, 0x82], [0xF0, 0x9F, 0x99, 0x82]), ([0xF0, 0x9F, 0x99], []), ([], [])])
def test_complete_prefix_drops_an_unfinished_last_character(toks, want):
    ids = [t + BYTE_OFFSET for t in toks]
    assert complete_prefix(ids) == [t + BYTE_OFFSET for t in want]
    assert complete_prefix(ids + [LANG_OFFSET - 1 + 500]) == ids + [LANG_OFFSET - 1 + 500]  # a piece ends it


class Utf8Writer(nn.Module):
    """A real (random) Transformer whose logits are masked, from each row's own output so far, to the bytes
    that keep it completable UTF-8 (decided by Python's decoder): a model that writes only valid UTF-8."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.max_positions = inner.max_positions if hasattr(inner, "max_positions") else 64

    def encode(self, src):
        return self.inner.encode(src)

    def decode_step(self, tokens, step, enc, cache):
        inner, hist = (None, [[] for _ in range(tokens.shape[0])]) if cache is None else cache
        if step > 0:
            hist = [h + [int(t) - BYTE_OFFSET] for h, t in zip(hist, tokens.tolist())]
        logits, inner = self.inner.decode_step(tokens, step, enc, inner)
        mask = torch.zeros_like(logits)
        for r, h in enumerate(hist):
            tail = bytes(h[-3:])
            for b in range(256):
                if not completable(tail + bytes([b])):
                    mask[r, BYTE_OFFSET + b] = -float("inf")
        return logits + mask, (inner, hist)

    def reorder_cache(self, cache, index):
        inner, hist = cache
        return self.inner.reorder_cache(inner, index), [hist[i] for i in index.tolist()]


def tiny_transformer():
    torch.manual_seed(3)
    cfg = ModelConfig(d_model=32, n_heads=4, encoder_layers=1, decoder_layers=2, ffn_dim=64, max_positions=64)
    return build_model(cfg, VOCAB.size).eval()


EXAMPLES = [Example(0, 1, b"hello world", b""), Example(1, 2, "Grüße".encode(), b""), Example(2, 0, "こんにちは".encode(), b""),
            Example(0, 2, b"a", b""), Example(1, 0, b"open the file", b""), Example(0, 1, b"", b"")]


@pytest.mark.parametrize("beam", [1, 4])
def test_models_writing_valid_utf8_decode_bit_for_bit_as_without_the_guard(beam):
    model = Utf8Writer(tiny_transformer())
    b = collate(EXAMPLES)
    kw = dict(beam=beam, lenpen=1.2, max_len_a=0, max_len_b=24)
    off = G.generate_with_scores(model, b.src, b.tgt_in[:, 0], stop_invalid_utf8=False, **kw)
    on = G.generate_with_scores(model, b.src, b.tgt_in[:, 0], stop_invalid_utf8=True, **kw)
    assert [(h.tokens, h.score, h.cut) for h in on] == [(h.tokens, h.score, h.cut) for h in off]
    assert not any(h.cut for h in on)
    assert any(t - BYTE_OFFSET >= 0x80 for h in on for t in h.tokens)  # multi-byte characters were written
    # the same random model without the mask writes invalid bytes: the guard has something to do there
    raw = G.generate_with_scores(model.inner, b.src, b.tgt_in[:, 0], stop_invalid_utf8=True, **kw)
    assert any(h.cut for h in raw)
    for h in raw:
        assert VOCAB.decode_counting(h.tokens).invalid == 0 or not h.cut


class Script(LogitsOnly):
    """Writes a fixed byte script (one huge logit per step) from a tiny random base; counts its steps."""

    def __init__(self, script: bytes, allowed: bytes, after: dict | None = None):
        super().__init__()
        self.script = [b + BYTE_OFFSET for b in script]
        self.allowed = [b + BYTE_OFFSET for b in allowed]
        self.after = after or {}  # previous byte -> {next token id: logit}
        self.steps = 0

    def decode_step(self, tokens, step, enc, cache):
        self.steps += 1
        n = tokens.shape[0]
        g = torch.Generator().manual_seed(step)
        logits = torch.full((n, VOCAB.size), -1e4)
        logits[:, self.allowed] = torch.rand((n, len(self.allowed)), generator=g)
        if step < len(self.script):
            logits[:, self.script[step]] = 20.0
        logits[:, EOS] = -50.0
        for prev, row in self.after.items():
            for tok, v in row.items():
                logits[tokens == prev + BYTE_OFFSET, tok] = v
        return logits, None


@pytest.mark.parametrize("beam", [1, 3])
def test_a_model_forced_into_an_invalid_sequence_stops_there_and_is_counted(beam):
    script = "aé".encode() + b"\xe4A" + b"bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"  # E4 then 'A': invalid at byte 4
    model = Script(script, allowed=b"abA\xc3\xa9\xe4\xb8\xad")
    exs = [Example(0, 1, b"xyz", b"ref"), Example(1, 0, b"q", b"ref")]
    res = translate_examples(model, exs, VOCAB, batch_tokens=1000, beam=beam, max_len_a=0, max_len_b=60)
    assert res.cut == [True, True] and res.n_cut == 2 and res.n_invalid == 0
    if beam == 1:
        assert res.texts == ["aé", "aé"]  # stopped before 'A', the unfinished E4 trimmed
    assert all("\ufffd" not in t for t in res.texts)
    assert model.steps < 20  # far from the 60-byte limit
    model.steps = 0
    off = translate_examples(model, exs, VOCAB, batch_tokens=1000, beam=beam, max_len_a=0, max_len_b=60,
                               stop_invalid_utf8=False)
    assert off.n_cut == 0 and off.n_invalid_lines == 2 and model.steps >= 60  # without: to the length limit


def test_a_hypothesis_that_ended_with_eos_beats_a_better_scored_cut_one():
    # 'a' is likely at step 0, then the script goes on into E4 'A' (invalid); after 'b' EOS is likely
    model = Script(b"a\xe4A", allowed=b"abA\xe4", after={ord("b"): {EOS: 25.0}})
    b = collate([Example(0, 1, b"xyz", b"")])
    kw = dict(beam=3, lenpen=1.0, max_len_a=0, max_len_b=30, stop_invalid_utf8=True)
    hyps = G.generate_with_scores(model, b.src, b.tgt_in[:, 0], **kw)
    model.after = {}  # no EOS anywhere: every hypothesis is cut, the best is the cut "a"
    cut = G.generate_with_scores(model, b.src, b.tgt_in[:, 0], **kw)
    assert cut[0].tokens == [BYTE_OFFSET + ord("a")] and cut[0].cut
    assert not hyps[0].cut and hyps[0].score < cut[0].score  # the cut one scored higher and still lost


class RandomBytes(LogitsOnly):
    """Logits from the previous token and the step only, over a few bytes most of which are invalid in most
    contexts (lead bytes, continuation bytes, ASCII), so beams often have fewer valid candidates than slots."""

    ALLOWED = b"a \x80\xa9\xbf\xc3\xe4\xf0\xff"

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn((VOCAB.size, 64, VOCAB.size), generator=g) * 3
        mask = torch.full((VOCAB.size,), -float("inf"))
        mask[[b + BYTE_OFFSET for b in self.ALLOWED] + [EOS]] = 0.0
        self.mask = mask

    def decode_step(self, tokens, step, enc, cache):
        return self.table[tokens, step] + self.mask, None


@pytest.mark.parametrize("beam", [1, 2, 3, 5])
def test_with_the_guard_no_output_holds_an_invalid_sequence(beam):
    b = collate([Example(0, 1, b"xyz", b""), Example(1, 2, b"hello", b"")])
    n_cut = 0
    for seed in range(25):
        model = RandomBytes(seed)
        for h in G.generate_with_scores(model, b.src, b.tgt_in[:, 0], beam=beam, max_len_a=0, max_len_b=20,
                                        stop_invalid_utf8=True):
            data = bytes(t - BYTE_OFFSET for t in h.tokens)
            assert first_bad(data) is None, (seed, data.hex())  # at most an unfinished last character (EOS)
            n_cut += h.cut
    assert n_cut >= 5


def test_a_beam_is_cut_once_and_a_sentence_whose_beams_all_died_ends():
    # only stray continuation bytes (never valid first) and an unlikely EOS: beam 0's top candidates are
    # all invalid at step 0; it is cut once (not three times), and no live beam is left
    model = Script(b"", allowed=b"\x80\x81\x82\x83\x84\x85")
    b = collate([Example(0, 1, b"xyz", b"")])
    hyps = G.generate_with_scores(model, b.src, b.tgt_in[:, 0], beam=3, max_len_a=0, max_len_b=40,
                                  stop_invalid_utf8=True)
    assert hyps[0].tokens == [] and hyps[0].cut
    assert model.steps <= 2


class Table(LogitsOnly):
    """Logits from the previous token only: ``rules[prev] = {token: logit}``, every other token -1e4, EOS -50."""

    def __init__(self, rules: dict):
        super().__init__()
        self.rules = rules

    def decode_step(self, tokens, step, enc, cache):
        logits = torch.full((tokens.shape[0], VOCAB.size), -1e4)
        logits[:, EOS] = -50.0
        for r, prev in enumerate(tokens.tolist()):
            for tok, v in self.rules.get(prev, {}).items():
                logits[r, tok] = v
        return logits, None


def test_several_invalid_bytes_of_one_beam_cut_it_once():
    by = lambda ch: BYTE_OFFSET + (ord(ch) if isinstance(ch, str) else ch)  # noqa: E731
    b = collate([Example(0, 1, b"xyz", b"")])
    tag = int(b.tgt_in[0, 0])
    # step 0: a, b, c; after 'a' three stray continuation bytes lead (all invalid); after 'b' and 'c' comes
    # 'c', after which EOS is likely. Counted three times, beam 'a' alone would finish the sentence (beam 3)
    # before 'bc' reaches EOS.
    model = Table({tag: {by("a"): 20.0, by("b"): 15.0, by("c"): 14.0},
                   by("a"): {by(0x80): 19.0, by(0x81): 18.9, by(0x82): 18.8},
                   by("b"): {by("c"): 20.0}, by("c"): {by("c"): 20.0, EOS: 25.0}})
    hyps = G.generate_with_scores(model, b.src, b.tgt_in[:, 0], beam=3, max_len_a=0, max_len_b=20,
                                  stop_invalid_utf8=True)
    assert hyps[0].tokens == [by("b"), by("c")] and not hyps[0].cut
