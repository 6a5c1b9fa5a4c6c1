"""The scaling model's 2-rank predictions against 2-rank measurements (CPU, gloo, DeepSpeed ZeRO 0-3).

    python benchmarks/scaling_check.py [--recipe small] [--steps 6] [--warmup 2] [--stages 0,1,2,3]

For each ZeRO stage, two CPU ranks (``deepspeed --num_gpus 2``, one thread each) train the recipe's
model on the bundled shards (fp32, the recipe's batch) through scaletrain's own engine, and every
collective DeepSpeed launches is counted: bytes each rank sends per update, in ring terms (all-reduce
2 (N-1)/N x size, reduce-scatter / all-gather / broadcast (N-1)/N x the full size). One rank alone
gives the compute-only step time, and a timed gloo all-reduce of 32 MiB gives the link's effective
bandwidth. ``scaling_model.py`` then predicts, per stage, the bytes per rank (``comm_bytes`` with the
recipe's parameter count and 4-byte elements) and the step time (single-rank step + volume /
bandwidth, no overlap); the table puts them next to the measurements.

The 2-rank run shares 2 cores with nothing else only on an idle machine; read the times with the
load average printed beside them. The byte counts do not depend on the load.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

_RING = {  # bytes sent per rank, as a multiple of the tensor's size, for N ranks
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_reduce_coalesced": lambda n: 2 * (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,  # size of the full input
    "_reduce_scatter_base": lambda n: (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,  # size of the full output
    "_all_gather_base": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "reduce": lambda n: (n - 1) / n,
}


class CollectiveCounter:
    """Wraps torch.distributed's collectives (before DeepSpeed caches them) and sums ring bytes."""

    def __init__(self):
        import torch.distributed as dist

        self.bytes, self.calls = 0.0, 0
        self.by_op: dict[str, float] = {}
        for name, factor in _RING.items():
            orig = getattr(dist, name, None) or getattr(dist.distributed_c10d, name, None)
            if orig is None:
                continue
            wrapped = self._wrap(orig, name, factor)
            setattr(dist, name, wrapped)
            if hasattr(dist.distributed_c10d, name):
                setattr(dist.distributed_c10d, name, wrapped)

    def _wrap(self, orig, name, factor):
        import torch
        import torch.distributed as dist

        def counted(*args, **kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            lists = [a for a in list(args) + list(kwargs.values()) if isinstance(a, (list, tuple))]
            if name in ("all_reduce_coalesced",):
                size = sum(t.numel() * t.element_size() for lst in lists for t in lst)
            elif tensors:
                size = max(t.numel() * t.element_size() for t in tensors)  # the full tensor of the two
            else:
                size = 0
            group = kwargs.get("group")
            n = dist.get_world_size(group) if group is not None else dist.get_world_size()
            self.bytes += factor(n) * size
            self.by_op[name] = self.by_op.get(name, 0.0) + factor(n) * size
            self.calls += 1
            return orig(*args, **kwargs)

        return counted


def worker(a) -> None:
    counter = CollectiveCounter()  # before DeepSpeed initialises its comm backend
    import torch
    import torch.distributed as dist

    from scaletrain.config import load_config
    from scaletrain.train import Trainer
    from scaletrain.train.unit import train_step

    torch.set_flush_denormal(True)
    cfg = load_config(a.recipe, [f"engine.ds_config=ds_configs/zero{a.stage}.json", "engine.precision=fp32",
                                 "engine.threads=1",  # the same compute per rank at 1 and 2 ranks
                                 f"train.out_dir={a.out}/run", "train.resume=false"])
    tr = Trainer(cfg)
    eng, it = tr.engine, iter(tr.stream)
    times, volumes = [], []
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            counter.by_op = {}
        micro = [next(it).to(eng.device) for _ in range(cfg.engine.grad_accum)]  # train_step takes them moved
        eng.parallel.barrier()
        b0, t0 = counter.bytes, time.perf_counter()
        train_step(eng, tr.unit, micro, stop_vote=False)
        eng.parallel.barrier()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
            volumes.append(counter.bytes - b0)
    by_op = {k: v / a.steps for k, v in counter.by_op.items()}  # before the bandwidth probe below
    bw = 0.0
    if eng.world_size > 1:
        x = torch.ones(8 * 2**20)  # 32 MiB fp32
        dist.all_reduce(x)
        t0 = time.perf_counter()
        for _ in range(3):
            dist.all_reduce(x)
        bw = _RING["all_reduce"](eng.world_size) * x.numel() * 4 * 3 / (time.perf_counter() - t0)
    params = sum(p.numel() for p in tr.build_model().parameters())
    if eng.rank == 0:
        res = {"stage": a.stage, "world": eng.world_size, "step_s": statistics.median(times),
               "bytes": statistics.median(volumes), "bw": bw, "params": params,
               "grad_accum": cfg.engine.grad_accum, "load": os.getloadavg()[0],
               "by_op": by_op}
        Path(a.out, f"result_{eng.world_size}_{a.stage}.json").write_text(json.dumps(res))
    tr.close()


def launch(nproc: int, stage: int, a, out: str) -> dict:
    exe = Path(sys.executable).with_name("deepspeed")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               MLFLOW_TRACKING_URI=f"sqlite:///{out}/mlruns.db")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [str(exe), "--num_gpus", str(nproc), "--master_port", str(port), "--no_local_rank", __file__, "--worker", "--stage", str(stage),
           "--out", out, "--recipe", a.recipe, "--steps", str(a.steps), "--warmup", str(a.warmup)]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(Path(out, f"result_{nproc}_{stage}.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="small")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    a, _ = ap.parse_known_args()
    if a.worker:
        worker(a)
        return 0
    import scaling_model as S

    with tempfile.TemporaryDirectory() as out:
        single = launch(1, 0, a, out)
        rows = [launch(2, int(s), a, out) for s in a.stages.split(",")]
    print(f"recipe {a.recipe}: {single['params'] / 1e6:.2f}M parameters, fp32; 1 rank: {single['step_s']:.3f} s/update "
          f"(compute only); gloo all-reduce bandwidth {rows[0]['bw'] / 1e9:.2f} GB/s; medians of {a.steps} updates")
    print(f"{'ZeRO':>5}{'pred MB/rank':>14}{'meas MB/rank':>14}{'ratio':>7}{'pred s/update':>15}{'meas s/update':>15}"
          f"{'ratio':>7}{'load':>6}")
    for r in rows:
        link = S.Link(intra_gbps=r["bw"] / 1e9, inter_gbps=r["bw"] / 1e9, gpus_per_node=2, latency_us=0.0)
        vol = S.comm_bytes(r["stage"], 2, r["params"], 4, r["grad_accum"])
        t = S.step_seconds(single["step_s"], S.comm_seconds(r["stage"], 2, r["params"], link, 4, r["grad_accum"]))
        print(f"{r['stage']:>5}{vol / 1e6:>14.1f}{r['bytes'] / 1e6:>14.1f}{r['bytes'] / vol:>7.2f}{t:>15.3f}"
              f"{r['step_s']:>15.3f}{r['step_s'] / t:>7.2f}{r['load']:>6.1f}")
        ops = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(r["by_op"].items(), key=lambda kv: -kv[1]) if v > 1e4)
        print(f"{'':>5}  measured MB/rank per update by collective: {ops}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
