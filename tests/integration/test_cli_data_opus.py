"""OPUS-100 layout end to end (prepare -> data stats -> data verify -> 2-rank training) and the
`prepare` argument handling for the moses / tsv sources.

The OPUS-100 directory is built from real text (django's gettext catalogs) placed in the release
layout, with one language in ``xx-en`` orientation, one in ``en-xx`` and one with a train set only.
"""
from __future__ import annotations

import argparse
import json
import shutil

import pytest

from helpers import DIST_DRIVER, cli, deepspeed_cmd, launcher_env, run, tiny_model
from scaletrain.prepare.gettext import read_gettext, split_of
from scaletrain.prepare import add_prepare_arguments, prepare_from_args
from scaletrain.data.shards import load_manifest, read_split
from scaletrain.errors import ScaletrainError

OPUS_LANGS = {"de": "de-en", "ru": "en-ru", "ja": "ja-en", "hi": "en-hi"}  # hi: train only
TRAIN_ONLY = "hi"


def prepare_args(*argv):
    p = argparse.ArgumentParser()
    add_prepare_arguments(p)
    return prepare_from_args(p.parse_args(["--no-progress", *argv]))


@pytest.fixture(scope="module")
def opus_root(tmp_path_factory):
    """A real-text OPUS-100 release tree; returns (root, {lang: {split: n_lines}})."""
    root = tmp_path_factory.mktemp("opus")
    sup = root / "opus-100-corpus" / "v1.0" / "supervised"
    corpus = read_gettext("django", list(OPUS_LANGS))
    counts = {}
    for lang, pair in OPUS_LANGS.items():
        by = {"train": [], "dev": [], "test": []}
        for en, xx in corpus.pairs[lang]:
            s = split_of(en, 0.08, 0.08, seed=0)
            by["dev" if s == "valid" else s].append((en, xx))
        if lang == TRAIN_ONLY:
            by = {"train": by["train"] + by["dev"] + by["test"]}
        d = sup / pair
        d.mkdir(parents=True)
        for tag, pairs in by.items():
            for code, side in (("en", 0), (lang, 1)):
                (d / f"opus.{pair}-{tag}.{code}").write_text("".join(p[side] + "\n" for p in pairs), encoding="utf-8")
        counts[lang] = {t: len(v) for t, v in by.items()}
    # one deliberately bad line pair in the German train files: too long, counted by the filter
    de = sup / "de-en"
    with open(de / "opus.de-en-train.de", "a", encoding="utf-8") as f:
        f.write("x" * 900 + "\n")
    with open(de / "opus.de-en-train.en", "a", encoding="utf-8") as f:
        f.write("y\n")
    counts["de"]["train"] += 1
    return root, counts


@pytest.fixture(scope="module")
def opus_shards(opus_root, tmp_path_factory):
    root, _ = opus_root
    out = tmp_path_factory.mktemp("opus_shards") / "opus100"
    assert prepare_args("--source", "opus100", "--opus-root", str(root), "--out", str(out), "--workers", "2",
                        "--shard-lines", "150", "--block-size", "128") == 0
    return out


def test_opus100_prepare_manifest(opus_root, opus_shards):
    _, counts = opus_root
    m = load_manifest(opus_shards)
    assert m.languages == ["en", "de", "hi", "ja", "ru"]
    assert m.source["type"] == "opus-100" and m.source["no_eval"] == [TRAIN_ONLY]
    tot = m.cleaning["total"]
    n_lines = sum(sum(c.values()) for c in counts.values())
    assert tot["lines"] == n_lines and tot["too_long"] == 1 and tot["kept"] == n_lines - 1
    tr = m.splits["train"]
    # both directions of every pair; the train-only language is in train and nowhere else
    assert tr.directions["hi-en"].n == tr.directions["en-hi"].n == counts["hi"]["train"]
    assert tr.directions["de-en"].n == counts["de"]["train"] - 1
    assert tr.n_examples == 2 * (sum(c["train"] for c in counts.values()) - 1)
    assert all("hi" not in d for s in ("valid", "test") for d in m.splits[s].directions)
    assert m.splits["valid"].directions["ru-en"].n == counts["ru"]["dev"]
    # German train: ceil(lines / 150) shards of its own, numbered in corpus order
    assert len(tr.shards) >= 4 and [s.name for s in tr.shards] == sorted(s.name for s in tr.shards)
    ex = read_split(opus_shards, "test")
    assert len(ex) == 2 * sum(counts[l]["test"] for l in counts if l != TRAIN_ONLY)


