"""Expert parallelism for one MoE feed-forward layer on 2 CPU ranks (gloo): ep_size=1 vs ep_size=2.

Each rank holds its own tokens (B x T). ep=1: every rank holds all E experts and computes its own
tokens' experts locally (plain data parallel). ep=2: each rank holds E/2 experts and tokens travel
to the rank of their expert and back (scaletrain/parallel/exchange.py). Reported per rank: expert
parameter memory, the all-to-all volume of a training step (forward dispatch + combine and the
reverse exchanges in backward; rows that stay on their own rank are not counted) and fwd+bwd time;
ep=1 and ep=2 rounds alternate in the same run, and the ratio of the medians is given.
The expert-gradient reduction over the expert-data-parallel group is not part of the timing (with
2 ranks and ep=2 that group has one rank; at ep=1 it is the data-parallel all-reduce of the experts).

    python benchmarks/bench_expert_parallel.py [--dim 512 --ffn 2048 --experts 8 --batch 16 --len 64]
"""
from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaletrain.models.config import MoEConfig  # noqa: E402
from scaletrain.models.moe import MoEFeedForward  # noqa: E402
from scaletrain.parallel import ParallelContext, build_parallel_context  # noqa: E402
from scaletrain.parallel import exchange as X  # noqa: E402


class _Volume:
    """Counts the bytes this rank sends to other ranks through ``all_to_all_single`` (forward and backward):
    rows of a 2-D tensor, or elements of a 1-D stream (MoCE's windows, ``bench_expert_parallel_moce.py``)."""

    def __init__(self):
        self.bytes = 0
        self._orig = X.dist.all_to_all_single

    def __enter__(self):
        rank = dist.get_rank()

        def counted(out, inp, output_split_sizes=None, input_split_sizes=None, group=None):
            if input_split_sizes is not None:
                unit = (inp[0].numel() if inp.dim() > 1 and inp.shape[0] else 1) * inp.element_size()
                self.bytes += sum(n for r, n in enumerate(input_split_sizes) if r != rank) * unit
            return self._orig(out, inp, output_split_sizes, input_split_sizes, group=group)

        X.dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc):
        X.dist.all_to_all_single = self._orig


def launch(worker, args) -> None:
    """``worker(rank, 2, port, args)`` on 2 forked gloo ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(2, port, args), nprocs=2, start_method="fork")


def _step(layer, x):
    x = x.clone().requires_grad_()
    y = layer(x)
    (y.square().mean() + layer.aux_loss).backward()


def _worker(rank: int, world: int, port: int, a) -> None:
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    moe = MoEConfig(num_experts=a.experts, top_k=a.top_k, ep_size=2)
    layers = {}
    for ep, ctx in ((1, ParallelContext.single()), (2, build_parallel_context(2))):
        torch.manual_seed(0)
        layers[ep] = MoEFeedForward(a.dim, moe, a.ffn, "relu", 0.0, "auto", ctx)
    x = torch.randn(a.batch, a.len, a.dim, generator=torch.Generator().manual_seed(rank))
    times = {1: [], 2: []}
    volume = 0
    for r in range(a.warmup + a.rounds):
        for ep in (1, 2):
            dist.barrier()
            t = time.perf_counter()
            with _Volume() as v:
                _step(layers[ep], x)
            dist.barrier()
            if r >= a.warmup:
                times[ep].append(time.perf_counter() - t)
                volume = v.bytes if ep == 2 else volume
    mem = {ep: sum(p.numel() * p.element_size() for p in layers[ep].experts.parameters()) for ep in (1, 2)}
    med = {ep: statistics.median(times[ep]) for ep in (1, 2)}
    if rank == 0:
        tok = a.batch * a.len
        print(f"MoE-FFN layer: d {a.dim}, expert ffn {a.ffn}, {a.experts} experts, top-{a.top_k}, "
              f"{tok} tokens per rank, 2 ranks, {a.threads} thread(s) each, {a.rounds} rounds")
        print(f"{'':<8}{'expert MiB/rank':>16}{'a2a KiB/step/rank':>19}{'fwd+bwd ms':>12}{'tokens/s/rank':>15}")
        for ep in (1, 2):
            vol = volume / 2**10 if ep == 2 else 0.0
            print(f"ep={ep:<5}{mem[ep] / 2**20:>16.2f}{vol:>19.1f}{med[ep] * 1e3:>12.1f}{tok / med[ep]:>15.0f}")
        print(f"ep=2 / ep=1 throughput: {med[1] / med[2]:.3f}x; expert memory per rank {mem[2] / mem[1]:.2f}x")
    dist.destroy_process_group()


def run_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The batch and timing options both expert-parallel benchmarks take."""
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    return p


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    launch(_worker, run_args(p).parse_args())


if __name__ == "__main__":
    main()
