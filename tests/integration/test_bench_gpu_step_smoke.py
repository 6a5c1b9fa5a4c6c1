"""``benchmarks/bench_gpu_step.py --smoke`` keeps working without a GPU: every variant that can run on CPU builds,
trains at both token budgets and is counted; our step through the DeepSpeed engine reads nothing back per step
(the CUDA part, with CUDA graphs, inductor and the sync debug mode, runs in benchmarks/gpu_step.sh)."""
from __future__ import annotations

import json
import sys

import pytest

from helpers import ROOT, launcher_env, run

pytestmark = pytest.mark.slow


def test_smoke_runs_every_cpu_variant(tmp_path):
    out = tmp_path / "bench.json"
    p = run([sys.executable, "benchmarks/bench_gpu_step.py", "--smoke", "--json", str(out)], launcher_env(tmp_path),
            timeout=600)
    assert "ds-graphed: skipped (CUDA graphs need a GPU)" in p.stdout
    res = json.loads(out.read_text())
    rows = {(r["variant"], r["budget"]): r for r in res["rows"]}
    want = {"ds", "acc", "ds-compiled", "ds-old", "hf", "hf-compiled"}
    assert {v for v, _ in rows} == want and {b for _, b in rows} == {64, 256}
    for key, r in rows.items():
        assert not r["error"] and r["ms_per_step"] > 0 and 0 < r["mfu"] < 1 and r["vs_hf"] > 0, (key, r)
        assert r["launches_per_step"] is None and r["sync_debug_per_step"] is None  # CUDA-only columns
    assert all(rows[("ds", b)]["syncs_per_step"] == 0 and rows[("acc", b)]["syncs_per_step"] == 0 for b in (64, 256))
    assert rows[("hf", 64)]["vs_hf"] == 1.0
    assert (ROOT / "benchmarks" / "gpu_step.sh").is_file()
