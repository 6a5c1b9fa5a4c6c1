"""`scaletrain translate` and `scaletrain evaluate` as a user runs them, on a tiny checkpoint trained via the CLI.

The checkpoint is trained for a few seconds only: the point is the I/O contract (one line out per line in,
streaming, errors, every test line scored, groups shown), checked against the library's own decoding.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys

import pytest

from helpers import ROOT, launcher_env, run, tiny_model
from scaletrain.data.batch import Example
from scaletrain.data.shards import Manifest, SplitWriter, load_manifest, read_split, write_manifest

TINY = [
    *tiny_model(), "data.max_bytes=60", "data.max_tokens=2000",
    "train.max_steps=30", "train.max_minutes=0", "train.log_every=10", "train.valid_every=0", "train.save_every=0",
    "tracking.enabled=false", "engine.threads=1", "optim.warmup_steps=10", "optim.lr=3e-3",
    "eval.max_len_b=20", "eval.max_len_a=1.0",
]


@pytest.fixture(scope="session")
def tiny_run(django_shards, tmp_path_factory):
    """A run directory with one checkpoint of a tiny model trained 30 steps with the `small` recipe."""
    tmp = tmp_path_factory.mktemp("tiny_run")
    out = tmp / "run"
    env = launcher_env(tmp)
    env["OMP_NUM_THREADS"] = "1"
    run([sys.executable, "-m", "scaletrain", "train", "--config", "small", f"data.shards={django_shards}",
         f"train.out_dir={out}", *TINY], env)
    return out


def _env(tmp_path):
    env = launcher_env(tmp_path)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _translate(run_dir, tmp_path, data: bytes, *args):
    cmd = [sys.executable, "-m", "scaletrain", "translate", "--checkpoint", str(run_dir), *args]
    return subprocess.run(cmd, input=data, env=_env(tmp_path), cwd=ROOT, capture_output=True, timeout=120)


def _library(run_dir, lines: list[bytes], src: str, tgt: str, beam: int, lenpen: float) -> list[str]:
    from scaletrain.checkpoint import load_for_inference
    from scaletrain.eval.translate import translate_lines

    model, cfg, vocab, _, _ = load_for_inference(run_dir)
    texts, _ = translate_lines(model, vocab, lines, src, tgt, beam=beam, lenpen=lenpen,
                               max_len_a=cfg.eval.max_len_a, max_len_b=cfg.eval.max_len_b,
                               batch_tokens=cfg.eval.batch_tokens)
    return texts


def test_translate_one_line_out_per_line_in_matches_library(tiny_run, tmp_path, django_shards):
    m = load_manifest(django_shards)
    en_de = [ex for ex in read_split(django_shards, "test") if (m.languages[ex.src_lang], m.languages[ex.tgt_lang]) == ("en", "de")]
    lines = [ex.src for ex in en_de[:7]]
    # empty and whitespace-only lines, a CRLF line, a line far beyond max_positions (64), a last line without \n
    lines[2:2] = [b"", b"   "]
    lines.append(("Ein sehr langer Satz. " * 20).encode())
    data = b"\n".join(lines[:-1]) + b"\n" + lines[-1]
    data = data.replace(lines[0] + b"\n", lines[0] + b"\r\n", 1)
    p = _translate(tiny_run, tmp_path, data, "--src-lang", "en", "--tgt-lang", "de", "--beam", "2",
                   "--lenpen", "1.0", "--batch-lines", "4")
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    out = p.stdout.decode("utf-8").split("\n")
    assert out[-1] == "" and len(out) - 1 == len(lines)  # one line per input line, each terminated
    out = out[:-1]
    assert out[2] == "" and out[3] == ""  # empty in -> empty out
    expected = _library(tiny_run, lines, "en", "de", beam=2, lenpen=1.0)
    assert out == expected
    assert all(o for i, o in enumerate(out) if i not in (2, 3))  # the untrained-ish model says something
    err = p.stderr.decode()
    assert f"translated {len(lines)} lines en->de in 3 batches" in err  # 10 lines, 4 per batch
    # nothing but translations on stdout (library logs go to stderr)
    assert "WARNING" not in p.stdout.decode("utf-8", "replace") and "step" not in p.stdout.decode("utf-8", "replace")


def test_translate_bad_language_and_arguments_are_clear_errors(tiny_run, tmp_path, capsys):
    p = _translate(tiny_run, tmp_path, b"hello\n", "--src-lang", "en", "--tgt-lang", "xx")
    assert p.returncode == 2 and p.stdout == b""
    err = p.stderr.decode()
    assert "--tgt-lang 'xx' is not a language of checkpoint" in err and "en, de, ru, ar, hi, ja" in err
    assert "Traceback" not in err
    # the same checks in-process (cheaper than a process each)
    from scaletrain.cli import main

    for args, msg in [
        (["--checkpoint", str(tiny_run), "--src-lang", "EN", "--tgt-lang", "de"], "--src-lang 'EN' is not a language"),
        (["--checkpoint", str(tiny_run), "--src-lang", "en", "--tgt-lang", "de", "--beam", "0"], "--beam must be >= 1"),
        (["--checkpoint", str(tmp_path / "nope"), "--src-lang", "en", "--tgt-lang", "de"], "is not a checkpoint"),
    ]:
        capsys.readouterr()
        assert main(["translate", *args]) == 2
        assert msg in capsys.readouterr().err


def _readline(f, timeout=60.0) -> bytes:
    r, _, _ = select.select([f], [], [], timeout)
    assert r, "no output line within the timeout: translations are not streamed"
    return f.readline()


def test_translate_streams_each_batch_before_input_ends(tiny_run, tmp_path):
    # interactive use: a line is answered while stdin stays open (batch started because no more input is ready)
    cmd = [sys.executable, "-m", "scaletrain", "translate", "--checkpoint", str(tiny_run), "--src-lang", "de",
           "--tgt-lang", "en", "--batch-lines", "64", "--quiet"]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=_env(tmp_path), cwd=ROOT)
    try:
        got = []
        for line in (b"Speichern", b"", "Löschen".encode()):
            p.stdin.write(line + b"\n")
            p.stdin.flush()
            got.append(_readline(p.stdout))
        p.stdin.close()
        assert p.wait(timeout=60) == 0, p.stderr.read().decode()[-2000:]
        assert p.stdout.read() == b""
    finally:
        if p.poll() is None:
            p.kill()
    assert got[1] == b"\n" and got[0].endswith(b"\n") and len(got[0]) > 1
    expected = _library(tiny_run, [b"Speichern", b"", "Löschen".encode()], "de", "en", beam=1, lenpen=1.0)
    assert [g.decode()[:-1] for g in got] == expected


def test_iter_line_batches_splits_lines_and_batches():
    from scaletrain.eval.translate import iter_line_batches

    r, w = os.pipe()
    os.write(w, b"a\r\nbb\n\nccc\nd")
    os.close(w)
    batches = list(iter_line_batches(r, 3, chunk=2))  # chunks cut lines in the middle
    os.close(r)
    assert [ln for b in batches for ln in b] == [b"a", b"bb", b"", b"ccc", b"d"]
    assert all(1 <= len(b) <= 3 for b in batches)


# ----------------------------------------------------------------------------------------------
# evaluate


def _shards_with_long_line(src_dir, out, long_bytes: int):
    """The first 3 test lines of every direction, plus one en->de line far longer than max_positions."""
    m = load_manifest(src_dir)
    seen, chosen = {}, []
    for ex in read_split(src_dir, "test"):
        k = (ex.src_lang, ex.tgt_lang)
        if seen.get(k, 0) < 3:
            seen[k] = seen.get(k, 0) + 1
            chosen.append(ex)
    de = m.languages.index("de")
    chosen.append(Example(0, de, b"Please save this object. " * (long_bytes // 25), "Bitte speichern.".encode()))
    out.mkdir()
    splits = {}
    for s in ("train", "valid", "test"):
        w = SplitWriter(out, s, m.languages, shard_size=64, block_size=16)
        w.add_all(chosen)
        splits[s] = w.close()
    write_manifest(out, Manifest(m.languages, splits))
    return chosen, seen


def test_evaluate_prints_directions_groups_and_scores_every_line(tiny_run, tmp_path, django_shards):
    data = tmp_path / "evalset"
    chosen, seen = _shards_with_long_line(django_shards, data, long_bytes=400)  # max_positions is 64
    assert len(seen) == 10  # en<->{de,ru,ar,hi,ja}
    js = tmp_path / "eval.json"
    p = run([sys.executable, "-m", "scaletrain", "evaluate", "--checkpoint", str(tiny_run), "--shards", str(data),
             "--split", "test", "--beam", "2", "--json", str(js), "--no-track"], _env(tmp_path))
    res = json.loads(js.read_text())
    assert res["lines"] == len(chosen) == 31  # nothing skipped, the over-long line included
    dirs = {d["direction"]: d for d in res["model"]["directions"]}
    assert sum(d["n_lines"] for d in dirs.values()) == 31 and dirs["en-de"]["n_lines"] == 4
    assert dirs["en-ja"]["tokenize"] == "char" and dirs["ja-en"]["tokenize"] == "13a"
    avgs = {a["name"]: a for a in res["model"]["averages"]}
    # the small recipe's script groups (stored in the checkpoint's config) and the pivot averages
    assert avgs["xx->en"]["n_directions"] == 5 and avgs["en->xx"]["n_directions"] == 5
    assert avgs["latin"]["n_directions"] == 2  # de-en, en-de (fr, es are not in these shards)
    assert avgs["utf8-2byte"]["n_directions"] == 4 and avgs["utf8-3byte"]["n_directions"] == 4
    assert avgs["non-latin en->xx"]["n_directions"] == 4 and avgs["non-latin xx->en"]["n_lines"] == 12
    expect_mean = sum(dirs[d]["chrf"] for d in ("en-hi", "en-ja", "hi-en", "ja-en")) / 4
    assert avgs["utf8-3byte"]["chrf"] == pytest.approx(expect_mean)
    table = p.stdout
    for row in ("en-de", "ja-en", "xx->en", "en->xx", "latin", "utf8-3byte xx->en", "non-latin en->xx"):
        assert any(line.split("  ")[0].strip() == row for line in table.splitlines()), (row, table)
    assert "BLEU[char]" in table and "chrF" in table


def test_best_checkpoint_copy_of_a_real_run_loads_and_decodes_the_same(tiny_run, tmp_path):
    import shutil

    from scaletrain.checkpoint import load_for_inference, resolve_checkpoint
    from scaletrain.eval.in_training import BestCheckpoint

    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run, run_dir)
    src = resolve_checkpoint(run_dir)
    best = BestCheckpoint(run_dir / "checkpoints", "valid/chrf_avg/all")
    best.update(30, {"valid/chrf_avg/all": 1.0})
    kept = best.keep(src)
    shutil.rmtree(src)  # rotated away: the kept copy stays complete
    a, _, vocab, state, ckpt = load_for_inference(kept)
    assert ckpt == kept and state["step"] == 30
    lines = [b"Save", "Löschen".encode()]
    from scaletrain.eval.translate import translate_lines

    got, _ = translate_lines(a, vocab, lines, "en", "de", beam=1, lenpen=1.0, max_len_a=1.0, max_len_b=20,
                             batch_tokens=1000)
    assert got == _library(tiny_run, lines, "en", "de", beam=1, lenpen=1.0)
