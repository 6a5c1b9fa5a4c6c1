"""Line-aligned corpora: line index, filters, TSV, OPUS-100 layout, parallel and resumable prepare."""
from __future__ import annotations

import logging
from collections import Counter

import pytest

from scaletrain.prepare import build as prep
from scaletrain.prepare import parallel_text as text
from scaletrain.prepare.opus import opus100_corpora
from scaletrain.prepare import prepare_opus100, prepare_parallel
from scaletrain.data.shards import load_manifest, read_split
from scaletrain.prepare.parallel_text import PairFilter, ParallelCorpus, index_lines, read_lines
from scaletrain.errors import ScaletrainError


@pytest.mark.parametrize("content", [b"", b"a", b"a\n", b"a\nbb", b"a\n\nccc\n", b"\n\n\n", b"x\ny\nz\nw\nv\n"])
@pytest.mark.parametrize("every", [1, 2, 3])
def test_index_lines_matches_python_lines(tmp_path, monkeypatch, content, every):
    monkeypatch.setattr(text, "_CHUNK", 3)  # force newlines across chunk borders
    p = tmp_path / "f.txt"
    p.write_bytes(content)
    lines = content.splitlines()
    ix = index_lines(p, every)
    assert ix.n_lines == len(lines)
    got = [line for off in ix.offsets for line in read_lines(p, off, every)]
    assert got == lines


def test_pair_filter_rules():
    f = PairFilter(max_bytes=10, max_ratio=3.0)
    assert f((b"  hi ", b"hallo\r")) == (None, b"hi", b"hallo")
    assert f(None)[0] == "malformed"
    assert f((b"\xff\xfe", b"ok"))[0] == "invalid_utf8"
    assert f((b" ", b"ok"))[0] == "empty"
    assert f((b"x" * 11, b"ok ok"))[0] == "too_long"
    assert f((b"x" * 10, b"ab"))[0] == "ratio"
    assert PairFilter(max_bytes=10)((b"x" * 10, b"ab"))[0] is None  # no ratio filter by default
    assert PairFilter().max_bytes == 800
    with pytest.raises(ScaletrainError, match="max_ratio"):
        PairFilter(max_ratio=0.5)


def write_lines(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(l + b"\n" for l in lines))


def test_moses_pair_line_mismatch_names_both_files(tmp_path):
    write_lines(tmp_path / "c.de", [b"a", b"b", b"c"])
    write_lines(tmp_path / "c.en", [b"a", b"b"])
    c = ParallelCorpus("train", "de", "en", str(tmp_path / "c.de"), str(tmp_path / "c.en"))
    with pytest.raises(ScaletrainError, match=r"c\.de has 3 lines.*c\.en has 2"):
        prepare_parallel([c], tmp_path / "out", progress=False)


def test_tsv_and_moses_prepare_counts_filters(tmp_path):
    src = [b"Hallo Welt", b"\xff broken", b"", b"Guten Tag", b"x" * 900, b"Ja"]
    tgt = [b"Hello world", b"broken", b"empty src", b"Good day", b"long", b"Yes"]
    write_lines(tmp_path / "t.de", src)
    write_lines(tmp_path / "t.en", tgt)
    (tmp_path / "v.tsv").write_bytes(b"Eins\tOne\nno tab here\nZwei\tTwo\n")
    corpora = [ParallelCorpus("train", "de", "en", str(tmp_path / "t.de"), str(tmp_path / "t.en")),
               ParallelCorpus("valid", "de", "en", tsv_path=str(tmp_path / "v.tsv"))]
    m = prepare_parallel(corpora, tmp_path / "out", shard_lines=2, block_size=2, progress=False)
    assert m.languages == ["en", "de"]
    tot = m.cleaning["total"]
    assert (tot["lines"], tot["kept"], tot["invalid_utf8"], tot["empty"], tot["too_long"], tot["malformed"]) == (9, 5, 1, 1, 1, 1)
    assert m.cleaning["per_corpus"]["valid:de-en"]["kept"] == 2
    train = read_split(tmp_path / "out", "train")
    assert [(e.src, e.tgt) for e in train] == [(b"Hallo Welt", b"Hello world"), (b"Hello world", b"Hallo Welt"),
                                               (b"Guten Tag", b"Good day"), (b"Good day", b"Guten Tag"),
                                               (b"Ja", b"Yes"), (b"Yes", b"Ja")]
    assert [(e.src_lang, e.tgt_lang) for e in train[:2]] == [(1, 0), (0, 1)]
    # 6 lines / 2 per shard = 3 ranges; every range kept something -> train-000000..2
    assert [s.name for s in m.splits["train"].shards] == ["train-000000.tar", "train-000001.tar", "train-000002.tar"]
    assert m.splits["train"].directions["de-en"].n == 3
    assert [e.src for e in read_split(tmp_path / "out", "valid")] == [b"Eins", b"One", b"Zwei", b"Two"]


