"""DataLoader workers vs the in-process stream, measured on training steps over the SAME batches.

One training process (the `small` recipe's model, d 256, 3+3 layers, fp32, AdamW) trains from two
live iterators, in interleaved rounds of ``--steps`` steps each:

* ``workers``: ``ShardLoader(num_workers=W)``, forked once (as in a training run, which iterates one
  loader for the whole run);
* ``in-process``: the very same batch sequence made in this process (``ShardStream``; the workers read whole
  windows in turn and do not change the batches, checked equal to the workers' batches).

Both see identical batches in each round, so the per-round ratio of step times measures the loader and
nothing else.

Per round and loader: seconds per step, the data wait per step (time in ``next()``), the training
process's CPU per step and the workers' CPU per step (``/proc/<pid>/stat`` of the child processes).
Start-up is reported apart: fork to first batch, and the first training step after the fork, which pays
the copy-on-write of the trainer's memory (its minor page faults are printed).

``--decode-ms X`` makes every full block read X ms slower (sleeps: a stand-in for an expensive decode on
other cores, e.g. a subword tokenizer or a remote read). Blocks are read a window at a time, so use a
small ``--buffer-size`` (blocks per batch slot and window; 2 gives a window every ~20 steps here) to see it:
in process the step pays for it, workers read ahead and hide it.

    OMP_NUM_THREADS=1 python benchmarks/bench_loader_workers.py [--workers 2] [--steps 20] [--rounds 5]
        [--decode-ms 0] [--buffer-size 16]

``--data-only N``: no training; read N batches from ``ShardLoader(num_workers=W)`` (after the first) and print
the consuming process's CPU, the workers' CPU and the wall time per batch, and the process's peak RSS: the
data side alone, which the training steps of a 2-core machine drown.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from scaletrain.data import stream as stream_mod  # noqa: E402
from scaletrain.data.loader import ShardLoader  # noqa: E402
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


def same_batches_in_process(shards: str, **kw):
    """The batch sequence of ``ShardLoader(shards, num_workers=W, **kw)`` made in this process: the stream's own
    (the workers read whole windows in turn, the loader yields them in order)."""
    yield from stream_mod.ShardStream(shards, "train", **kw)


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's live child processes (the DataLoader workers)."""
    total, me, tick = 0.0, os.getpid(), os.sysconf("SC_CLK_TCK")
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(f[1]) == me:
                total += (int(f[11]) + int(f[12])) / tick
    return total


