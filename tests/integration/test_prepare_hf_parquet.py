"""`prepare --source hf-parquet`: the Hugging Face Hub layout of OPUS-100 (one folder per pair,
``<split>-NNNNN-of-NNNNN.parquet`` files with a ``translation`` struct column), built with pyarrow
from real text (django's gettext catalogs), prepared in 2 workers, read back through the manifest
and the training stream; bad inputs fail in one line naming the file or folder."""
from __future__ import annotations

import argparse
import subprocess
import sys
from collections import Counter

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from helpers import ROOT  # noqa: E402
from scaletrain.prepare.gettext import read_gettext, split_of  # noqa: E402
from scaletrain.prepare import add_prepare_arguments, prepare_from_args  # noqa: E402
from scaletrain.data.shards import load_manifest, read_split  # noqa: E402
from scaletrain.data.stream import ShardStream  # noqa: E402
from scaletrain.errors import ScaletrainError  # noqa: E402
from scaletrain.vocab import BYTE_OFFSET, EOS  # noqa: E402

PAIRS = {"de": "de-en", "ru": "en-ru", "ja": "ja-en"}  # ja: train only, in two files
HUB_SPLITS = {"train": "train", "valid": "validation", "test": "test"}


def prepare_args(*argv):
    p = argparse.ArgumentParser()
    add_prepare_arguments(p)
    return prepare_from_args(p.parse_args(["--no-progress", *argv]))


