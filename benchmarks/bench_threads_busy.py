"""`scaletrain evaluate` with one CPU busy with something else: the thread rule (scaletrain.threads) vs
torch's default (every core of the machine), in interleaved rounds.

A busy loop (``yes > /dev/null``) is pinned to one CPU of this process's affinity set (``--no-busy``: none).
Each round runs ``scaletrain evaluate`` twice in fresh processes on the same lines:

* ``auto``: no ``--threads``, no ``OMP_NUM_THREADS`` (the rule: usable cores, capped by the cores idle now);
* ``all-cores``: ``--threads N`` with N = the usable cores (what torch does by default).

Printed per round: decoding sentences/s of each (the evaluation's own figure: decode time only) and the
ratio auto / all-cores; then the medians. The checkpoint is exported once to a safetensors file in a
temporary directory and evaluated from there, so nothing of the run directory is touched.

    python benchmarks/bench_threads_busy.py --checkpoint runs/small-XXXX [--max-lines 10] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def evaluate(model: Path, max_lines: int, threads: int | None, tmp: Path) -> tuple[float, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "SCALETRAIN_USER_OMP_NUM_THREADS")}
    out = tmp / "eval.json"
    cmd = [sys.executable, "-m", "scaletrain", "evaluate", "--checkpoint", str(model), "--max-lines", str(max_lines),
           "--no-track", "--json", str(out), "--hyp-dir", str(tmp / "hyp")]
    if threads:
        cmd += ["--threads", str(threads)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"evaluate failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    chosen = next((ln.split(" ", 1)[1] for ln in p.stdout.splitlines() if " threads " in f" {ln} "), "?")
    return float(json.loads(out.read_text())["sentences_per_s"]), chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a run or checkpoint directory (or an exported .safetensors)")
    ap.add_argument("--max-lines", type=int, default=10, help="lines per direction (default 10)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-busy", action="store_true", help="no busy loop (the idle machine)")
    a = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    busy = None
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = Path(a.checkpoint)
        if model.suffix != ".safetensors":
            model = tmp / "model.safetensors"
            subprocess.run([sys.executable, "-m", "scaletrain", "export", a.checkpoint, "--out", str(model)], cwd=ROOT,
                           check=True, capture_output=True, timeout=600)
        if not a.no_busy:
            busy = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL,
                                    preexec_fn=lambda: os.sched_setaffinity(0, {cpus[-1]}))
        print(f"load {open('/proc/loadavg').read().split()[:3]}, usable CPUs {cpus}, "
              f"busy loop on {'none' if busy is None else cpus[-1]}")
        ratios, autos, alls = [], [], []
        try:
            for r in range(a.rounds):
                s_auto, why = evaluate(model, a.max_lines, None, tmp)
                s_all, _ = evaluate(model, a.max_lines, len(cpus), tmp)
                autos.append(s_auto)
                alls.append(s_all)
                ratios.append(s_auto / s_all)
                print(f"round {r + 1}: auto {s_auto:8.1f} sent/s ({why.strip()}) | all-cores ({len(cpus)}) "
                      f"{s_all:8.1f} sent/s | ratio {s_auto / s_all:6.2f}x", flush=True)
        finally:
            if busy is not None:
                busy.terminate()
                busy.wait()
    print(f"median: auto {statistics.median(autos):.1f} sent/s, all-cores {statistics.median(alls):.1f} sent/s, "
          f"ratio {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
