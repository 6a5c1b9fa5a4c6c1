"""Host synchronisations per training step of the real trainer, per engine and precision (CPU and GPU).

    python benchmarks/count_host_syncs.py [--shards DIR | --synthetic] [--runs ds-fp32,ds-bf16,acc-fp32,...]
                                          [--steps 9] [--log-every 3] [--size tiny|small]

Each run trains ``--steps`` updates of a small model in a fresh process under ``torch.profiler`` and counts
per update, outside torch's own optimizer step (``scaletrain/train/sync_count.py``): host reads
(``aten::_local_scalar_dense``), on CUDA the runtime's stream/device/event synchronisations, and the calls of
``Tensor.tolist``/``Tensor.cpu`` (``StepWatch``: invisible to the CPU profiler); on CUDA also the synchronising
calls ``torch.cuda.set_sync_debug_mode("warn")`` reports (column ``debug``). Split into log steps
(``train.log_every``: the loss sums, the grad norm and the metrics are read there by design) and the others.
Runs: ``ds`` DeepSpeed engine, ``acc`` Accelerate DDP, ``accds`` Accelerate with the DeepSpeed plugin; ``-zN``
picks ZeRO stage N (default 0); precision fp32 | bf16 | fp16. Shards: ``--shards``, else ``--synthetic``
(generated de-en sentence pairs, no download: the GPU script), else the django gettext corpus of the tests,
prepared once into a cache directory.
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

import torch

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
    ds = f"zero{zero}.json" if prec != "fp16" else "fp16.json"
    ov = [f"engine.precision={prec}", f"engine.ds_config={ds}"]
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
    import scaletrain.train.trainer as trainer_mod
    from scaletrain.config import load_config
    from scaletrain.train import Trainer
    from scaletrain.train.sync_count import StepWatch, host_reads_per_step, profiled, steps_seen

    out = tempfile.mkdtemp(prefix="syncs-")
    over = [*(TINY if args.size == "tiny" else SMALL), f"data.shards={args.shards}", f"train.out_dir={out}",
            f"train.max_steps={args.steps}", f"train.log_every={args.log_every}", "train.valid_every=0",
            "train.valid_max_batches=1", "train.save_every=0", "train.resume=false", "tracking.enabled=false",
            "engine.threads=1", *run_overrides(args.one), *args.override]
    tr = Trainer(load_config("small", over))
    t = time.perf_counter()
    with StepWatch(trainer_mod) as watch, profiled() as prof:
        tr.fit()
    wall = time.perf_counter() - t
    tr.close()
    events = prof.events()
    reads = host_reads_per_step(events)
    reads.update(watch.copies)
    steps = [s for s in steps_seen(events) if s <= args.steps]
    log_steps = [s for s in steps if s % args.log_every == 0 or s == args.steps]
    other = [s for s in steps if s not in log_steps]
    cuda = torch.cuda.is_available()
    return {"run": args.one, "device": str(tr.engine.device), "steps": len(steps),
            "reads_other_steps": [reads[s] for s in other], "reads_log_steps": [reads[s] for s in log_steps],
            "reads_outside_steps": reads[0], "profiled_seconds": wall,
            "debug_other_steps": [watch.sync_warnings[s] for s in other] if cuda else None,
            "debug_log_steps": [watch.sync_warnings[s] for s in log_steps] if cuda else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", default="")
    ap.add_argument("--synthetic", action="store_true", help="generated shards (no download, no django)")
    ap.add_argument("--runs", default=DEFAULT_RUNS)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--log-every", type=int, default=3)
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--override", action="append", default=[], help="extra config override (repeatable)")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    ap.add_argument("--json", default="", help="also write the results as JSON to this file")
    args = ap.parse_args(argv)
    if not args.shards:
        args.shards = str(synthetic_shards() if args.synthetic else default_shards())
    if args.one:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return 0
    results = []
    print(f"{'run':<16} {'steps':>5} {'syncs/other step':>18} {'syncs/log step':>16} {'outside':>8} "
          f"{'debug/other':>14} {'debug/log':>12}")
    for run in args.runs.split(","):
        cmd = [sys.executable, __file__, "--one", run, "--shards", args.shards, "--steps", str(args.steps),
               "--log-every", str(args.log_every), "--size", args.size,
               *sum((["--override", o] for o in args.override), [])]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            print(f"{run:<16} failed ({p.returncode}): {p.stderr.strip().splitlines()[-1:] or p.stdout[-300:]}")
            continue
        r = json.loads(line[len("RESULT "):])
        results.append(r)
        o, lg = r["reads_other_steps"], r["reads_log_steps"]
        dbg = ((_fmt(r["debug_other_steps"]), _fmt(r["debug_log_steps"])) if r["debug_other_steps"] is not None
               else ("-", "-"))
        print(f"{run:<16} {r['steps']:>5} {_fmt(o):>18} {_fmt(lg):>16} {r['reads_outside_steps']:>8} "
              f"{dbg[0]:>14} {dbg[1]:>12}  {r['device']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def _fmt(xs: list[int] | None) -> str:
    return f"{sum(xs) / len(xs):.1f} (max {max(xs)})" if xs else "-"


def synthetic_shards() -> Path:
    """de-en shards from generated sentence pairs (deterministic; ~1 s), prepared once under the temp directory."""
    import random

    from scaletrain.prepare.parallel_text import ParallelCorpus
    from scaletrain.prepare import prepare_parallel

    out = Path(tempfile.gettempdir()) / f"scaletrain-syncs-{os.getuid()}" / "synthetic"
    if (out / "manifest.json").is_file():
        return out
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyzäöü"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(500)]
    src_dir = out.parent / "synthetic-text"
    src_dir.mkdir(parents=True, exist_ok=True)
    corpora = []
    for split, n in (("train", 4000), ("valid", 200)):
        lines = []
        for _ in range(n):
            sent = [rng.choice(words) for _ in range(rng.randint(3, 12))]
            lines.append(" ".join(sent) + "\t" + " ".join(reversed(sent)).upper())
        (src_dir / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
        corpora.append(ParallelCorpus(split, "de", "en", tsv_path=str(src_dir / f"{split}.tsv")))
    prepare_parallel(corpora, out, overwrite=True, progress=False)
    return out


def default_shards() -> Path:
    """The tests' django gettext corpus (de ru ar hi ja), prepared once under the temp directory."""
    out = Path(tempfile.gettempdir()) / f"scaletrain-syncs-{os.getuid()}" / "django5"
    if not (out / "manifest.json").is_file():
        from scaletrain.prepare import prepare_gettext

        prepare_gettext(package="django", langs=["de", "ru", "ar", "hi", "ja"], out=out, progress=False)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
