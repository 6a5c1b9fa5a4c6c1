"""CI runs the GPU suite's CPU part: every check's CPU twin passes (fp16 steps included: autocast fp16 and
GradScaler run on the CPU), GPU-only rows are SKIP, exit 0."""
from __future__ import annotations

import subprocess
import sys

from helpers import ROOT


def test_gpu_suite_cpu_part_passes():
    p = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--cpu"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**__import__("os").environ, "PYTHONPATH": str(ROOT),
                                                    "OMP_NUM_THREADS": "1"})
    out = p.stdout
    assert p.returncode == 0, out[-3000:] + p.stderr[-3000:]
    assert "--cpu given: running the CPU parts" in out and "0 failed" in out
    table = out.split("=" * 100)[1]
    rows = {line.split()[0]: line.split()[1] for line in table.splitlines()[2:] if line.strip() and
            not line.startswith("0 failed")}
    for check in ("step/transformer/bf16", "step/moce_d5_lid/bf16", "step/byte_wsf/bf16", "moce-dense=routed",
                  "sdpa-fused", "compile", "step/transformer/fp16", "step/embeddingless/fp16",
                  "init-loss/embeddingless", "init-loss/moce_d5", "host-reads/transformer", "host-reads/moe",
                  "host-reads/moce_d5_moe", "moe-grouped-gemm", "sdpa-unmasked", "max-tokens-auto"):
        assert rows.get(check) == "PASS", (check, table)
    assert "GradScaler(cpu) twin: step skipped, scale 65536 -> 32768" in table
    assert "0 reads (-) for 1 MoE layers (grouped GEMM: True)" in table  # single-rank MoE: no device read
    assert "bench/decode/beam4" in table and "sentences/s" in table
    assert "bench/moe-vs-dense/moe_base" in table and "bench/moe-vs-dense/moce_d5_moe" in table
