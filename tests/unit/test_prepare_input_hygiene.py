"""Input hygiene of `prepare`: a UTF-8 BOM is stripped, NUL bytes drop the pair, and the
kept/dropped counts (malformed, NUL, over-long ...) are printed at the end, not only in the manifest."""
from __future__ import annotations

import argparse

from scaletrain.prepare.parallel_text import read_tsv_range, tsv_languages
from scaletrain.prepare import add_prepare_arguments, prepare_from_args
from scaletrain.data.shards import load_manifest, read_split

BOM = b"\xef\xbb\xbf"


def _args(*argv):
    p = argparse.ArgumentParser()
    add_prepare_arguments(p)
    return p.parse_args(["--no-progress", *argv])


def test_two_column_tsv_bom_nul_malformed_and_long_lines_are_counted_and_printed(tmp_path, capsys):
    good = [f"Guten Morgen {i}\tGood morning {i}".encode() for i in range(40)]
    lines = [BOM + good[0], *good[1:], b"no tab here", b"a\x00b\tx", b"y\tz\x00", b"long " * 300 + b"\tshort"]
    f = tmp_path / "train.tsv"
    f.write_bytes(b"\n".join(lines) + b"\n")
    assert next(read_tsv_range(f, 0, 1)) == (b"Guten Morgen 0", b"Good morning 0")
    out = tmp_path / "shards"
    assert prepare_from_args(_args("--source", "tsv", "--tsv-file", str(f), "--src-lang", "de", "--tgt-lang", "en",
                                   "--out", str(out), "--one-direction")) == 0
    printed = capsys.readouterr().out
    assert ("cleaning: 44 lines read, 40 kept; dropped: malformed 1, nul 2, too_long 1" in printed), printed
    total = load_manifest(out).cleaning["total"]
    assert total["nul"] == 2 and total["malformed"] == 1 and total["too_long"] == 1
    srcs = {e.src for e in read_split(out, "train")}
    assert b"Guten Morgen 0" in srcs and not any(s.startswith(BOM) or b"\0" in s for s in srcs)


def test_bom_before_a_language_column(tmp_path):
    f = tmp_path / "mixed.tsv"
    f.write_bytes(BOM + b"de\ten\tHallo\tHello\nru\ten\t\xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82\tHi\n")
    assert tsv_languages(f) == {"de", "en", "ru"}
