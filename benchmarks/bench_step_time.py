"""Step time of the real trainer, this tree against another one (e.g. an earlier commit), interleaved.

    git archive <commit> | tar -x -C /tmp/base
    python benchmarks/bench_step_time.py --base /tmp/base [--runs ds-fp32,ds-bf16,acc-fp32,acc-bf16]
                                         [--size tiny|small] [--steps 30] [--rounds 3]

Each run trains ``--steps`` updates in a fresh process of the given tree (``PYTHONPATH``), one process per
(tree, run, round), alternating the trees within each round, so the shared machine's drift hits both alike.
The time of an update is the wall time between the step logger's calls (the whole loop iteration: batches,
step, components), over the updates after the first ``--skip``; a run's figures are their 10th percentile (on a
machine shared with other jobs the low end is the update's own cost, the rest waiting for a core) and median.
Printed: per run the median over rounds of each tree, and the ratio base/this of the p10 per round (median,
min-max). Runs are named as in
``count_host_syncs.py`` (``ds``/``acc``/``accds``, precision, ``-zN``).
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from count_host_syncs import SMALL, TINY, default_shards, run_overrides  # noqa: E402

CHILD = r"""
import json, statistics, sys, time
from scaletrain.config import load_config
from scaletrain.train import Trainer
over, skip = json.loads(sys.argv[1]), int(sys.argv[2])
tr = Trainer(load_config("small", over))
stamps, real = [], tr.logger.after_step
def after_step(*a, **k):
    stamps.append(time.perf_counter())
    return real(*a, **k)
tr.logger.after_step = after_step
tr.fit()
tr.close()
dts = [b - a for a, b in zip(stamps, stamps[1:])][skip:]
p10 = sorted(dts)[len(dts) // 10]
print("RESULT " + json.dumps({"median_s": statistics.median(dts), "p10_s": p10, "n": len(dts)}))
"""


def one(tree: Path, run: str, args) -> dict | None:
    out = tempfile.mkdtemp(prefix="steptime-")
    over = [*(TINY if args.size == "tiny" else SMALL), f"data.shards={args.shards}", f"train.out_dir={out}",
            f"train.max_steps={args.steps}", "train.log_every=10", "train.valid_every=0", "train.valid_max_batches=1",
            "train.save_every=0", "train.resume=false", "tracking.enabled=false", "engine.threads=1",
            *run_overrides(run)]
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", SCALETRAIN_AUTO_PRECISION="fp32")
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(over), str(args.skip)], cwd=tree, env=env,
                       capture_output=True, text=True, timeout=1200)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        print(f"  {tree.name} {run}: failed ({p.returncode}): {p.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the other source tree (its scaletrain/ is imported)")
    ap.add_argument("--runs", default="ds-fp32,ds-bf16,acc-fp32,acc-bf16")
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=3, help="updates left out at the start (warm-up)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shards", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    args.shards = args.shards or str(default_shards())
    trees = {"base": Path(args.base).resolve(), "this": ROOT}
    runs = args.runs.split(",")
    t = {(tr, r): [] for tr in trees for r in runs}
    for k in range(args.rounds):
        print(f"round {k + 1}: load {os.getloadavg()[0]:.1f}", flush=True)
        for r in runs:
            for name in (("base", "this") if k % 2 == 0 else ("this", "base")):
                t[(name, r)].append(one(trees[name], r, args))
    print(f"\n{args.size} model, {args.steps} updates per run; ms per update: p10 (the update's own cost on a shared "
          f"machine) and median, each the median over rounds; speed-up = base/this p10 per round, median [min-max]")
    results = []
    for r in runs:
        pairs = [(b, n) for b, n in zip(t[("base", r)], t[("this", r)]) if b and n]
        if not pairs:
            print(f"{r:<12} no complete round")
            continue
        ratios = [b["p10_s"] / n["p10_s"] for b, n in pairs]
        rec = {"run": r, "ratios": ratios}
        for i, tree in enumerate(("base", "this")):
            for q in ("p10", "median"):
                rec[f"{tree}_{q}_ms"] = 1e3 * statistics.median(p[i][f"{q}_s"] for p in pairs)
        print(f"{r:<12} base {rec['base_p10_ms']:7.1f} ({rec['base_median_ms']:7.1f})  this {rec['this_p10_ms']:7.1f} "
              f"({rec['this_median_ms']:7.1f})  speed-up {statistics.median(ratios):.2f}x "
              f"[{min(ratios):.2f}-{max(ratios):.2f}]")
        results.append(rec)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
