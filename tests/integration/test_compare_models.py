"""`scaletrain compare-models` end to end at tiny sizes: two models trained a few steps on the same shards,
evaluated, compared into one folder; a re-run trains and overwrites nothing; other settings are refused."""
from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.slow

TINY = ["--set", "model.d_model=64", "--set", "model.ffn_dim=128", "--set", "train.max_steps=3",
        "--set", "train.valid_max_batches=1", "--set", "eval.groups={latin: [de], cjk: [ja]}"]


def compare_models(out, shards, *extra):
    cmd = [sys.executable, "-m", "scaletrain", "compare-models", "--models", "base,msc", "--base-seeds", "1",
           "--size", "tiny", "--minutes", "2", "--beam", "1", "--eval-lines", "2", "--shards", str(shards),
           "--out", str(out), *TINY, *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_compare_models_folder_table_and_resume(django_shards, tmp_path):
    out = tmp_path / "cmp"
    p = compare_models(out, django_shards)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
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
    for f in ("compare.md", "compare.csv", "compare.json", "compare.png"):
        assert (out / f).stat().st_size > 0, f
    rows = {row[0]: row[1:] for row in csv.reader((out / "compare.csv").open())}
    assert rows["run_name"] == runs
    assert rows["config: model.arch"] == ["transformer", "msc"]
    assert int(rows["config: params.total"][0]) < int(rows["config: params.total"][1])  # MSC adds its kernels
    assert rows["steps"] == ["3", "3"]
    for key in ("test/chrf/all", "test/chrf/latin", "test/chrf/cjk", "test/bleu/all", "tokens/s (mean)"):
        assert all(v not in ("", "nan") for v in rows[key]), key
    assert "test/chrf/latin" in (out / "compare.md").read_text()

    # a re-run: nothing trained or evaluated again, nothing overwritten
    before = {f: f.stat().st_mtime_ns for f in out.rglob("*") if f.is_file() and "mlruns.db" not in f.name}
    p = compare_models(out, django_shards)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("already trained") == 2 and p.stdout.count("already evaluated") == 2
    assert "the table of these runs is already in" in p.stdout
    after = {f: f.stat().st_mtime_ns for f in before}
    changed = [str(f) for f in before if after[f] != before[f] and not f.name.endswith(".log")]
    assert not changed, changed
    # other shared settings are refused in the same folder, before anything runs
    p = compare_models(out, django_shards, "--set", "optim.lr=1e-3")
    assert p.returncode == 2 and "share every setting" in p.stderr and len(p.stderr.strip().splitlines()) == 1
