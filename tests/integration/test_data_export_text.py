"""`scaletrain data export`: a split as line-aligned plain text per direction, from real text
(django's gettext catalogs): line counts equal the manifest's, content round-trips, a failed export
leaves the previous files whole."""
from __future__ import annotations

import shutil
import subprocess
import sys
from collections import defaultdict

import pytest

from helpers import ROOT
from scaletrain.prepare import export_split
from scaletrain.prepare.gettext import read_gettext
from scaletrain.data.shards import Manifest, SplitWriter, load_manifest, prepare_out_dir, read_split, write_manifest
from scaletrain.data.example import Example
from scaletrain.errors import ScaletrainError


def cli(*args):
    return subprocess.run([sys.executable, "-m", "scaletrain", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def by_direction(shards, split):
    m = load_manifest(shards)
    d = defaultdict(list)
    for e in read_split(shards, split):
        d[m.direction(e.src_lang, e.tgt_lang)].append((e.src, e.tgt))
    return d


def lines(path):
    data = path.read_bytes()
    assert data.endswith(b"\n")
    return data[:-1].split(b"\n")


def test_export_every_direction_round_trips(django_shards, tmp_path):
    p = cli("data", "export", str(django_shards), "--split", "test", "--out", str(tmp_path / "txt"))
    assert p.returncode == 0, p.stderr
    m = load_manifest(django_shards)
    want = by_direction(django_shards, "test")
    assert set(want) == set(m.splits["test"].directions)
    names = sorted(f.name for f in (tmp_path / "txt").iterdir())
    assert names == sorted(f"test.{d}.{l}" for d in want for l in d.split("-"))  # nothing else (no temp files)
    for d, pairs in want.items():
        s, t = d.split("-")
        src, tgt = lines(tmp_path / "txt" / f"test.{d}.{s}"), lines(tmp_path / "txt" / f"test.{d}.{t}")
        assert len(src) == len(tgt) == m.splits["test"].directions[d].n
        assert list(zip(src, tgt)) == pairs
        assert f"{d}: {len(pairs):,} lines" in p.stdout


def test_one_direction_and_unknown(django_shards, tmp_path):
    p = cli("data", "export", str(django_shards), "--split", "valid", "--direction", "de-en", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert sorted(f.name for f in tmp_path.iterdir()) == ["valid.de-en.de", "valid.de-en.en"]
    assert len(lines(tmp_path / "valid.de-en.de")) == load_manifest(django_shards).splits["valid"].directions["de-en"].n
    p = cli("data", "export", str(django_shards), "--direction", "de-xx", "--out", str(tmp_path / "o"))
    assert p.returncode != 0 and "no direction de-xx" in p.stderr and "de-en" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_line_breaks_inside_sentences_keep_alignment(tmp_path):
    pairs = read_gettext("django", ["de"]).pairs["de"][:40]
    exs = []
    for i, (en, de) in enumerate(pairs):
        if i % 5 == 0:  # two real sentences joined by a line break
            en, de = en + "\n" + pairs[i + 1][0], de + "\r\n" + pairs[i + 1][1]
        exs.append(Example(1, 0, de.encode(), en.encode()))
    out = prepare_out_dir(tmp_path / "s", overwrite=False)
    w = SplitWriter(out, "test", ["en", "de"], shard_size=16, block_size=8)
    w.add_all(exs)
    write_manifest(out, Manifest(["en", "de"], {"test": w.close()}))
    (e,) = export_split(out, "test", tmp_path / "txt")
    assert e.n == 40 and e.line_breaks == 16
    src, tgt = lines(e.src_path), lines(e.tgt_path)
    assert len(src) == len(tgt) == 40
    assert src[5] == exs[5].src.replace(b"\r\n", b"  ") and tgt[5] == exs[5].tgt.replace(b"\n", b" ")
    assert src[1] == exs[1].src


def test_failed_export_leaves_previous_files(django_shards, tmp_path):
    shards = tmp_path / "s"
    shutil.copytree(django_shards, shards)
    (a,) = export_split(shards, "test", tmp_path / "txt", ["ja-en"])
    before = a.src_path.read_bytes(), a.tgt_path.read_bytes()
    sh = load_manifest(shards).splits["test"].shards[-1]
    raw = (shards / sh.name).read_bytes()
    (shards / sh.name).write_bytes(raw[: len(raw) // 3])  # truncated
    with pytest.raises(ScaletrainError, match="truncated"):
        export_split(shards, "test", tmp_path / "txt", ["ja-en"])
    assert (a.src_path.read_bytes(), a.tgt_path.read_bytes()) == before
    assert sorted(f.name for f in (tmp_path / "txt").iterdir()) == ["test.ja-en.en", "test.ja-en.ja"]
