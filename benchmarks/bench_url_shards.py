"""Streaming shards from a URL or a pipe: command against the local directory, measured in one run.

One epoch of ``ShardStream`` (rank 0 of ``--world``) per source, rounds interleaved, median wall time:
the directory; ``http://127.0.0.1`` (the tests' Range-capable server in a thread of this process: one
range request per block, no cache); the same URL with ``data.cache_dir`` (second epoch on: shards read
from the cache); ``pipe:cat DIR/{name}`` (whole shards into memory). Loopback only: what the per-request
overhead costs, not a network's bandwidth.

    python benchmarks/bench_url_shards.py --pairs 50000 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))


from scaletrain.data.shards import load_manifest  # noqa: E402
from scaletrain.data.sources import FetchOptions  # noqa: E402
from scaletrain.data.stream import ShardStream  # noqa: E402


def epoch(spec, fetch, world: int, max_tokens: int, max_bytes: int) -> float:
    t = time.perf_counter()
    for _ in ShardStream(spec, "train", rank=0, world_size=world, fetch=fetch, max_tokens=max_tokens,
                         max_bytes=max_bytes, epochs=1):
        pass
    return time.perf_counter() - t


def main() -> None:
    from bench_data_stream import corpus_args, fresh_opus
    from shard_server import ShardServer

    ap = corpus_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), 50_000, "/tmp/bench_url_shards")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--world", type=int, default=2, help="ranks of the plan (rank 0 is streamed)")
    a = ap.parse_args()
    work = Path(a.workdir)
    d = fresh_opus(a)
    info = load_manifest(d).split("train")
    with ShardServer(d.parent) as srv:
        url = f"{srv.url}/{d.name}"
        cached = FetchOptions(cache_dir=str(work / "cache"))
        sources = {"directory": (d, None), "http range": (url, None), "http + cache_dir": (url, cached),
                   "pipe:cat (memory)": (f"pipe:cat {d}/{{name}}", None)}
        epoch(url, cached, a.world, a.max_tokens, a.max_bytes)  # fill the cache and the page cache
        times: dict[str, list[float]] = {k: [] for k in sources}
        for r in range(a.rounds):
            names = list(sources) if r % 2 == 0 else list(reversed(sources))
            for k in names:
                times[k].append(epoch(*sources[k], a.world, a.max_tokens, a.max_bytes))
        n_req = srv.counter.get("requests", 0)
    base = statistics.median(times["directory"])
    print(f"{info.n_examples:,} train examples, {info.n_blocks} blocks, {sum(s.bytes for s in info.shards) / 1e6:.1f} "
          f"MB; rank 0 of {a.world}; {a.rounds} interleaved rounds; load average {os.getloadavg()[0]:.1f}; "
          f"{n_req} HTTP requests in all")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"  {k:<20} epoch wall s: median {m:.3f}  ({m / base:.2f}x the directory)")


if __name__ == "__main__":
    main()
