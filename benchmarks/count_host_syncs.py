"""Host reads (``aten::_local_scalar_dense``) per training step of the real trainer, per engine and precision.

    python benchmarks/count_host_syncs.py [--shards DIR] [--runs ds-fp32,ds-bf16,acc-fp32,...]
                                          [--steps 9] [--log-every 3] [--size tiny|small]

Each run trains ``--steps`` updates of a small model in a fresh process under ``torch.profiler`` and
counts the host reads of every update outside torch's own optimizer step (``scaletrain/train/sync_count.py``),
split into log steps (``train.log_every``: the loss sums, the grad norm and the metrics are read there by
design) and the other steps. Runs: ``ds`` DeepSpeed engine, ``acc`` Accelerate DDP, ``accds`` Accelerate
with the DeepSpeed plugin; ``-zN`` picks ZeRO stage N (default 0); precision fp32 | bf16 | fp16.
Without ``--shards`` the django gettext corpus of the tests is prepared once into a cache directory.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_RUNS = "ds-fp32,ds-bf16,acc-fp32,acc-bf16,accds-fp32,accds-bf16"
TINY = ["model.d_model=32", "model.n_heads=2", "model.encoder_layers=1", "model.decoder_layers=1",
        "model.ffn_dim=64", "model.max_positions=64", "model.dropout=0.0", "data.max_bytes=40",
        "data.max_tokens=600"]
SMALL = ["model.d_model=256", "model.n_heads=4", "model.encoder_layers=3", "model.decoder_layers=3",
         "model.ffn_dim=1024", "model.max_positions=128", "data.max_bytes=120", "data.max_tokens=3000"]


def run_overrides(run: str) -> list[str]:
    """``ds-bf16-z2`` -> engine overrides."""
    parts = run.split("-")
    engine, prec = parts[0], parts[1]
    zero = int(parts[2][1:]) if len(parts) > 2 else 0
    ov = [f"engine.precision={prec}", f"engine.ds_config=zero{zero}.json" if prec != "fp16" else "engine.ds_config=fp16.json"]
    if engine == "ds":
        ov.append("engine.backend=deepspeed")
    elif engine == "acc":
        ov += ["engine.backend=accelerate", "engine.accelerate=ddp"]
    elif engine == "accds":
        ov += ["engine.backend=accelerate", "engine.accelerate=deepspeed"]
    else:
        raise SystemExit(f"unknown engine {engine!r} in run {run!r}")
    return ov


def one(args) -> dict:
    """Train in this process under the profiler; the counts as a dict."""
    from scaletrain.config import load_config
    from scaletrain.train import Trainer
    from scaletrain.train.sync_count import host_reads_per_step, profiled, steps_seen

    out = tempfile.mkdtemp(prefix="syncs-")
    over = [*(TINY if args.size == "tiny" else SMALL), f"data.shards={args.shards}", f"train.out_dir={out}",
            f"train.max_steps={args.steps}", f"train.log_every={args.log_every}", "train.valid_every=0",
            "train.valid_max_batches=1", "train.save_every=0", "train.resume=false", "tracking.enabled=false",
            "engine.threads=1", *run_overrides(args.one), *args.override]
    tr = Trainer(load_config("small", over))
    t = time.perf_counter()
    with profiled() as prof:
        tr.fit()
    wall = time.perf_counter() - t
    tr.close()
    events = prof.events()
    reads = host_reads_per_step(events)
    steps = [s for s in steps_seen(events) if s <= args.steps]
    log_steps = [s for s in steps if s % args.log_every == 0 or s == args.steps]
    other = [s for s in steps if s not in log_steps]
    return {"run": args.one, "steps": len(steps), "reads_other_steps": [reads[s] for s in other],
            "reads_log_steps": [reads[s] for s in log_steps], "reads_outside_steps": reads[0],
            "profiled_seconds": wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", default="")
    ap.add_argument("--runs", default=DEFAULT_RUNS)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--log-every", type=int, default=3)
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--override", action="append", default=[], help="extra config override (repeatable)")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    ap.add_argument("--json", default="", help="also write the results as JSON to this file")
    args = ap.parse_args(argv)
    if not args.shards:
        args.shards = str(default_shards())
    if args.one:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return 0
    results = []
    print(f"{'run':<16} {'steps':>5} {'reads/other step':>18} {'reads/log step':>16} {'outside':>8}")
    for run in args.runs.split(","):
        cmd = [sys.executable, __file__, "--one", run, "--shards", args.shards, "--steps", str(args.steps),
               "--log-every", str(args.log_every), "--size", args.size, *sum((["--override", o] for o in args.override), [])]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            print(f"{run:<16} failed ({p.returncode}): {p.stderr.strip().splitlines()[-1:] or p.stdout[-300:]}")
            continue
        r = json.loads(line[len("RESULT "):])
        results.append(r)
        o, lg = r["reads_other_steps"], r["reads_log_steps"]
        print(f"{run:<16} {r['steps']:>5} {_fmt(o):>18} {_fmt(lg):>16} {r['reads_outside_steps']:>8}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def _fmt(xs: list[int]) -> str:
    return f"{sum(xs) / len(xs):.1f} (max {max(xs)})" if xs else "-"


def default_shards() -> Path:
    """The tests' django gettext corpus (de ru ar hi ja), prepared once under the temp directory."""
    out = Path(tempfile.gettempdir()) / f"scaletrain-syncs-{os.getuid()}" / "django5"
    if not (out / "manifest.json").is_file():
        from scaletrain.data.prepare import prepare_gettext

        prepare_gettext(package="django", langs=["de", "ru", "ar", "hi", "ja"], out=out, progress=False)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
