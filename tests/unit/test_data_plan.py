"""Batch planning (Hilbert order + vectorised greedy cut) and the compact manifest block tables."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from scaletrain.data.batch import Batch, Example, collate
from scaletrain.data.shards import (
    BlockInfo,
    BlockTable,
    Manifest,
    ShardInfo,
    SplitWriter,
    load_manifest,
    prepare_out_dir,
    read_split,
    write_manifest,
)
from scaletrain.data.batching import decode_batches, greedy_cut, hilbert_index, plan_batches
from scaletrain.data.loader import ShardLoader, pack_chunk, unpack_chunk
from scaletrain.data.stream import ShardStream
from scaletrain.errors import ScaletrainError


def reference_cut(s, t, max_tokens):
    """The one-example-at-a-time greedy cut the vectorised one must equal."""
    bounds, ms, mt, c = [0], 0, 0, 0
    for i in range(len(s)):
        ns, nt = max(ms, s[i]), max(mt, t[i])
        if c and (c + 1) * (ns + nt) > max_tokens:
            bounds.append(i)
            ms, mt, c = s[i], t[i], 1
        else:
            ms, mt, c = ns, nt, c + 1
    return bounds + [len(s)]


@pytest.mark.parametrize("seed", range(6))
def test_greedy_cut_equals_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 4000))
    s, t = rng.integers(3, 400, n), rng.integers(2, 400, n)
    if seed % 2:
        s = np.sort(s)  # long runs of growing lengths exercise the doubling look-ahead
    for max_tokens in (5, 300, 4096, 10**6):
        assert greedy_cut(s, t, max_tokens) == reference_cut(s.tolist(), t.tolist(), max_tokens)


def reference_decode_batches(lengths, batch_tokens, beam, max_sentences):
    """Decoding batches one example at a time: longest first, a batch grows while its rows * beam * longest
    source stays within the budget and its rows within ``max_sentences``."""
    batches, cur, longest = [], [], 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        new_longest = max(longest, lengths[i])
        full = max_sentences is not None and len(cur) >= max_sentences
        if cur and ((len(cur) + 1) * beam * new_longest > batch_tokens or full):
            batches.append(cur)
            cur, new_longest = [], lengths[i]
        cur.append(i)
        longest = new_longest
    return batches + [cur] if cur else batches


@pytest.mark.parametrize("seed", range(6))
def test_decode_batches_share_the_greedy_cut_and_equal_the_reference(seed):
    """The evaluation batcher is the training batcher's cut over beam-expanded source lengths."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, [8, 60, 700][seed % 3], int(rng.integers(0, 500))).tolist()
    for budget, beam, cap in ((1, 1, None), (64, 4, None), (700, 2, 3), (5000, 5, 100), (10**6, 1, 0), (300, 3, -1)):
        got = decode_batches(lengths, budget, beam, cap)
        assert got == reference_decode_batches(lengths, budget, beam, cap)
        assert sorted(i for b in got for i in b) == list(range(len(lengths)))


def test_hilbert_index_is_a_bijection_with_unit_steps():
    xs, ys = np.meshgrid(np.arange(16), np.arange(16))
    x, y = xs.ravel(), ys.ravel()
    d = hilbert_index(x, y)
    assert sorted(d.tolist()) == list(range(256))
    o = np.argsort(d)
    steps = np.abs(np.diff(x[o])) + np.abs(np.diff(y[o]))
    assert (steps == 1).all()


def test_plan_batches_budget_coverage_and_less_padding_than_one_key_sort():
    # two clusters, as a window mixing xx->en and en->xx gives: long source with short target and
    # the reverse; sorting by the longer side alone pairs them up in the same batches
    rng = np.random.default_rng(0)
    a = rng.integers(20, 200, 4000)
    r = rng.uniform(1.8, 2.2, 4000)
    s = np.concatenate([a, (a / r).astype(int) + 1])
    t = np.concatenate([(a / r).astype(int) + 1, a])
    budget = 4096
    batches = plan_batches(s, t, budget, np.random.default_rng(1))
    idx = np.concatenate(batches)
    assert sorted(idx.tolist()) == list(range(len(s)))  # every example exactly once
    assert all(len(b) * (s[b].max() + t[b].max()) <= budget for b in batches)
    pad = sum(len(b) * (s[b].max() + t[b].max()) for b in batches)
    waste = 1 - (s + t).sum() / pad
    o = np.lexsort((s + t, np.maximum(s, t)))
    bounds = greedy_cut(s[o], t[o], budget)
    pad_key = sum((hi - lo) * (s[o][lo:hi].max() + t[o][lo:hi].max()) for lo, hi in zip(bounds[:-1], bounds[1:]))
    waste_key = 1 - (s + t).sum() / pad_key
    assert waste < 0.10 and waste < 0.5 * waste_key, (waste, waste_key)


# ---------------------------------------------------------------------------------------------
# block tables
# ---------------------------------------------------------------------------------------------
def write_small(tmp_path):
    out = prepare_out_dir(tmp_path / "s", overwrite=False)
    w = SplitWriter(out, "train", ["en", "de"], shard_size=10, block_size=4)
    w.add_all(Example(1, 0, b"x%d" % i, b"y" * (i % 5 + 1)) for i in range(23))
    write_manifest(out, Manifest(["en", "de"], {"train": w.close()}))
    return out


