"""DataLoader workers vs the in-process stream, measured on training steps (not on the stream alone).

One training process (the `small` recipe's model, d 256, 3+3 layers, fp32, AdamW) trains on the
bundled shards with ``ShardLoader(num_workers=0)`` and with ``num_workers=W``, in interleaved rounds
of ``--steps`` steps each (a fresh loader per round). Per round and
loader: seconds per training step and the data wait per step (time spent in ``next()`` of the
loader, i.e. what the step waited for its batch), after the first batch (start-up: workers forked, the
first window read, is left out). The ratio in-process / workers of the step time
is taken per round (the two runs are adjacent in time) and its median and range are printed.

``--decode-ms X`` makes every full block read X ms slower (a stand-in for an expensive decode, e.g.
a subword tokenizer or a remote read), to show what workers buy when the data side is slow: in
process the step pays for it, with workers it is hidden as long as the workers keep up. On 2 cores
the workers compete with the training threads for the same cores, which is the case `data.num_workers`
defaults to 0 for.

    python benchmarks/bench_loader_workers.py [--workers 2] [--steps 20] [--rounds 5] [--decode-ms 0]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from scaletrain.data import stream as stream_mod  # noqa: E402
from scaletrain.data.shards import load_manifest  # noqa: E402
from scaletrain.models import ModelConfig, build_model  # noqa: E402
from scaletrain.models.loss import label_smoothed_ce  # noqa: E402
from scaletrain.vocab import PAD, ByteVocab  # noqa: E402


def slow_reads(ms: float) -> None:
    """Every full block read (not the length headers) sleeps ``ms`` first; the workers are forked
    after this, so they inherit it."""
    real = stream_mod.read_block

    def slow(*a, **k):
        if not k.get("lengths_only"):
            time.sleep(ms / 1000)
        return real(*a, **k)

    stream_mod.read_block = slow


def run_round(model, opt, shards: str, workers: int, steps: int, max_tokens: int) -> tuple[float, float]:
    """(seconds per step, data wait per step) over ``steps`` training steps with a fresh loader."""
    loader = stream_mod.ShardLoader(shards, "train", num_workers=workers, max_tokens=max_tokens, max_bytes=160,
                                    seed=len(os.sched_getaffinity(0)))
    it = iter(loader)
    next(it)  # start-up (workers forked, the first window read) is not part of the steady state
    wait = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        w0 = time.perf_counter()
        b = next(it)
        wait += time.perf_counter() - w0
        logits = model(b.src, b.tgt_in)
        loss, _, ntok = label_smoothed_ce(logits, b.tgt_out, epsilon=0.1, ignore_index=PAD)
        (loss / ntok).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    del it  # shuts the workers down
    return dt / steps, wait / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", default="shards/django")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="training steps per round and loader")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the training process")
    ap.add_argument("--max-tokens", type=int, default=6000)
    ap.add_argument("--decode-ms", type=float, default=0.0, help="extra milliseconds per full block read")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    if args.decode_ms:
        slow_reads(args.decode_ms)
    langs = load_manifest(args.shards).languages
    torch.manual_seed(0)
    cfg = ModelConfig(arch="transformer", d_model=256, n_heads=4, encoder_layers=3, decoder_layers=3, ffn_dim=1024,
                      dropout=0.1, max_positions=256)
    model = build_model(cfg, ByteVocab(langs).size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run_round(model, opt, args.shards, 0, 2, args.max_tokens)  # warm-up
    rows = {0: [], args.workers: []}
    for _ in range(args.rounds):
        for w in rows:
            rows[w].append(run_round(model, opt, args.shards, w, args.steps, args.max_tokens))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"CPU {cpu}, {os.cpu_count()} cores, training threads {args.threads}, {args.steps} steps x "
          f"{args.rounds} interleaved rounds, extra decode {args.decode_ms} ms per block")
    print(f"{'loader':<22}{'s/step':>10}{'data wait ms/step':>20}")
    for w, r in rows.items():
        name = "in-process" if w == 0 else f"{w} workers"
        print(f"{name:<22}{statistics.median(t for t, _ in r):>10.3f}"
              f"{1000 * statistics.median(d for _, d in r):>20.1f}")
    ratios = sorted(a[0] / b[0] for a, b in zip(rows[0], rows[args.workers]))
    print(f"RATIO step time in-process / {args.workers} workers (>1: workers faster): "
          f"median {statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
