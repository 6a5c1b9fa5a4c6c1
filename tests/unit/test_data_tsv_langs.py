"""4-column TSV (src_lang<TAB>tgt_lang<TAB>src<TAB>tgt): real django text through prepare -> data stats -> stream."""
from __future__ import annotations

import argparse
from collections import Counter

import pytest

from scaletrain.data.inspect_shards import data_stats, format_stats
from scaletrain.prepare import add_prepare_arguments, prepare_from_args, prepare_parallel
from scaletrain.data.shards import load_manifest, read_split
from scaletrain.data.stream import ShardStream
from scaletrain.prepare.parallel_text import ParallelCorpus, lang_code, tsv_languages
from scaletrain.errors import ScaletrainError


def parse(*argv):
    p = argparse.ArgumentParser()
    add_prepare_arguments(p)
    return p.parse_args(["--no-progress", *argv])


@pytest.fixture(scope="module")
def mixed_tsv(django_shards, tmp_path_factory):
    """~300 real pairs of several directions in one file, plus 4 bad lines (known positions)."""
    m = load_manifest(django_shards)
    exs = read_split(django_shards, "train")[:300]
    lines = [b"\t".join((m.languages[e.src_lang].encode(), m.languages[e.tgt_lang].encode(), e.src, e.tgt))
             for e in exs]
    lines.insert(10, b"de\ten\tonly three columns")  # malformed: 3 columns
    lines.insert(20, b"fr\tfr\tBonjour\tBonjour")  # malformed: same language both sides
    lines.insert(30, b"en\txx\tHello\tHallo")  # well-formed code; unknown only when --langs excludes it
    lines.insert(40, b"\t".join((b"en", b"de", b"Stray\ttab", b"x")))  # 5 columns: malformed
    d = tmp_path_factory.mktemp("tsvlangs")
    f = d / "mixed.tsv"
    f.write_bytes(b"\n".join(lines) + b"\n")
    # what a correct prepare keeps, per direction (both directions of each kept line)
    want = Counter()
    for e in exs:
        a, b = m.languages[e.src_lang], m.languages[e.tgt_lang]
        want[f"{a}-{b}"] += 1
        want[f"{b}-{a}"] += 1
    return d, f, exs, m.languages, want


def test_lang_code_rule():
    assert [lang_code(c, "f", 1) for c in (b"en", b" pt_BR ", b"sr-Latn", b"zh-Hans", b"ast")] == \
        ["en", "pt_BR", "sr-Latn", "zh-Hans", "ast"]
    for bad in (b"", b"Hello world", b"12", b"e", b"english"):
        with pytest.raises(ScaletrainError, match=r"f:7: language column"):
            lang_code(bad, "f", 7)


def test_prepare_stats_stream_from_mixed_tsv(mixed_tsv, tmp_path):
    d, f, exs, langs, want = mixed_tsv
    assert tsv_languages(f) == set(langs) | {"xx"}
    out = tmp_path / "out"
    # two workers over 100-line ranges: per-line languages, parallel like the 2-column TSV path
    assert prepare_from_args(parse("--source", "tsv", "--tsv-file", str(f), "--tsv-lang-columns", "--out", str(out),
                                   "--shard-lines", "100", "--block-size", "64", "--workers", "2")) == 0
    m = load_manifest(out)
    assert m.languages == ["en", *sorted(set(langs) - {"en"} | {"xx"})]  # pivot first, then sorted
    assert m.source["lang_columns"] is True
    tot = m.cleaning["total"]
    assert (tot["lines"], tot["malformed"], tot["unknown_lang"]) == (304, 3, 0)
    assert tot["kept"] == 301  # 300 real pairs + the en-xx line (xx is a language of this corpus)
    want = want + Counter({"en-xx": 1, "xx-en": 1})
    dirs = m.splits["train"].directions
    assert {k: v.n for k, v in dirs.items()} == dict(want)
    assert len(m.splits["train"].shards) == 4  # 304 lines / 100 per shard
    st = data_stats(out)
    assert {k: v["pairs"] for k, v in st["splits"]["train"]["directions"].items()} == dict(want)
    assert "unknown_lang 0" in format_stats(st)
    # the stream yields every example once per epoch, with the right language tags
    stream = ShardStream(out, "train", max_tokens=4096, max_bytes=256, buffer_size=2, epochs=1)
    got = Counter()
    for b in stream:
        for i in range(b.size):
            got[f"{m.languages[int(b.src_lang[i])]}-{m.languages[int(b.tgt_lang[i])]}"] += 1
    assert got == want
    texts = {(e.src, e.tgt) for e in read_split(out, "train")}
    assert all((e.src, e.tgt) in texts and (e.tgt, e.src) in texts for e in exs)


def test_langs_restricts_and_counts_unknown(mixed_tsv, tmp_path):
    d, f, exs, langs, want = mixed_tsv
    out = tmp_path / "out"
    prepare_from_args(parse("--source", "tsv", "--tsv-file", str(f), "--tsv-lang-columns", "--out", str(out),
                            "--langs", ",".join(langs)))
    m = load_manifest(out)
    assert m.languages == ["en", *sorted(set(langs) - {"en"})]
    tot = m.cleaning["total"]
    assert (tot["lines"], tot["kept"], tot["malformed"], tot["unknown_lang"]) == (304, 300, 3, 1)
    assert {k: v.n for k, v in m.splits["train"].directions.items()} == dict(want)


def test_not_a_code_names_file_and_line(tmp_path):
    f = tmp_path / "two_col.tsv"
    f.write_bytes(b"de\ten\tHallo\tHello\nHallo Welt\tHello world\tx\ty\n")
    with pytest.raises(ScaletrainError, match=r"two_col\.tsv:2: language column holds 'Hallo Welt'"):
        prepare_parallel([ParallelCorpus("train", "", "", tsv_path=str(f), lang_columns=True)], tmp_path / "o",
                         progress=False)
    # with --langs there is no scan: the worker reading the range names the same file:line
    with pytest.raises(ScaletrainError, match=r"two_col\.tsv:2: language column"):
        prepare_parallel([ParallelCorpus("train", "", "", tsv_path=str(f), lang_columns=True)], tmp_path / "o2",
                         languages=["en", "de"], progress=False)


def test_cli_argument_errors(tmp_path):
    f = tmp_path / "a.tsv"
    f.write_bytes(b"de\ten\tHallo\tHello\n")
    with pytest.raises(ScaletrainError, match="do not apply with --tsv-lang-columns"):
        prepare_from_args(parse("--source", "tsv", "--tsv-file", str(f), "--tsv-lang-columns", "--src-lang", "de",
                                "--tgt-lang", "en", "--out", str(tmp_path / "o")))
    with pytest.raises(ScaletrainError, match="belongs to --source tsv"):
        prepare_from_args(parse("--source", "moses", "--prefix", "x", "--tsv-lang-columns", "--out", str(tmp_path)))
    with pytest.raises(ScaletrainError, match="--langs is for"):
        prepare_from_args(parse("--source", "tsv", "--tsv-file", str(f), "--src-lang", "de", "--tgt-lang", "en",
                                "--langs", "de,en", "--out", str(tmp_path / "o")))