def train_steps(model, opt, it, steps: int) -> dict:
    """``steps`` training steps on batches from ``it``: wall, data wait, own CPU, workers' CPU, page faults."""
    c0, k0, f0 = time.process_time(), children_cpu(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    wait, t0 = 0.0, time.perf_counter()
    for _ in range(steps):
        w0 = time.perf_counter()
        b = next(it)
        wait += time.perf_counter() - w0
        logits = model(b.src, b.tgt_in)
        loss, _, ntok = label_smoothed_ce(logits, b.tgt_out, epsilon=0.1, ignore_index=PAD)
        (loss / ntok).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"step": (time.perf_counter() - t0) / steps, "wait": wait / steps,
            "cpu": (time.process_time() - c0) / steps, "wcpu": (children_cpu() - k0) / steps,
            "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps}


def check_same(shards: str, workers: int, n: int, **kw) -> None:
    """The in-process sequence equals the workers' one (first ``n`` batches), or stop."""
    a = iter(ShardLoader(shards, "train", num_workers=workers, **kw))
    b = same_batches_in_process(shards, **kw)
    for i in range(n):
        x, y = next(a), next(b)
        if not (torch.equal(x.src, y.src) and torch.equal(x.tgt_out, y.tgt_out)):
            raise SystemExit(f"batch {i} differs between the workers and the in-process sequence")


def data_only(args, **kw) -> None:
    it = iter(ShardLoader(args.shards, "train", num_workers=args.workers, **kw))
    next(it)  # the fork and the first window
    n = args.data_only
    c0, k0, t0 = time.process_time(), children_cpu(), time.perf_counter()
    for _ in range(n):
        next(it)
    per = {"consumer CPU": time.process_time() - c0, "workers CPU": children_cpu() - k0,
           "wall": time.perf_counter() - t0}
    print(f"load average {os.getloadavg()[0]:.2f}; {n} batches, {args.workers} workers: "
          + ", ".join(f"{k} {1000 * v / n:.3f} ms" for k, v in per.items()) + " per batch; peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


def report(args, rows: dict, start: dict) -> None:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"CPU {cpu}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, training threads "
          f"{args.threads}, {args.steps} steps x {args.rounds} interleaved rounds, buffer_size {args.buffer_size}, "
          f"extra decode {args.decode_ms} ms per block")
    print(f"start-up of {args.workers} workers: first batch after {1000 * start['first']:.0f} ms; first step after the "
          f"fork {start['w']['step']:.3f} s with {start['w']['faults']:.0f} minor page faults (copy-on-write) vs "
          f"{start['p']['step']:.3f} s with {start['p']['faults']:.0f} in process; workers' CPU since the fork "
          f"{1000 * start['wcpu']:.1f} ms per batch trained")
    print(f"{'loader':<14}{'s/step':>8}{'data wait ms':>14}{'trainer CPU s':>15}{'workers CPU ms':>16}"
          f"{'faults':>8}   (per step, medians over rounds)")
    for name, r in rows.items():
        med = {k: statistics.median(x[k] for x in r) for k in r[0]}
        print(f"{name:<14}{med['step']:>8.3f}{1000 * med['wait']:>14.1f}{med['cpu']:>15.3f}{1000 * med['wcpu']:>16.1f}"
              f"{med['faults']:>8.0f}")
    for k, what in (("step", "step time"), ("cpu", "trainer CPU")):
        ratios = sorted(a[k] / b[k] for a, b in zip(rows["in-process"], rows["workers"]))
        print(f"RATIO {what} in-process / {args.workers} workers (>1: workers faster): "
              f"median {statistics.median(ratios):.3f} [{ratios[0]:.3f}-{ratios[-1]:.3f}]")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", default="shards/django")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="training steps per round and loader")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the training process")
    ap.add_argument("--max-tokens", type=int, default=6000)
    ap.add_argument("--buffer-size", type=int, default=16, help="blocks per slot and shuffle window")
    ap.add_argument("--decode-ms", type=float, default=0.0, help="extra milliseconds per full block read")
    ap.add_argument("--data-only", type=int, default=0, metavar="N", help="no training: N batches, the data side's CPU")
    args = ap.parse_args()
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    kw = dict(max_tokens=args.max_tokens, max_bytes=160, seed=1, buffer_size=args.buffer_size)
    if args.data_only:
        data_only(args, **kw)
        return 0
    check_same(args.shards, args.workers, 24, **kw)
    if args.decode_ms:
        slow_reads(args.decode_ms)
    torch.manual_seed(0)
    cfg = ModelConfig(arch="transformer", d_model=256, n_heads=4, encoder_layers=3, decoder_layers=3, ffn_dim=1024,
                      dropout=0.1, max_positions=256)
    model = build_model(cfg, ByteVocab(load_manifest(args.shards).languages).size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    src = {"in-process": same_batches_in_process(args.shards, **kw)}
    b0 = next(src["in-process"])  # batch 0: warm-up twice in process, then the first step after the fork
    train_steps(model, opt, iter([b0]), 1)  # cold: first allocations
    start = {"p": train_steps(model, opt, iter([b0]), 1)}
    t0 = time.perf_counter()
    loader = ShardLoader(args.shards, "train", num_workers=args.workers, **kw)
    src["workers"] = iter(loader)
    first = next(src["workers"])  # batch 0 again (identical sequences)
    start["first"] = time.perf_counter() - t0
    start["w"] = train_steps(model, opt, iter([first]), 1)
    rows: dict = {name: [] for name in src}
    for _ in range(args.rounds):
        for name, it in src.items():
            rows[name].append(train_steps(model, opt, it, args.steps))
    start["wcpu"] = children_cpu() / (1 + args.rounds * args.steps)  # the workers' CPU since the fork, per batch
    report(args, rows, start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
