"""The MoCE benchmarks named in the README run and print their table (tiny shapes; numbers not checked)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_bench_models_reports_routed_and_dense_moce():
    out = _run("benchmarks/bench_models.py", "--variants", "moce_d5,moce_d5_dense", "--batch", "2",
               "--src-len", "16", "--tgt-len", "16", "--rounds", "2", "--warmup", "0", "--threads", "1")
    for name in ("transformer", "moce_d5", "moce_d5_dense"):
        assert re.search(rf"^{name}\s+\S+M\s+[\d.]+\s+\d+\s+[\d.]+x", out, re.M), out


def test_bench_moce_layer_reports_three_layers():
    out = _run("benchmarks/bench_moce_layer.py", "--batch", "2", "--len", "16", "--rounds", "1", "--reps", "1",
               "--threads", "1")
    for name in ("plain", "moce routed", "moce dense"):
        assert re.search(rf"^{name}\s+[\d.]+ ms fwd\+bwd", out, re.M), out
    assert "routed / dense layer time" in out
