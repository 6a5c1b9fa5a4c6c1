"""The subword baseline's data side: SentencePiece BPE trained by `prepare` / `data spm`, the
SubwordVocab id layout, and the stream tokenizing on the fly (budget in tokens, exact resume,
rank disjointness, equal batch counts)."""
from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import TEST_LANGS
from scaletrain.cli import main as cli_main
from scaletrain.config import Config
from scaletrain.data.inspect_shards import verify
from scaletrain.data.shards import load_manifest, read_split
from scaletrain.data.spm_models import load_shard_vocab
from scaletrain.data.loader import ShardLoader, pack_chunk, unpack_chunk
from scaletrain.data.stream import ShardStream
from scaletrain.errors import ScaletrainError
from scaletrain.prepare.spm_train import add_spm_model, iter_train_sentences, train_spm_bytes
from scaletrain.vocab import BOS, EOS, LANG_OFFSET, PAD, UNK, ByteVocab, SubwordVocab, load_vocab

N = 600  # smallest round size that holds 4 specials + 256 bytes + the 5 test languages' characters at 0.98
COV = 0.98


@pytest.fixture(scope="module")
def spm_dir(django_shards, tmp_path_factory):
    """A copy of the session's django shards (left untouched) with a 600-piece model added."""
    d = tmp_path_factory.mktemp("subword") / "dj"
    shutil.copytree(django_shards, d)
    entry = add_spm_model(d, N, character_coverage=COV)
    return d, entry


@pytest.fixture(scope="module")
def vocab(spm_dir):
    d, _ = spm_dir
    return load_shard_vocab(load_manifest(d).languages, "spm", d)


def texts(d, split="test"):
    return [t.decode("utf-8") for e in read_split(d, split) for t in (e.src, e.tgt)]