def make_opus(root, n_train=300):
    sup = root / "opus-100-corpus" / "v1.0" / "supervised"
    for pair, xx, splits in [("de-en", "de", ("train", "dev", "test")), ("en-ja", "ja", ("train", "dev", "test")),
                             ("en-xh", "xh", ("train",))]:
        for sp in splits:
            n = n_train if sp == "train" else 20
            write_lines(sup / pair / f"opus.{pair}-{sp}.en", [f"en {sp} {i} {xx}".encode() for i in range(n)])
            write_lines(sup / pair / f"opus.{pair}-{sp}.{xx}", [f"{xx} {sp} {i} ÄÖ".encode() for i in range(n)])
    return sup


def test_opus100_layout_and_train_only_notice(tmp_path, caplog):
    sup = make_opus(tmp_path)
    for root in (tmp_path / "opus-100-corpus", sup.parent, sup):
        corpora, source = opus100_corpora(root)
        assert source["root"] == str(sup)
    with caplog.at_level(logging.WARNING):
        m = prepare_opus100(tmp_path / "opus-100-corpus", tmp_path / "out", shard_lines=100, progress=False)
    assert "xh" in caplog.text and "left out of evaluation" in caplog.text
    assert m.languages == ["en", "de", "ja", "xh"] and m.source["no_eval"] == ["xh"]
    assert list(m.splits) == ["train", "valid", "test"]
    assert m.splits["train"].n_examples == 3 * 300 * 2
    assert set(m.splits["valid"].directions) == {"de-en", "en-de", "en-ja", "ja-en"}
    assert len(m.splits["train"].shards) == 9
    valid = read_split(tmp_path / "out", "valid")
    assert (valid[0].src, valid[0].tgt) == ("de dev 0 ÄÖ".encode(), b"en dev 0 de")  # dev -> valid
    with pytest.raises(ScaletrainError, match="no data for zz; available: de, ja, xh"):
        opus100_corpora(tmp_path, ["de", "zz"])
    with pytest.raises(ScaletrainError, match="does not look like OPUS-100"):
        opus100_corpora(tmp_path / "out")


def test_parallel_workers_give_identical_shards(tmp_path):
    make_opus(tmp_path)
    root = tmp_path / "opus-100-corpus"
    a = prepare_opus100(root, tmp_path / "a", shard_lines=100, workers=1, progress=False)
    b = prepare_opus100(root, tmp_path / "b", shard_lines=100, workers=2, progress=False)
    assert a.splits == b.splits and a.cleaning == b.cleaning
    assert not (tmp_path / "a" / ".prepare").exists()


def test_interrupted_prepare_resumes_skipping_complete_shards(tmp_path, monkeypatch):
    make_opus(tmp_path)
    root = tmp_path / "opus-100-corpus"
    clean = prepare_opus100(root, tmp_path / "clean", shard_lines=100, progress=False)
    n_tasks = sum(len(s.shards) for s in clean.splits.values())
    real = prep._run_task
    calls = Counter()

    def crashing(task):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("killed")
        return real(task)

    monkeypatch.setattr(prep, "_run_task", crashing)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="killed"):
        prepare_opus100(root, out, shard_lines=100, progress=False)
    assert not (out / "manifest.json").exists()
    with pytest.raises(ScaletrainError, match="interrupted prepare.*resume"):
        prepare_opus100(root, out, shard_lines=100, progress=False)
    with pytest.raises(ScaletrainError, match="other inputs or settings"):
        prepare_opus100(root, out, shard_lines=50, progress=False, resume=True)
    # corrupt one completed shard: it must be redone, the two intact ones skipped
    first = sorted(out.glob("test-*.tar"))[0]
    first.write_bytes(first.read_bytes()[:-10] + b"0123456789")
    calls.clear()
    monkeypatch.setattr(prep, "_run_task", lambda t: (calls.update(n=1), real(t))[1])
    m = prepare_opus100(root, out, shard_lines=100, progress=False, resume=True)
    assert calls["n"] == n_tasks - 2
    assert m.splits == clean.splits and load_manifest(out) == load_manifest(tmp_path / "clean")
    assert not (out / ".prepare").exists()
    # resume of a complete directory is a no-op
    calls.clear()
    assert prepare_opus100(root, out, shard_lines=100, progress=False, resume=True).splits == clean.splits
    assert calls["n"] == 0
