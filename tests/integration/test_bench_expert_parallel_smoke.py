"""benchmarks/bench_expert_parallel.py runs on 2 ranks and prints its table (tiny shapes; numbers not checked
except what is exact: ep=2 holds half the expert memory, ep=1 exchanges nothing)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_expert_parallel_prints_its_table():
    out = subprocess.run([sys.executable, "benchmarks/bench_expert_parallel.py", "--dim", "16", "--ffn", "32",
                          "--experts", "4", "--batch", "2", "--len", "4", "--rounds", "1", "--warmup", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {m[0]: [float(v) for v in m[1:]] for m in re.findall(r"^ep=(\d)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)", out.stdout, re.M)}
    assert set(rows) == {"1", "2"}, out.stdout
    assert rows["1"][1] == 0.0 and rows["2"][1] > 0
    assert "expert memory per rank 0.50x" in out.stdout