def test_data_stats_cli(opus_root, opus_shards):
    _, counts = opus_root
    p = cli("data", "stats", str(opus_shards))
    assert p.returncode == 0, p.stderr
    assert "languages: en, de, hi, ja, ru" in p.stdout
    assert "too_long 1" in p.stdout and f"train only (left out of evaluation): {TRAIN_ONLY}" in p.stdout
    line = next(l for l in p.stdout.splitlines() if l.strip().startswith("ja-en"))
    assert int(line.split()[1].replace(",", "")) == counts["ja"]["train"]
    pj = cli("data", "stats", str(opus_shards), "--json", "--splits", "valid")
    st = json.loads(pj.stdout)
    assert list(st["splits"]) == ["valid"] and st["splits"]["valid"]["directions"]["en-de"]["pairs"] == counts["de"]["dev"]
    pct = st["splits"]["valid"]["directions"]["en-de"]["src_len_pct"]
    assert 0 < pct["p50"] <= pct["p90"] <= pct["p99"] <= pct["p100"]


def test_data_verify_cli_names_bad_shards(opus_shards, tmp_path):
    p = cli("data", "verify", str(opus_shards))
    assert p.returncode == 0 and "OK" in p.stdout and "PROBLEM" not in p.stdout, p.stdout + p.stderr
    bad = tmp_path / "bad"
    shutil.copytree(opus_shards, bad)
    m = load_manifest(bad)
    t1, t2 = m.splits["train"].shards[1].name, m.splits["valid"].shards[0].name
    raw = (bad / t1).read_bytes()
    (bad / t1).write_bytes(raw[: len(raw) // 2])  # truncated
    raw = bytearray((bad / t2).read_bytes())
    raw[700] ^= 0xFF  # one flipped byte inside the first block's data: same size, other checksum
    (bad / t2).write_bytes(bytes(raw))
    p = cli("data", "verify", str(bad))
    assert p.returncode == 1, p.stdout
    problems = [l for l in p.stdout.splitlines() if l.startswith("PROBLEM")]
    assert any(t1 in l and "truncated" in l for l in problems), problems
    assert any(t2 in l and "sha256" in l for l in problems), problems
    assert all(t1 in l or t2 in l for l in problems), problems
    assert "FAILED" in p.stdout
    # --no-checksums still finds the truncation (size and decoding)
    p = cli("data", "verify", str(bad), "--no-checksums")
    assert p.returncode == 1 and t1 in p.stdout


@pytest.mark.slow
def test_opus100_two_rank_training(opus_shards, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    tiny = [*tiny_model(max_positions=128), "data.max_bytes=60",
            "data.max_tokens=1200", "optim.warmup_steps=5", "train.log_every=5", "train.valid_every=10",
            "train.valid_max_batches=2", "train.save_every=0", "train.max_minutes=0", "train.max_steps=10"]
    args = [str(out), "small", f"data.shards={opus_shards}", f"train.out_dir={out}", *tiny]
    p = run(deepspeed_cmd(2, DIST_DRIVER, *args), launcher_env(tmp_path))
    res = [json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in res] == [2, 2], p.stdout[-2000:]
    assert res[0]["steps"] == res[1]["steps"] == 10
    assert res[0]["tokens"] == res[1]["tokens"] > 0
    assert len(res[0]["valid_nll"]) >= 1


# ---------------------------------------------------------------------------------------------
# moses / tsv sources through the prepare arguments
# ---------------------------------------------------------------------------------------------
def _write(path, lines):
    path.write_bytes(b"".join(l + b"\n" for l in lines))


def test_prepare_moses_prefix_and_files_and_tsv(tmp_path):
    _write(tmp_path / "train.de", [b"Hallo", b"Guten Tag", b"\xffkaputt", b"Ja"])
    _write(tmp_path / "train.en", [b"Hello", b"Good day", b"broken", b"Yes"])
    _write(tmp_path / "dev.de", [b"Eins"])
    _write(tmp_path / "dev.en", [b"One"])
    assert prepare_args("--source", "moses", "--prefix", str(tmp_path / "train"), "--valid-prefix",
                        str(tmp_path / "dev"), "--src-lang", "de", "--tgt-lang", "en", "--out", str(tmp_path / "m1"),
                        "--one-direction") == 0
    m = load_manifest(tmp_path / "m1")
    assert m.languages == ["en", "de"] and m.cleaning["total"]["invalid_utf8"] == 1
    assert [(e.src, e.tgt) for e in read_split(tmp_path / "m1", "train")] == \
        [(b"Hallo", b"Hello"), (b"Guten Tag", b"Good day"), (b"Ja", b"Yes")]
    assert [(e.src, e.tgt) for e in read_split(tmp_path / "m1", "valid")] == [(b"Eins", b"One")]
    # explicit files, invalid UTF-8 kept as bytes and counted
    assert prepare_args("--source", "moses", "--src-file", str(tmp_path / "train.de"), "--tgt-file",
                        str(tmp_path / "train.en"), "--src-lang", "de", "--tgt-lang", "en", "--out",
                        str(tmp_path / "m2"), "--keep-invalid-utf8", "--max-bytes", "8") == 0
    m = load_manifest(tmp_path / "m2")
    tot = m.cleaning["total"]
    assert (tot["kept"], tot["invalid_utf8_kept"], tot["too_long"], tot["invalid_utf8"]) == (3, 1, 1, 0)
    assert (b"\xffkaputt", b"broken") in [(e.src, e.tgt) for e in read_split(tmp_path / "m2", "train")]
    # tsv with a ratio filter
    (tmp_path / "t.tsv").write_bytes(b"a\tbbbbbbbbbb\nabc\txyz\n")
    assert prepare_args("--source", "tsv", "--tsv-file", str(tmp_path / "t.tsv"), "--src-lang", "fr",
                        "--tgt-lang", "en", "--max-ratio", "3", "--out", str(tmp_path / "t")) == 0
    m = load_manifest(tmp_path / "t")
    assert m.cleaning["total"]["ratio"] == 1 and m.splits["train"].directions == {
        "en-fr": m.splits["train"].directions["en-fr"], "fr-en": m.splits["train"].directions["fr-en"]}
    assert m.splits["train"].directions["fr-en"].n == 1


@pytest.mark.parametrize("argv, msg", [
    (["--source", "moses", "--out", "o"], "needs --src-lang and --tgt-lang"),
    (["--source", "moses", "--src-lang", "de", "--tgt-lang", "en", "--out", "o"], "needs --prefix"),
    (["--source", "tsv", "--src-lang", "de", "--tgt-lang", "en", "--out", "o"], "needs --tsv-file"),
    (["--source", "tsv", "--src-lang", "de", "--tgt-lang", "en"], "needs --out"),
    (["--source", "opus100", "--out", "o"], "needs --opus-root"),
    (["--source", "moses", "--src-lang", "de", "--tgt-lang", "en", "--prefix", "p", "--tsv-file", "x", "--out", "o"],
     "belong to --source tsv"),
    (["--source", "gettext", "--resume"], "--resume, --workers"),
])
def test_prepare_argument_errors(argv, msg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ScaletrainError, match=msg):
        prepare_args(*argv)


def test_prepare_resume_via_args(tmp_path):
    _write(tmp_path / "c.de", [b"a%d" % i for i in range(10)])
    _write(tmp_path / "c.en", [b"b%d" % i for i in range(10)])
    base = ["--source", "moses", "--prefix", str(tmp_path / "c"), "--src-lang", "de", "--tgt-lang", "en",
            "--out", str(tmp_path / "o"), "--shard-lines", "3"]
    assert prepare_args(*base) == 0
    first = {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir()}
    assert len([n for n in first if n.startswith("train-")]) == 4
    with pytest.raises(ScaletrainError, match="not empty"):
        prepare_args(*base)
    assert prepare_args(*base, "--resume") == 0  # a complete directory: nothing to redo
    assert {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir()} == first
