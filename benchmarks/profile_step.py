"""torch.profiler's top operators for one training step of our byte Transformer through the engine.

    python benchmarks/profile_step.py [--size base] [--precision auto] [--batch 16] [--len 128] [--rows 25]
                                      [--md benchmarks/profile_step_<date>.md]

One step = forward + label-smoothed loss + backward + optimizer update through the DeepSpeed engine
(the same path as training and as bench_engine_throughput.py's "ours" rows), after ``--warmup`` steps.
Prints the operators sorted by self CPU time (where the time really goes: GEMMs, attention, layer norm,
the vocabulary softmax, the optimizer, copies), and with ``--md`` writes the table with the date, the
CPU model and flags, the precision and the step time.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine_throughput import LANGS, base_cfg, make_batch  # noqa: E402


def build_step(size: str, precision: str, B: int, L: int):
    from scaletrain.engine import build_engine
    from scaletrain.models import build_model
    from scaletrain.models.loss import label_smoothed_ce
    from scaletrain.vocab import ByteVocab

    cfg = base_cfg(precision, size)
    eng = build_engine(cfg)  # resolves precision=auto
    torch.manual_seed(0)
    V = ByteVocab(LANGS).size
    eng.setup(build_model(cfg.model, V))
    eng.train(True)
    src, tgt_in, tgt_out = make_batch(B, L, V)

    def step():
        logits = eng.forward(src, tgt_in)
        loss, _, n = label_smoothed_ce(logits, tgt_out, epsilon=0.1, ignore_index=0)
        eng.backward(loss / n)
        eng.step()

    return step, cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="base", help="recipe whose model size to profile (base, small, ...)")
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--md", default="", help="also write the table as Markdown to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    from scaletrain.engine.precision import cpu_flags, cpu_model

    step, cfg = build_step(args.size, args.precision, args.batch, args.len)
    for _ in range(args.warmup):
        step()
    from torch.profiler import ProfilerActivity, profile

    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    wall = time.perf_counter() - t
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=48)
    flags = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16") if f in cpu_flags()]
    head = (f"{args.size} ({cfg.model.d_model}d, {cfg.model.encoder_layers}+{cfg.model.decoder_layers} layers), "
            f"batch {args.batch}x{args.len}, precision {cfg.engine.precision} ({cfg.engine.precision_auto or 'explicit'}), "
            f"{args.threads} threads; one step {wall:.2f} s under the profiler\n"
            f"CPU: {cpu_model()}; flags {' '.join(flags) or '-'}; load average {os.getloadavg()[0]:.2f}")
    print(head)
    print(table)
    if args.md:
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        cmd = "python benchmarks/profile_step.py " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(args.md).write_text(f"# One training step, top operators by self CPU time ({date})\n\n"
                                 f"`{cmd}`\n\n{head.replace(chr(10), '  ' + chr(10))}\n\n```\n{table}\n```\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
