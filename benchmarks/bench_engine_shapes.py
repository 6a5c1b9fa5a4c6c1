"""Cost of new batch shapes on CPU: the first step at a shape vs the same shape again, fp32 and bf16.

    python benchmarks/bench_engine_shapes.py [--shapes 6] [--batch 4]

oneDNN creates (and caches) kernels per input shape; in bf16 that creation was seen to make the first
steps slow with token-budget batches, whose shapes vary. Byte Transformer base through the DeepSpeed
engine (one process). For each precision: mean step time over the first visit of each of N distinct
lengths, mean over a second visit of the same lengths, and their ratio; then how many distinct shapes
remain when lengths are padded to a multiple of 8/16/32 (collate's pad_to_multiple), which bounds how
often that first-visit cost is paid.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine_throughput import LANGS, base_cfg  # noqa: E402


def run(precision: str, lengths: list[int], batch: int) -> tuple[float, float]:
    from scaletrain.engine import build_engine
    from scaletrain.models import build_model
    from scaletrain.models.loss import label_smoothed_ce
    from scaletrain.vocab import ByteVocab

    cfg = base_cfg(precision)
    eng = build_engine(cfg)
    torch.manual_seed(0)
    eng.setup(build_model(cfg.model, ByteVocab(LANGS).size))
    eng.train(True)

    def step(L):
        src = torch.randint(4, 200, (batch, L))
        tgt = torch.randint(4, 200, (batch, L + 1))
        t = time.perf_counter()
        loss, _, n = label_smoothed_ce(eng.forward(src, tgt[:, :-1]), tgt[:, 1:], epsilon=0.1, ignore_index=0)
        eng.backward(loss / n)
        eng.step()
        return time.perf_counter() - t

    step(16)  # library start-up, not shape cost
    first = [step(L) for L in lengths]
    again = [step(L) for L in lengths]
    return sum(first) / len(first), sum(again) / len(again)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    lengths = [37 + 8 * i for i in range(args.shapes)]
    print(f"byte Transformer base, batch {args.batch} x L (src and tgt), L in {lengths}, threads {args.threads}")
    print(f"{'precision':9s} {'first visit s':>13s} {'again s':>8s} {'first/again':>11s}")
    for prec in ("fp32", "bf16"):
        f, a = run(prec, lengths, args.batch)
        print(f"{prec:9s} {f:13.3f} {a:8.3f} {f / a:10.2f}x")
    import numpy as np

    rng = np.random.default_rng(0)
    lens = rng.integers(8, 257, size=2000)  # byte lengths of a token-budget stream's batches
    for m in (1, 8, 16, 32):
        print(f"pad_to_multiple={m:2d}: {len(set((-(-lens // m) * m).tolist())):3d} distinct lengths in 2000 batches")


if __name__ == "__main__":
    main()
