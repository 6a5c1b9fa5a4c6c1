"""Shards: block format, deterministic tars, manifest, WebDataset compatibility, prepare_gettext."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import ROOT
from scaletrain import __version__
from scaletrain.data.batch import Example
from scaletrain.prepare.gettext import split_key, split_of
from scaletrain.prepare import prepare_gettext
from scaletrain.data.shards import (
    SplitWriter,
    decode_block,
    decode_lengths,
    encode_block,
    iter_shard_blocks,
    load_manifest,
    prepare_out_dir,
    read_split,
    write_manifest,
    Manifest,
)
from scaletrain.errors import ScaletrainError

LANGS = ["en", "de", "ja"]

examples_st = st.lists(
    st.builds(Example, st.integers(0, 2), st.integers(0, 2), st.binary(max_size=40), st.binary(max_size=40)),
    min_size=1,
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(examples_st)
def test_block_roundtrip(exs):
    buf = encode_block(exs)
    blk = decode_block(buf)
    assert blk.examples() == exs
    assert [blk.example(i) for i in range(len(exs))] == exs
    h = decode_lengths(buf[: 12 + 12 * len(exs)])  # header arrays alone are enough for lengths
    assert h.src_len.tolist() == [len(e.src) for e in exs]
    assert h.tgt_lang.tolist() == [e.tgt_lang for e in exs]


def test_block_layout_is_the_documented_one():
    exs = [Example(1, 0, b"ab", b"xyz"), Example(0, 2, b"", b"q")]
    buf = encode_block(exs, compact=False)  # full widths: flags 0, u16 languages, u32 lengths
    assert buf[:4] == b"STPB"
    assert np.frombuffer(buf, "<u2", 2, 4).tolist() == [1, 0]
    assert np.frombuffer(buf, "<u4", 1, 8).tolist() == [2]
    assert np.frombuffer(buf, "<u2", 4, 12).tolist() == [1, 0, 0, 2]
    assert np.frombuffer(buf, "<u4", 4, 20).tolist() == [2, 0, 3, 1]
    assert buf[36:] == b"abxyzq"
    buf = encode_block(exs)  # compact: u8 languages (flag 1), u8 lengths (flag 4)
    assert np.frombuffer(buf, "<u2", 2, 4).tolist() == [1, 5]
    assert list(buf[12:16]) == [1, 0, 0, 2] and list(buf[16:20]) == [2, 0, 3, 1] and buf[20:] == b"abxyzq"
    assert decode_block(buf).examples() == exs == decode_block(encode_block(exs, compact=False)).examples()


@pytest.mark.parametrize("n_src, lang, n_short, flags, arrays", [
    (255, 255, 1, 5, 2 * 2 * (1 + 1)),  # u8 languages, u8 lengths
    (256, 3, 1, 3, 2 * 2 * (1 + 2)),  # one long side in two examples: u16 lengths are smaller than escapes
    (300, 7, 9, 9, 2 * 10 * (1 + 1) + 4),  # one long side in ten: u8 lengths + one u32 overflow entry
    (70_000, 256, 1, 8, 2 * 2 * (2 + 1) + 4),  # u16 languages; a length beyond u16 always escapes
])
def test_compact_widths_follow_the_data(n_src, lang, n_short, flags, arrays):
    exs = [Example(lang, 0, b"s" * n_src, b"t")] + [Example(1, 2, b"u%d" % i, b"vw") for i in range(n_short)]
    buf = encode_block(exs)
    assert np.frombuffer(buf, "<u2", 1, 6).tolist() == [flags]
    text = sum(len(e.src) + len(e.tgt) for e in exs)
    assert len(buf) == 12 + arrays + text
    blk = decode_block(buf)
    assert blk.examples() == exs
    assert blk.src_len.dtype == np.dtype("<u4") and blk.src_lang.dtype == np.dtype("<u2")
    assert decode_lengths(buf[: 12 + arrays]).src_len.tolist() == [len(e.src) for e in exs]
    with pytest.raises(ScaletrainError, match="truncated"):
        decode_lengths(buf[: 12 + arrays - 1])
    with pytest.raises(ScaletrainError, match="does not match its header"):
        decode_block(buf[:-1])


def test_overflow_lengths_on_both_sides_in_order():
    exs = [Example(0, 1, b"a" * 400, b"b" * 255)] + [Example(1, 0, b"c", b"d" * (i + 1)) for i in range(8)] + \
          [Example(1, 0, b"e" * 256, b"f" * 1000)]
    buf = encode_block(exs)
    assert np.frombuffer(buf, "<u2", 1, 6).tolist() == [1 | 8]
    assert decode_block(buf).examples() == exs


def test_corrupt_blocks_are_rejected():
    buf = encode_block([Example(1, 0, b"ab", b"xyz")])
    with pytest.raises(ScaletrainError, match="magic"):
        decode_block(b"XXXX" + buf[4:], "m")
    with pytest.raises(ScaletrainError, match="does not match its header"):
        decode_block(buf[:-1], "m")
    with pytest.raises(ScaletrainError, match="truncated"):
        decode_block(buf[:10], "m")
    with pytest.raises(ScaletrainError, match="version"):
        decode_block(buf[:4] + b"\x07\x00" + buf[6:], "m")
    with pytest.raises(ScaletrainError, match="unknown block flags"):
        decode_block(buf[:6] + b"\x10\x00" + buf[8:], "m")
    with pytest.raises(ScaletrainError, match="unknown block flags"):
        decode_block(buf[:6] + b"\x06\x00" + buf[8:], "m")  # two length widths at once


def make_examples(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        lang = int(rng.integers(1, 3))
        a = f"english {i} ".encode() * int(rng.integers(1, 4))
        b = f"x{i}-".encode() * int(rng.integers(1, 9))
        out.append(Example(lang, 0, b, a) if i % 2 else Example(0, lang, a, b))
    return out


def write_dir(out, splits, shard_size=50, block_size=16, overwrite=False):
    out = prepare_out_dir(out, overwrite)
    infos = {}
    for name, exs in splits.items():
        w = SplitWriter(out, name, LANGS, shard_size=shard_size, block_size=block_size)
        w.add_all(exs)
        infos[name] = w.close()
    m = Manifest(LANGS, infos, cleaning={"kept": 1}, source={"type": "test"})
    write_manifest(out, m)
    return m


def test_writer_shards_blocks_stats_and_read_split(tmp_path):
    exs = make_examples(137)
    m = write_dir(tmp_path / "s", {"train": exs, "valid": exs[:5]})
    tr = m.splits["train"]
    assert [s.name for s in tr.shards] == ["train-000000.tar", "train-000001.tar", "train-000002.tar"]
    assert [s.n_examples for s in tr.shards] == [50, 50, 37]
    assert [b.n for b in tr.shards[0].blocks] == [16, 16, 16, 2]
    assert tr.n_blocks == 4 + 4 + 3
    for sh in tr.shards:
        raw = (tmp_path / "s" / sh.name).read_bytes()
        assert sh.bytes == len(raw) and sh.sha256 == hashlib.sha256(raw).hexdigest()
    assert read_split(tmp_path / "s", "train") == exs
    assert read_split(tmp_path / "s", "valid") == exs[:5]
    d = tr.directions
    assert sum(v.n for v in d.values()) == 137
    assert d["de-en"].src_bytes == sum(len(e.src) for e in exs if (e.src_lang, e.tgt_lang) == (1, 0))
    assert d["en-ja"].tgt_bytes == sum(len(e.tgt) for e in exs if (e.src_lang, e.tgt_lang) == (0, 2))
    loaded = load_manifest(tmp_path / "s")
    assert loaded == m
    assert loaded.scaletrain_version == __version__ and loaded.languages == LANGS
    with pytest.raises(ScaletrainError, match="split 'test'.*train, valid"):
        loaded.split("test")


def test_tar_members_are_deterministic_and_webdataset_readable(tmp_path):
    import webdataset as wds

    exs = make_examples(80)
    write_dir(tmp_path / "a", {"train": exs})
    write_dir(tmp_path / "b", {"train": exs})
    for name in ("train-000000.tar", "train-000001.tar"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    with tarfile.open(tmp_path / "a" / "train-000000.tar") as tar:
        for ti in tar.getmembers():
            assert (ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname, ti.mode) == (0, 0, 0, "", "", 0o644)
    urls = [str(tmp_path / "a" / "train-000000.tar"), str(tmp_path / "a" / "train-000001.tar")]
    ds = wds.WebDataset(urls, shardshuffle=False)
    got, keys = [], []
    for sample in ds:
        keys.append(sample["__key__"])
        got.extend(decode_block(sample["pairs"]).examples())
    assert got == exs
    assert keys[0] == "train-000000-000000" and len(keys) == 4 + 2
    # the plain-tar block iterator agrees
    blocks = [b for u in urls for _, b in iter_shard_blocks(u)]
    assert [e for b in blocks for e in b.examples()] == exs


def test_non_empty_output_refused_unless_overwrite(tmp_path):
    out = tmp_path / "s"
    write_dir(out, {"train": make_examples(10)})
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ScaletrainError, match="not empty.*overwrite"):
        write_dir(out, {"train": make_examples(10)})
    write_dir(out, {"train": make_examples(3)}, overwrite=True)
    assert (out / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "notes.txt", "train-000000.tar"]
    assert load_manifest(out).splits["train"].n_examples == 3


def test_manifest_errors_name_the_file(tmp_path):
    with pytest.raises(ScaletrainError, match=r"manifest.json not found"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ScaletrainError, match=r"manifest.json: cannot parse"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "scaletrain-shards", "format_version": 1}))
    with pytest.raises(ScaletrainError, match=r"manifest.json: corrupt manifest"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ScaletrainError, match=r"not a scaletrain shard manifest"):
        load_manifest(tmp_path)


def test_truncated_shard_is_reported_by_name(tmp_path):
    write_dir(tmp_path, {"train": make_examples(40)})
    p = tmp_path / "train-000000.tar"
    p.write_bytes(p.read_bytes()[:700])
    with pytest.raises(ScaletrainError, match="train-000000.tar"):
        read_split(tmp_path, "train")
    with pytest.raises(ScaletrainError, match="train-000000.tar"):
        list(iter_shard_blocks(p))


def test_prepare_gettext_django(tmp_path):
    out = tmp_path / "django"
    m = prepare_gettext(out=out, progress=False)
    assert m.languages[0] == "en" and len(m.languages) == 15
    tr, va, te = m.splits["train"], m.splits["valid"], m.splits["test"]
    assert len(tr.shards) >= 4 and tr.n_blocks >= 8
    assert va.n_examples > 0 and te.n_examples > 0
    total_pairs = m.cleaning["total"]["kept"]
    assert tr.n_examples + va.n_examples + te.n_examples == 2 * total_pairs
    # both directions, equal counts
    for lang in m.languages[1:]:
        assert tr.directions[f"{lang}-en"].n == tr.directions[f"en-{lang}"].n > 0
    # an English string (by its split key) is in exactly one split, for every language, and it is the hash's split
    seen = {}
    for split in ("train", "valid", "test"):
        for ex in read_split(out, split):
            en = split_key((ex.tgt if ex.tgt_lang == 0 else ex.src).decode())
            assert seen.setdefault(en, split) == split
            assert split_of(en, 0.05, 0.05, 0) == split
    # the train split is shuffled: its first block mixes languages
    first = read_split(out, "train")[:256]
    assert len({max(e.src_lang, e.tgt_lang) for e in first}) >= 10
    # same input -> byte-identical shards; the manifest is readable back and equal
    m2 = prepare_gettext(out=tmp_path / "again", progress=False)
    assert [s.sha256 for s in m2.splits["train"].shards] == [s.sha256 for s in tr.shards]
    assert load_manifest(out) == m
    with pytest.raises(ScaletrainError, match="not empty"):
        prepare_gettext(out=out, progress=False)
    m3 = prepare_gettext(langs=["de", "ja"], out=out, overwrite=True, progress=False, shard_size=100)
    assert m3.languages == ["en", "de", "ja"] and len(m3.splits["train"].shards) > 4
    assert not (out / "train-000000.tar").read_bytes() == (tmp_path / "again" / "train-000000.tar").read_bytes()


TORCH_FREE = ("scaletrain.fileio", "scaletrain.data.example", "scaletrain.data.sources", "scaletrain.data.shards",
              "scaletrain.data.spm_models",
              "scaletrain.vocab", "scaletrain.prepare", "scaletrain.prepare.spm_train", "scaletrain.prepare.build",
              "scaletrain.prepare.export_text")


def test_shards_and_prepare_do_not_import_torch():
    """Writing and reading shards (and prepare, the vocabularies, SentencePiece training) never loads
    torch: checked in a fresh interpreter, module by module."""
    script = (
        "import importlib, sys\n"
        f"for name in {TORCH_FREE!r}:\n"
        "    importlib.import_module(name)\n"
        "    assert 'torch' not in sys.modules, f'importing {name} loaded torch'\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