def write_parquet(path, rows, row_group_size=64):
    """rows: list of {lang: sentence} dicts (or None for a null struct)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    langs = sorted({k for r in rows if r for k in r})
    t = pa.struct([(l, pa.string()) for l in langs])
    table = pa.table({"id": pa.array([str(i) for i in range(len(rows))]),
                      "translation": pa.array(rows, type=t)})
    pq.write_table(table, path, row_group_size=row_group_size)


def _sides(row, src, tgt):
    return row[src].strip().encode(), row[tgt].strip().encode()


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory):
    """The Hub layout from real text; returns (root, {pair: {split: [(src, tgt) kept]}}, n_rows)."""
    root = tmp_path_factory.mktemp("hub")
    corpus = read_gettext("django", list(PAIRS))
    kept: dict = {}
    n_rows = 0
    for lang, pair in PAIRS.items():
        src, tgt = pair.split("-")
        by = {s: [] for s in HUB_SPLITS}
        for en, xx in corpus.pairs[lang]:
            by[split_of(en, 0.08, 0.08, seed=0)].append({"en": en, lang: xx})
        if lang == "ja":
            rows = by["train"] + by["valid"] + by["test"]
            half = len(rows) // 2
            write_parquet(root / pair / "train-00000-of-00002.parquet", rows[:half])
            write_parquet(root / pair / "train-00001-of-00002.parquet", rows[half:])
            by = {"train": rows}
        else:
            for s, rows in by.items():
                if s == "train" and lang == "ru":  # a null row and a too-long row: counted, dropped
                    rows = rows[:50] + [None, {"en": "y", "ru": "x" * 900}] + rows[50:]
                write_parquet(root / pair / f"{HUB_SPLITS[s]}-00000-of-00001.parquet", rows)
        kept[pair] = {s: [(a, b) for a, b in (_sides(r, src, tgt) for r in rows if r) if a and b
                          and max(len(a), len(b)) <= 800] for s, rows in by.items()}
        n_rows += sum(len(r) for r in by.values()) + (2 if lang == "ru" else 0)
    (root / "README.md").write_text("dataset card")  # ignored
    return root, kept, n_rows


@pytest.fixture(scope="module")
def hub_shards(hub_dir, tmp_path_factory):
    root, _, _ = hub_dir
    out = tmp_path_factory.mktemp("hub_shards") / "s"
    assert prepare_args("--source", "hf-parquet", "--input", str(root), "--out", str(out), "--workers", "2",
                        "--shard-lines", "150", "--block-size", "64") == 0
    return out


def test_manifest_counts_and_content(hub_dir, hub_shards):
    _, kept, n_rows = hub_dir
    m = load_manifest(hub_shards)
    assert m.languages == ["en", "de", "ja", "ru"]
    assert m.source["type"] == "hf-parquet" and m.source["pairs"] == ["de-en", "en-ru", "ja-en"]
    assert m.source["no_eval"] == ["ja-en"]
    tot = m.cleaning["total"]
    assert tot["lines"] == n_rows and tot["malformed"] == 1 and tot["too_long"] == 1
    assert tot["kept"] == n_rows - 2
    for split in ("train", "valid", "test"):
        d = m.splits[split].directions
        for pair, by in kept.items():
            src, tgt = pair.split("-")
            n = len(by.get(split, []))
            got = d.get(f"{src}-{tgt}")
            assert (got.n if got else 0) == n and (d[f"{tgt}-{src}"].n if n else 0) == n, (split, pair)
        # content: both directions of every kept row, nothing else
        lang = m.languages
        ex = Counter((lang[e.src_lang], lang[e.tgt_lang], e.src, e.tgt) for e in read_split(hub_shards, split))
        want = Counter()
        for pair, by in kept.items():
            src, tgt = pair.split("-")
            for a, b in by.get(split, []):
                want[(src, tgt, a, b)] += 1
                want[(tgt, src, b, a)] += 1
        assert ex == want, split
    # 150 rows per shard: the ru train file (row groups of 64) is cut inside row groups
    assert len(m.splits["train"].shards) >= 6


def test_data_stats_and_resume_of_a_complete_run(hub_dir, hub_shards):
    p = subprocess.run([sys.executable, "-m", "scaletrain", "data", "stats", str(hub_shards)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "languages: en, de, ja, ru" in p.stdout and "train only (left out of evaluation): ja-en" in p.stdout
    root, _, _ = hub_dir
    before = (hub_shards / "manifest.json").read_bytes()
    assert prepare_args("--source", "hf-parquet", "--input", str(root), "--out", str(hub_shards), "--resume",
                        "--shard-lines", "150", "--block-size", "64") == 0
    assert (hub_shards / "manifest.json").read_bytes() == before


def test_interrupted_prepare_resumes(hub_dir, hub_shards, tmp_path, monkeypatch):
    """A run that dies part way (the 4th row range raises) continues with --resume into the same
    shards and manifest as the uninterrupted run."""
    import scaletrain.prepare.build as prep

    root, _, _ = hub_dir
    real, calls = prep.read_parquet_range, []

    def flaky(*a, **k):
        calls.append(a)
        if len(calls) == 4:
            raise RuntimeError("killed")
        return real(*a, **k)

    monkeypatch.setattr(prep, "read_parquet_range", flaky)
    argv = ["--source", "hf-parquet", "--input", str(root), "--out", str(tmp_path / "s"), "--shard-lines", "150",
            "--block-size", "64"]
    with pytest.raises(RuntimeError, match="killed"):
        prepare_args(*argv)
    assert (tmp_path / "s" / ".prepare").is_dir() and not (tmp_path / "s" / "manifest.json").exists()
    monkeypatch.setattr(prep, "read_parquet_range", real)
    assert prepare_args(*argv, "--resume") == 0
    a, b = load_manifest(hub_shards), load_manifest(tmp_path / "s")
    assert a.cleaning == b.cleaning and a.splits == b.splits


def test_stream_reads_it(hub_shards):
    m = load_manifest(hub_shards)
    s = ShardStream(hub_shards, "train", epochs=1, max_tokens=2048, max_bytes=256, buffer_size=2)
    got = Counter()
    for b in s:
        for i in range(b.size):
            t = b.tgt_out[i].tolist()
            got[bytes(x - BYTE_OFFSET for x in t[: t.index(EOS)])] += 1
    want = Counter(e.tgt for e in read_split(hub_shards, "train") if len(e.tgt) < 200)
    assert sum(got.values()) == m.splits["train"].n_examples  # one epoch: every example once
    assert all(got[t] == n for t, n in want.items())


def _bad(tmp_path, msg_part, name_part):
    with pytest.raises(ScaletrainError) as ei:
        prepare_args("--source", "hf-parquet", "--input", str(tmp_path / "in"), "--out", str(tmp_path / "o"))
    msg = str(ei.value)
    assert "\n" not in msg and msg_part in msg and name_part in msg, msg


def test_bad_inputs_name_the_file(tmp_path):
    good = [{"de": "Hallo", "en": "Hello"}, {"de": "Ja", "en": "Yes"}]
    write_parquet(tmp_path / "in" / "de-en" / "train-00000-of-00001.parquet", good)
    # a file without the translation column
    f = tmp_path / "in" / "de-en" / "test-00000-of-00001.parquet"
    pq.write_table(pa.table({"de": ["a"], "en": ["b"]}), f)
    _bad(tmp_path, "no 'translation' column", str(f))
    f.unlink()
    # a struct without the folder's languages
    write_parquet(f, [{"de": "a", "fr": "b"}])
    _bad(tmp_path, "needs de and en", str(f))
    f.unlink()
    # a file name that is no split
    g = tmp_path / "in" / "de-en" / "extra.parquet"
    write_parquet(g, good)
    _bad(tmp_path, "names no split", str(g))
    g.unlink()
    # a folder that is not a pair
    d = tmp_path / "in" / "german"
    write_parquet(d / "train-00000-of-00001.parquet", good)
    _bad(tmp_path, "not a language pair", str(d))


def test_cli_help_and_missing_input():
    p = subprocess.run([sys.executable, "-m", "scaletrain", "prepare", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert "hf-parquet" in p.stdout and "--input" in p.stdout
    with pytest.raises(ScaletrainError, match="needs --input"):
        prepare_args("--source", "hf-parquet", "--out", "o")
    with pytest.raises(ScaletrainError, match="--input belongs to --source hf-parquet"):
        prepare_args("--source", "moses", "--input", "x", "--out", "o")