# ---- the vocabulary ----------------------------------------------------------------------------
def test_id_layout_and_pieces(vocab, spm_dir):
    langs = ["en", *TEST_LANGS]
    assert vocab.kind == "spm" and vocab.langs == langs
    assert (vocab.pad, vocab.bos, vocab.eos, vocab.unk) == (PAD, BOS, EOS, UNK) == (0, 1, 2, 3)
    assert [vocab.token_str(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert vocab.token_str(4) == "<0x00>" and vocab.token_str(259) == "<0xFF>"  # byte fallback after specials
    assert vocab.spm_size == N and vocab.lang_offset == N and vocab.size == N + len(langs) == len(vocab)
    assert vocab.lang_ids().tolist() == list(range(N, N + len(langs)))
    for i, code in enumerate(langs):
        assert vocab.lang_id(code) == N + i and vocab.lang_of_id(N + i) == code
        assert vocab.token_str(N + i) == f"__{code}__" and vocab.is_lang_id(N + i)
    assert not vocab.is_lang_id(N - 1) and not vocab.is_lang_id(vocab.size)
    p = vocab.pieces()
    assert len(p) == vocab.size
    assert p[:4] == [""] * 4 and p[N:] == [""] * len(langs)
    assert p[4 + 0x41] == "A" and p[4 + 0xC3] == ""  # ASCII byte piece = its character; a lone high byte: none
    learned = [vocab.token_str(i) for i in range(260, N)]
    assert p[260:N] == learned and all(learned) and any(x.startswith("\u2581") for x in learned)
    with pytest.raises(ScaletrainError, match="outside the vocabulary"):
        vocab.token_str(vocab.size)
    with pytest.raises(ScaletrainError, match="unknown language code 'xx'"):
        vocab.lang_id("xx")
    b = ByteVocab(langs)
    assert b.kind == "byte" and b.lang_offset == LANG_OFFSET and len(b.pieces()) == b.size
    assert b.pieces()[4 + ord("a")] == "a" and b.pieces()[4 + 0xE9] == "\xe9" and b.pieces()[LANG_OFFSET] == ""


def test_round_trip_real_lines_and_unseen_text(vocab, spm_dir):
    d, _ = spm_dir
    lines = texts(d, "test") + texts(d, "valid")
    assert len(lines) > 1000
    used = set()
    for s in lines:
        ids = vocab.encode(s)
        assert ids[-1] == EOS and all(4 <= i < N for i in ids[:-1])
        r = vocab.decode_counting(ids)
        assert r.text == s and r.invalid == 0
        used.update(ids)
    # every test language round-trips (the split holds both sides of each direction)
    assert {vocab.langs[e.src_lang] for e in read_split(d, "test")} == set(vocab.langs)
    # text outside the training characters: byte fallback spells it, nothing becomes <unk>
    for s in ["emoji \U0001F469\u200d\U0001F4BB ok", "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35 (Thai)",
              "\ud55c\uad6d\uc5b4 \u10e5\u10d0\u10e0\u10d7\u10e3\u10da\u10d8", "  two  spaces\tand tab ", " lead",
              "\u00e9\u0301 \ufeff \u202e"]:
        ids = vocab.encode(s, add_eos=False)
        assert UNK not in ids and vocab.decode(ids) == s
        assert vocab._sp.decode(ids) == s  # same text as SentencePiece's own decoder
    assert any(4 <= i < 260 for i in vocab.encode("\U0001F469"))  # via byte pieces
    # decode stops at EOS and drops specials / tags; malformed byte sequences are counted
    ids = [vocab.lang_id("de"), BOS] + vocab.encode("abc") + vocab.encode("zzz")
    assert vocab.decode(ids) == "abc"
    r = vocab.decode_counting([4 + 0xC3, *vocab.encode("x", add_eos=False), 4 + 0xFF])
    assert r.text == "\ufffd x\ufffd" and r.invalid == 2  # "x" is the piece "▁x"
    # encode_batch == encode per text, without EOS; encode_flat is its concatenation
    batch = [s.encode() for s in lines[:50]]
    enc = vocab.encode_batch(batch)
    assert [e.tolist() for e in enc] == [vocab.encode(s, add_eos=False) for s in lines[:50]]
    flat, lens = vocab.encode_flat(batch)
    assert lens.tolist() == [len(e) for e in enc] and flat.tolist() == [i for e in enc for i in e]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\u2581"), max_size=80))
def test_round_trip_any_unicode(vocab, s):
    ids = vocab.encode(s)
    r = vocab.decode_counting(ids)
    assert UNK not in ids and ids[-1] == EOS and r.text == s and r.invalid == 0


def test_word_start_mark_is_the_documented_exception(vocab):
    assert vocab.decode(vocab.encode("a\u2581b")) == "a b"  # SentencePiece's whitespace mark


def test_training_is_deterministic_and_samples_a_fixed_subset(spm_dir, tmp_path):
    d, entry = spm_dir
    data = train_spm_bytes(iter_train_sentences(d), N, character_coverage=COV)
    assert hashlib.sha256(data).hexdigest() == entry["sha256"]  # same shards -> the same model
    # both directions are stored: the source sides alone hold every sentence once
    m = load_manifest(d)
    assert sum(1 for _ in iter_train_sentences(d)) == m.split("train").n_examples
    a = list(iter_train_sentences(d, max_sentences=500, seed=3))
    assert len(a) == 500 and a == list(iter_train_sentences(d, max_sentences=500, seed=3))
    assert a != list(iter_train_sentences(d, max_sentences=500, seed=4))
    assert Counter(a) <= Counter(iter_train_sentences(d))
    with pytest.raises(ScaletrainError, match=r"--spm-vocab-size 400 cannot hold .*needed"):
        train_spm_bytes(iter_train_sentences(d), 400, character_coverage=COV)
    with pytest.raises(ScaletrainError, match="character-coverage in"):
        train_spm_bytes(iter(["a b"]), 300, character_coverage=0.9)


def test_manifest_entry_and_verify_catch_corruption(spm_dir, tmp_path):
    d, entry = spm_dir
    m = load_manifest(d)
    assert m.tokenizers == [entry]
    assert {k: entry[k] for k in ("type", "file", "vocab_size")} == {"type": "spm", "file": f"spm{N}.model",
                                                                     "vocab_size": N}
    assert entry["sha256"] == hashlib.sha256((d / entry["file"]).read_bytes()).hexdigest()
    assert entry["params"]["byte_fallback"] is True and entry["params"]["model_type"] == "bpe"
    assert set(entry["lengths"]) == set(m.splits)
    tl = np.load(d / entry["lengths"]["train"]["file"])
    assert tl.shape == (m.split("train").n_examples, 2)
    assert verify(d).ok and verify(d).tokenizers == 1
    # a corrupted model: verify names it, and the vocabulary refuses to load it
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    raw = bytearray((bad / entry["file"]).read_bytes())
    raw[200] ^= 0xFF
    (bad / entry["file"]).write_bytes(bytes(raw))
    rep = verify(bad)
    assert not rep.ok and any(f"spm{N}.model: sha256 differs" in p for p in rep.problems)
    with pytest.raises(ScaletrainError, match="sha256 differs from the manifest"):
        load_shard_vocab(m.languages, "spm", bad)
    # a corrupted lengths file too
    shutil.copy(d / entry["file"], bad / entry["file"])
    lf = bad / entry["lengths"]["valid"]["file"]
    arr = np.load(lf)
    arr[0, 0] += 1
    np.save(lf, arr)
    rep = verify(bad)
    assert [p for p in rep.problems] == [f"{lf}: sha256 differs from the manifest (corrupt token lengths; re-create "
                                         f"with `scaletrain data spm {bad} --vocab-size {N} --overwrite`)"]
    # ... which the stream also catches when the rank tokenizes that block itself
    v = load_shard_vocab(m.languages, "spm", bad)
    with pytest.raises(ScaletrainError, match="token lengths differ from the tokenizer's lengths file"):
        list(ShardStream(bad, "valid", max_tokens=4096, max_bytes=256, epochs=1, vocab=v, shuffle=False))


# ---- the stream ---------------------------------------------------------------------------------
KW = dict(max_tokens=1500, max_bytes=300, buffer_size=2)


def decoded_rows(batch, vocab):
    out = []
    for i in range(batch.size):
        s, t = batch.src[i].tolist(), batch.tgt_out[i].tolist()
        out.append((s[0] - vocab.lang_offset, batch.tgt_in[i, 0].item() - vocab.lang_offset,
                    vocab.decode(s[1:]), vocab.decode(t)))
    return out


def test_stream_batches_tokens_tags_budget_and_coverage(spm_dir, vocab):
    d, _ = spm_dir
    exs = read_split(d, "train")
    full = {(e.src, e.tgt): (len(vocab.encode(e.src.decode(), False)), len(vocab.encode(e.tgt.decode(), False)))
            for e in exs}
    assert max(max(v) for v in full.values()) < KW["max_bytes"]  # nothing truncated at this setting
    s = ShardStream(d, epochs=1, vocab=vocab, **KW)
    batches = list(s)
    rows = []
    for b in batches:
        assert b.padded_tokens <= KW["max_tokens"]  # the budget counts padded TOKENS
        assert int(b.src.max()) < vocab.size and int(b.tgt_out.max()) < vocab.lang_offset
        assert torch.equal(b.src[:, 0], b.src_lang + vocab.lang_offset)
        assert torch.equal(b.tgt_in[:, 0], b.tgt_lang + vocab.lang_offset)
        assert torch.equal(b.tgt_in[:, 1:][b.tgt_in[:, 1:] != PAD], b.tgt_out[b.tgt_out > EOS])
        assert b.n_src_tokens == int((b.src != PAD).sum()) and b.n_tgt_tokens == int((b.tgt_out != PAD).sum())
        rows += decoded_rows(b, vocab)
    want = Counter((e.src_lang, e.tgt_lang, e.src.decode(), e.tgt.decode()) for e in exs)
    assert Counter(rows) == want  # every example exactly once, round-tripped through the ids
    # buckets follow token lengths: padding as low as the byte stream's at the same settings, while
    # the subword sequences are much shorter (fewer batches for the same budget)
    byte = list(ShardStream(d, epochs=1, max_tokens=1500, max_bytes=300, buffer_size=2))

    def real_and_pad(bs):
        real = sum(b.n_src_tokens + b.n_tgt_tokens for b in bs)
        return real, 1 - real / sum(b.padded_tokens for b in bs)

    (real_s, pad_s), (real_b, pad_b) = real_and_pad(batches), real_and_pad(byte)
    assert pad_s < pad_b + 0.05 and real_s < 0.7 * real_b and len(byte) > 1.3 * len(batches)  # 600 pieces: ~0.6
    # truncation caps TOKENS (data.max_bytes), keeping tag and EOS
    short = list(ShardStream(d, epochs=1, vocab=vocab, max_tokens=300, max_bytes=6, buffer_size=2))
    assert max(b.src.shape[1] for b in short) == 8 and max(b.tgt_out.shape[1] for b in short) == 7
    assert sum(b.size for b in short) == len(exs)


def assert_same_batches(got, want):
    """The resumed sequence is the uninterrupted one, batch for batch."""
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert torch.equal(x.src, y.src) and torch.equal(x.tgt_in, y.tgt_in) and torch.equal(x.tgt_out, y.tgt_out)


def test_stream_exact_resume_and_two_ranks(spm_dir, vocab):
    d, _ = spm_dir
    # (world size, rank, where to cut as a share of the 2-epoch run): mid-epoch 0, and inside epoch 1
    # (after the boundary), on one rank and on rank 1 of 2
    for ws, rank, at in ((1, 0, 0.3), (1, 0, 0.6), (2, 1, 0.4)):
        kw = dict(KW, vocab=vocab, world_size=ws, rank=rank, epochs=2)
        ref = list(ShardStream(d, **kw))
        cut = int(at * len(ref))
        a = ShardStream(d, **kw)
        it = iter(a)
        head = [next(it) for _ in range(cut)]
        state = json.loads(json.dumps(a.state_dict()))
        assert state["epoch"] == (at > 0.5)
        b = ShardStream(d, **kw)
        b.load_state_dict(state)
        rest = list(b)
        assert_same_batches(head + rest, ref)
    # 2 ranks: equal batch counts, together every example exactly once; the plan does not depend on
    # whether token lengths come from the lengths file or from tokenizing every slot
    per_rank, counts = [], []
    for rank in range(2):
        s = ShardStream(d, epochs=1, vocab=vocab, world_size=2, rank=rank, **KW)
        t = ShardStream(d, epochs=1, vocab=vocab, world_size=2, rank=rank, **KW)
        assert s.blocks.token_lengths is not None
        t.blocks.token_lengths = None  # no lengths file: every slot tokenized
        bs, bt = list(s), list(t)
        assert len(bs) == len(bt) and all(torch.equal(x.src, y.src) and torch.equal(x.tgt_out, y.tgt_out)
                                          for x, y in zip(bs, bt))
        counts.append(len(bs))
        per_rank.append(Counter(r for b in bs for r in decoded_rows(b, vocab)))
    assert counts[0] == counts[1] == ShardStream(d, vocab=vocab, world_size=2, **KW).batches_per_epoch(0)
    exs = read_split(d, "train")
    assert per_rank[0] + per_rank[1] == Counter((e.src_lang, e.tgt_lang, e.src.decode(), e.tgt.decode()) for e in exs)
    assert sum(per_rank[0].values()) > 0.4 * len(exs) and sum(per_rank[1].values()) > 0.4 * len(exs)


def test_stream_state_names_the_tokenizer_and_loader_keeps_tags(spm_dir, vocab):
    d, _ = spm_dir
    byte = ShardStream(d, epochs=1, **KW)
    sub = ShardStream(d, epochs=1, vocab=vocab, **KW)
    assert "tokenizer" not in byte.state_dict()["config"]  # byte checkpoints keep their state layout
    assert sub.state_dict()["config"]["tokenizer"] == f"spm:{vocab.sha256}"
    with pytest.raises(ScaletrainError, match="tokenizer: saved None now 'spm:"):
        sub.load_state_dict(byte.state_dict())
    assert ShardStream(d, epochs=1, vocab=ByteVocab(vocab.langs), **KW).vocab is None  # a ByteVocab = bytes
    with pytest.raises(ScaletrainError, match="differ from"):
        ShardStream(d, vocab=SubwordVocab(["en", "de"], d / f"spm{N}.model"), **KW)
    # the worker wire format keeps the subword tag ids; a loader without workers = the stream
    first = next(iter(ShardStream(d, epochs=1, vocab=vocab, **KW)))
    (back,) = unpack_chunk(pack_chunk([first]))
    assert all(torch.equal(getattr(first, f), getattr(back, f)) for f in ("src", "tgt_in", "tgt_out"))
    ld = list(ShardLoader(d, epochs=1, vocab=vocab, **KW))
    assert len(ld) == len(list(sub)) and torch.equal(ld[0].tgt_in, first.tgt_in)
    # pickling (DataLoader workers started with spawn) gives the same vocabulary
    import pickle

    v2 = pickle.loads(pickle.dumps(vocab))
    assert v2.sha256 == vocab.sha256 and v2.encode("Hallo Welt") == vocab.encode("Hallo Welt")


# ---- command line, config, errors ----------------------------------------------------------------
def test_prepare_spm_vocab_size_through_the_cli(tmp_path, capsys):
    out = tmp_path / "dj"
    assert cli_main(["prepare", "--langs", ",".join(TEST_LANGS), "--out", str(out), "--no-progress",
                     "--spm-vocab-size", str(N), "--spm-character-coverage", str(COV)]) == 0
    assert f"spm{N}.model: SentencePiece BPE, {N} pieces" in capsys.readouterr().out
    m = load_manifest(out)
    (e,) = m.tokenizers
    assert e["file"] == f"spm{N}.model" and e["vocab_size"] == N
    assert cli_main(["data", "verify", str(out)]) == 0
    v = load_shard_vocab(m.languages, "spm", out)
    assert v.size == N + 6
    # `data spm` adds a second size to existing shards; the config picks one by size
    assert cli_main(["data", "spm", str(out), "--vocab-size", "700", "--character-coverage", str(COV),
                     "--no-progress"]) == 0
    m = load_manifest(out)
    assert [t["vocab_size"] for t in m.tokenizers] == [N, 700]
    assert load_shard_vocab(m.languages, "spm", out, vocab_size=700).lang_offset == 700
    with pytest.raises(ScaletrainError, match="several SentencePiece models .*data.spm_vocab_size"):
        load_shard_vocab(m.languages, "spm", out)
    with pytest.raises(ScaletrainError, match=r"no SentencePiece model of size 800 .*it has: 600, 700"):
        load_shard_vocab(m.languages, "spm", out, vocab_size=800)
    capsys.readouterr()
    assert cli_main(["data", "spm", str(out), "--vocab-size", "300", "--character-coverage", str(COV),
                     "--no-progress"]) == 2
    assert "--vocab-size 300 cannot hold" in capsys.readouterr().err
    assert cli_main(["data", "spm", str(out), "--vocab-size", "100", "--no-progress"]) == 2
    assert "too small" in capsys.readouterr().err


def test_config_and_tokenizer_errors(django_shards):
    cfg = Config()
    cfg.data.tokenizer = "wordpiece"
    with pytest.raises(ScaletrainError, match="'data.tokenizer': must be byte or spm"):
        cfg.validate()
    cfg = Config()
    cfg.data.spm_vocab_size = 8000
    with pytest.raises(ScaletrainError, match="'data.spm_vocab_size'.*set data.tokenizer=spm"):
        cfg.validate()
    cfg.data.tokenizer = "spm"
    cfg.validate()
    langs = load_manifest(django_shards).languages
    assert isinstance(load_vocab(langs), ByteVocab)
    with pytest.raises(ScaletrainError, match=r"has no SentencePiece model .*--spm-vocab-size N"):
        load_shard_vocab(langs, "spm", django_shards)
    with pytest.raises(ScaletrainError, match="unknown tokenizer 'bpe' .*byte, spm"):
        load_shard_vocab(langs, "bpe", django_shards)
    with pytest.raises(ScaletrainError, match="needs the SentencePiece model"):
        load_vocab(langs, "spm")


def test_loader_workers_tokenize_and_resume_exactly(spm_dir, vocab):
    """Two DataLoader worker processes (forked after the parent used SentencePiece) tokenize their
    own slots; a loader restored mid-epoch continues with exactly the uninterrupted batches."""
    d, _ = spm_dir
    vocab.encode_flat([b"the parent tokenizes before the fork"])
    kw = dict(KW, vocab=vocab, num_workers=2, epochs=1)
    ref = list(ShardLoader(d, **kw))
    a = ShardLoader(d, **kw)
    it = iter(a)
    head = [next(it) for _ in range(len(ref) // 3)]
    state = a.state_dict()
    del it
    b = ShardLoader(d, **kw)
    b.load_state_dict(state)
    rest = list(b)
    assert_same_batches(head + rest, ref)
    assert int(min(x.src[:, 0].min() for x in ref)) >= vocab.lang_offset
    rows = Counter(r for x in ref for r in decoded_rows(x, vocab))
    assert rows == Counter((e.src_lang, e.tgt_lang, e.src.decode(), e.tgt.decode()) for e in read_split(d, "train"))
