"""`scaletrain compare-models` end to end at tiny sizes: models trained a few steps on the same shards, evaluated,
compared into one folder. Interrupted (SIGTERM) after the first model, a re-run resumes without training or
evaluating the finished model again and without overwriting anything; a model that fails is in the table as
failed, with its reason, beside the others (exit 1); other shared settings are refused in the same folder."""
from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT

pytestmark = pytest.mark.slow

TINY = ["--set", "model.d_model=64", "--set", "model.ffn_dim=128", "--set", "train.max_steps=3",
        "--set", "train.valid_max_batches=1", "--set", "eval.groups={latin: [de], cjk: [ja]}"]
# subword_cg needs a SentencePiece model in the shards, which these (prepared without --spm-vocab-size) lack:
# it fails at the start of its training, after the other two models
MODELS = "base,msc,subword_cg"


def command(out, shards, *extra):
    return [sys.executable, "-m", "scaletrain", "compare-models", "--models", MODELS, "--base-seeds", "1",
            "--size", "tiny", "--minutes", "2", "--beam", "1", "--eval-lines", "2", "--shards", str(shards),
            "--out", str(out), *TINY, *extra]


def compare_models(out, shards, *extra):
    return subprocess.run(command(out, shards, *extra), cwd=ROOT, capture_output=True, text=True, timeout=900)


def interrupted_after_the_first_model(out, shards) -> tuple[int, str]:
    """Run compare-models and send it SIGTERM as soon as the second model's training starts."""
    proc = subprocess.Popen(command(out, shards), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    second = out / "logs" / "msc-s1.train.log"
    deadline = time.time() + 600
    while not second.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=300)
    return proc.returncode, stdout


def files(out):
    return {f: (f.stat().st_mtime_ns, f.read_bytes()) for f in out.rglob("*")
            if f.is_file() and "mlruns.db" not in f.name and not f.name.endswith(".log")}


def test_compare_models_interrupted_resumed_with_a_failing_model(django_shards, tmp_path):
    out = tmp_path / "cmp"
    rc, stdout = interrupted_after_the_first_model(out, django_shards)
    assert rc == 128 + signal.SIGTERM, stdout[-3000:]
    assert "interrupted by SIGTERM during msc-s1" in stdout and "[3/3]" not in stdout, stdout[-3000:]
    assert (out / "runs" / "base-s1" / "eval_test.json").is_file()
    assert not (out / "runs" / "msc-s1" / "eval_test.json").exists()
    assert not (out / "logs" / "subword_cg-s1.train.log").exists() and not (out / "compare.md").exists()
    base_files = {f: v for f, v in files(out).items() if "base-s1" in str(f)}
    assert base_files

    # the re-run: base is neither trained nor evaluated again, msc is, subword_cg fails; exit 1
    p = compare_models(out, django_shards)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("already trained") == 1 and p.stdout.count("already evaluated") == 1
    assert "FAILED: training exited 2: " in p.stdout and "failed: subword_cg-s1; re-run" in p.stdout
    assert {f: v for f, v in files(out).items() if "base-s1" in str(f)} == base_files  # nothing of base rewritten
    runs = ["base-s1", "msc-s1"]
    for r in runs:
        summary = json.loads((out / "runs" / r / "train_summary.json").read_text())
        assert summary["steps"] == 3 and not summary["preempted"]
        ev = json.loads((out / "runs" / r / "eval_test.json").read_text())
        assert ev["lines"] == 2 * 10 and ev["beam"] == 1 and "cut_invalid_utf8" in ev  # 2 lines x 10 directions
        assert (out / "logs" / f"{r}.train.log").is_file() and (out / "logs" / f"{r}.eval.log").is_file()
    plan = json.loads((out / "plan.json").read_text())
    assert plan["minutes"] == 2 and plan["size"] == "tiny" and plan["shards"] == str(django_shards.resolve())
    assert plan["precision"] == "fp32"  # auto resolved once for every run (the suite pins auto to fp32)
    for f in ("compare.md", "compare.csv", "compare.json", "compare.png", "compare.plot.json"):
        assert (out / f).stat().st_size > 0, f
    rows = {row[0]: row[1:] for row in csv.reader((out / "compare.csv").open())}
    assert rows["run_name"] == [*runs, "subword_cg-s1"]
    assert rows["config: model.arch"][:2] == ["transformer", "msc"]
    assert int(rows["config: params.total"][0]) < int(rows["config: params.total"][1])  # MSC adds its kernels
    assert rows["steps"][:2] == ["3", "3"] and rows["status"][2] == "FAILED"
    assert rows["failed"][:2] == ["", ""] and rows["failed"][2].startswith("training exited 2: ")
    assert "sentencepiece" in rows["failed"][2].lower() or "spm" in rows["failed"][2].lower(), rows["failed"][2]
    for key in ("test/chrf/all", "test/chrf/latin", "test/chrf/cjk", "test/bleu/all", "tokens/s (mean)"):
        assert all(v not in ("", "nan") for v in rows[key][:2]), key
    assert rows["evaluation (test)"][2] == "not evaluated"
    assert "test/chrf/latin" in (out / "compare.md").read_text()
    # the plot marks every evaluated run's bars with its copy-the-source chrF, as its evaluation scored it
    run_ids = dict(zip(rows["run_name"], rows["field"]))
    bars = {b["run_id"]: b for b in json.loads((out / "compare.plot.json").read_text())["bars"]}
    for r in runs:
        ev = json.loads((out / "runs" / r / "eval_test.json").read_text())
        copy = {a["name"].replace("->", "2"): a["chrf"] for a in ev["copy_baseline"]["averages"]}
        mark = bars[run_ids[r]]["copy_source_chrf"]
        assert mark and all(v == pytest.approx(copy[g]) for g, v in mark.items()), (mark, copy)

    # again: nothing trained or evaluated again, nothing overwritten, the failing model retried
    before = files(out)
    p = compare_models(out, django_shards)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("already trained") == 2 and p.stdout.count("already evaluated") == 2
    assert "the table of these runs is already in" in p.stdout
    after = files(out)
    assert [f for f in before if after.get(f) != before[f]] == [] and after.keys() == before.keys()
    # other shared settings are refused in the same folder, before anything runs
    p = compare_models(out, django_shards, "--set", "optim.lr=1e-3")
    assert p.returncode == 2 and "share every setting" in p.stderr and len(p.stderr.strip().splitlines()) == 1
