"""write_hypotheses: one src/ref/hyp file per direction, line-aligned, in split order; a line break inside a
sentence cannot shift the lines."""
from __future__ import annotations

from scaletrain.eval.evaluate import run_dir_of, write_hypotheses


def test_files_are_line_aligned_per_direction(tmp_path):
    records = [("de", "en", f"quelle {i}", f"ref {i}", f"hyp {i}") for i in range(3)]
    records += [("en", "de", "a\nb", "multi\r\nline ref", "h0"), ("de", "en", "quelle 3", "ref 3", "hyp 3"),
                ("en", "de", "c", "d", "h1")]
    files = write_hypotheses({"records": records}, tmp_path / "eval")
    assert sorted(f.name for f in files) == sorted(f"{k}.{d}.txt" for k in ("src", "ref", "hyp")
                                                   for d in ("de-en", "en-de"))

    def lines(name):
        return (tmp_path / "eval" / name).read_text(encoding="utf-8").split("\n")[:-1]

    assert lines("hyp.de-en.txt") == [f"hyp {i}" for i in range(4)]
    assert lines("ref.de-en.txt") == [f"ref {i}" for i in range(4)]
    assert lines("src.de-en.txt") == [f"quelle {i}" for i in range(4)]
    assert lines("src.en-de.txt") == ["a b", "c"] and lines("ref.en-de.txt") == ["multi line ref", "d"]
    assert lines("hyp.en-de.txt") == ["h0", "h1"]


def test_run_dir_of_checkpoint(tmp_path):
    assert run_dir_of(tmp_path / "run" / "checkpoints" / "step-4") == tmp_path / "run"
    assert run_dir_of(tmp_path / "run" / "averaged") == tmp_path / "run"
