"""Expert parallelism for one MoCE expert mixture (Ada-MSHA) on 2 CPU ranks (gloo): ep_size=1 vs 2.

Each rank holds its own tokens (q, k, v of B sentences x H heads x T positions, head dim Dh).
ep=1: every rank holds all conv experts and computes its routed slots locally (the CPU routed path,
``scaletrain/models/moce_routed.py``). ep=2: each conv expert lives on one rank
(``scaletrain/models/moce_ep.py``): the routed windows (k Dh values per slot) travel to the expert's
rank and the results (Dh values) come back. Reported per rank: conv-expert parameter memory, the
all-to-all volume of a training step (forward dispatch + combine and their reverse in backward;
what stays on the rank is not counted), fwd+bwd time (median of interleaved rounds), and the
arithmetic the exchange replaces, to say when it pays: a slot sent away saves 2 k Dh^2 FLOPs of
expert work and costs (k + 1) Dh elements each way.

    python benchmarks/bench_expert_parallel_moce.py [--delta 5 --head-dim 64 --heads 8 --batch 16 --len 64]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_expert_parallel import _Volume, launch, run_args  # noqa: E402  (byte counting, 2-rank launch, options)
from scaletrain.models.convattn import MoCEExperts  # noqa: E402
from scaletrain.parallel import ParallelContext, build_parallel_context  # noqa: E402


def kernels_for(delta: int) -> list[int]:
    """MoCE Δ: experts {0 (identity), 1, 3, ..., 2Δ-1}."""
    return [0] + [2 * i - 1 for i in range(1, delta + 1)]


def _step(layer, z, pad, lang):
    z = z.clone().requires_grad_()
    y = layer(z, pad, None, lang)
    y.square().mean().backward()


def _worker(rank: int, world: int, port: int, a) -> None:
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    kernels = kernels_for(a.delta)
    layers = {}
    for ep, ctx in ((1, ParallelContext.single()), (2, build_parallel_context(2))):
        torch.manual_seed(0)
        layers[ep] = MoCEExperts(kernels, a.head_dim, 2, lid=False, n_langs=1, dispatch="routed", parallel=ctx)
    g = torch.Generator().manual_seed(rank)
    z = torch.randn(3, a.batch, a.heads, a.len, a.head_dim, generator=g)
    pad = torch.zeros(a.batch, a.len, dtype=torch.bool)
    lang = torch.zeros(a.batch, dtype=torch.long)
    times, volume = {1: [], 2: []}, 0
    for r in range(a.warmup + a.rounds):
        for ep in (1, 2):
            dist.barrier()
            t = time.perf_counter()
            with _Volume() as v:
                _step(layers[ep], z, pad, lang)
            dist.barrier()
            if r >= a.warmup:
                times[ep].append(time.perf_counter() - t)
                volume = v.bytes if ep == 2 else volume
    mem = {ep: sum(p.numel() * p.element_size() for n, p in layers[ep].named_parameters() if not n.startswith("router"))
           for ep in (1, 2)}
    med = {ep: statistics.median(times[ep]) for ep in (1, 2)}
    if rank == 0:
        slots = 3 * a.batch * a.heads * a.len * 2
        print(f"MoCE experts: Δ={a.delta} (kernels {kernels}), head dim {a.head_dim}, {a.heads} heads, top-2, "
              f"{a.batch}x{a.len} tokens per rank ({slots} routed slots), 2 ranks, {a.threads} thread(s) each, "
              f"{a.rounds} rounds")
        print(f"{'':<8}{'expert KiB/rank':>16}{'a2a KiB/step/rank':>19}{'fwd+bwd ms':>12}")
        for ep in (1, 2):
            vol = volume / 2**10 if ep == 2 else 0.0
            print(f"ep={ep:<5}{mem[ep] / 2**10:>16.1f}{vol:>19.1f}{med[ep] * 1e3:>12.1f}")
        print(f"ep=2 / ep=1 throughput: {med[1] / med[2]:.3f}x; expert memory per rank {mem[2] / mem[1]:.2f}x")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--delta", type=int, default=5)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=8)
    launch(_worker, run_args(p).parse_args())


if __name__ == "__main__":
    main()