def test_block_table_sequence_and_manifest_arrays(tmp_path):
    out = write_small(tmp_path)
    d = json.loads((out / "manifest.json").read_text())
    sh0 = d["splits"]["train"]["shards"][0]
    assert d["format_version"] == 3 and {"offset", "size", "n", "crc32"} <= set(sh0["blocks"])
    assert np.frombuffer(base64.b64decode(sh0["blocks"]["n"]), "<u4").tolist() == [4, 4, 2]
    m = load_manifest(out)
    t = m.splits["train"].shards[0].blocks
    assert isinstance(t, BlockTable) and len(t) == 3
    assert t[0] == BlockInfo("train-000000-000000", 512, t[0].size, 4) and t[-1].key == "train-000000-000002"
    assert [b.key for b in t] == [b.key for b in t[0:3]] and t == list(t)
    with pytest.raises(IndexError):
        t[3]


def test_format_1_manifest_still_read(tmp_path):
    out = write_small(tmp_path)
    want = read_split(out, "train")
    d = json.loads((out / "manifest.json").read_text())
    d["format_version"] = 1
    for sh in d["splits"]["train"]["shards"]:
        b = BlockTable.from_dict(sh["name"][:-4], sh["blocks"]).to_dict()
        b = {k: np.frombuffer(base64.b64decode(b[k]), dt).tolist() for k, dt in (("offset", "<i8"), ("size", "<u4"),
                                                                                    ("n", "<u4"))}
        stem = sh["name"][:-4]
        sh["blocks"] = [{"key": f"{stem}-{i:06d}", "offset": o, "size": z, "n": n}
                        for i, (o, z, n) in enumerate(zip(b["offset"], b["size"], b["n"]))]
    (out / "manifest.json").write_text(json.dumps(d))
    assert read_split(out, "train") == want
    st = ShardStream(out, "train", max_tokens=64, max_bytes=8)
    assert st.n_blocks == 7 and sum(st.block(i)[1].n for i in range(st.n_blocks)) == 23
    assert st.block(6)[0].name == "train-000002.tar" and st.block(6)[1].key == "train-000002-000000"
    d["splits"]["train"]["shards"][0]["blocks"][1]["key"] = "train-000000-000009"
    (out / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(ScaletrainError, match="named 'train-000000-000009'"):
        load_manifest(out)


def test_block_table_json_lists_and_corrupt_base64(tmp_path):
    out = write_small(tmp_path)
    want = load_manifest(out)
    d = json.loads((out / "manifest.json").read_text())
    for sh in d["splits"]["train"]["shards"]:  # plain lists of numbers are read too
        t = BlockTable.from_dict(sh["name"][:-4], sh["blocks"])
        sh["blocks"] = {"offset": t.offset.tolist(), "size": t.size.tolist(), "n": t.n.tolist()}
    (out / "manifest.json").write_text(json.dumps(d))
    assert load_manifest(out) == want
    d["splits"]["train"]["shards"][0]["blocks"]["n"] = "not base64!"
    (out / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(ScaletrainError, match="corrupt manifest"):
        load_manifest(out)


def test_shard_info_from_a_list_of_blocks():
    sh = ShardInfo("valid-000003.tar", "0" * 64, 2048, 5, 2,
                   [BlockInfo("valid-000003-000000", 512, 100, 3), BlockInfo("valid-000003-000001", 1536, 50, 2)])
    assert isinstance(sh.blocks, BlockTable) and sh.blocks[1] == BlockInfo("valid-000003-000001", 1536, 50, 2)
    assert ShardInfo.from_dict(sh.to_dict()) == sh


# ---------------------------------------------------------------------------------------------
# what crosses the DataLoader worker boundary
# ---------------------------------------------------------------------------------------------
def assert_same_batch(a, b):
    for name in ("src", "tgt_in", "tgt_out", "src_lang", "tgt_lang"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert (a.n_src_tokens, a.n_tgt_tokens) == (b.n_src_tokens, b.n_tgt_tokens)


def test_pack_unpack_roundtrip():
    exs = [Example(3, 0, b"abc", b""), Example(0, 7, b"", b"xyz\x02\x00"), Example(1, 2, b"q" * 9, b"r" * 4)]
    b = collate(exs, max_bytes=6)
    packed = pack_chunk([b])
    assert packed[1].dtype == np.uint16
    (back,) = unpack_chunk(packed)
    assert_same_batch(back, b)
    # a chunk of several batches, one of them with ids beyond uint16 (a large subword vocabulary)
    big = Batch(b.src + 70000, b.tgt_in, b.tgt_out, b.src_lang, b.tgt_lang, b.n_src_tokens, b.n_tgt_tokens)
    for chunk in ([b, b, b], [b, big]):
        packed = pack_chunk(chunk)
        assert packed[1].dtype == (np.uint16 if len(chunk) == 3 else np.int64)
        back = unpack_chunk(packed)
        assert len(back) == len(chunk)
        for x, y in zip(back, chunk):
            assert_same_batch(x, y)


def test_loader_with_one_worker_process_equals_stream(tmp_path):
    out = write_small(tmp_path)
    kw = dict(max_tokens=40, max_bytes=8, epochs=2, buffer_size=2)
    a = list(ShardLoader(out, "train", num_workers=1, **kw))
    b = list(ShardStream(out, "train", **kw))
    assert len(a) == len(b) > 4
    for x, y in zip(a, b):
        assert_same_batch(x, y)


def test_prepare_argument_defaults_match_the_library():
    from scaletrain.prepare import args, build

    assert args._SHARD_LINES == build.PARALLEL_SHARD_LINES
    assert args._BLOCK_SIZE == build.PARALLEL_BLOCK_SIZE
