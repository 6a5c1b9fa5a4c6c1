"""Cost of checking every block's CRC-32 while streaming (``read_block``), measured in one run.

The same shards are streamed twice per round: from their directory (format-3 manifest: each block
checked against its CRC-32) and from a second directory whose manifest has no block checksums (format 2,
the tar files are symlinks to the same files: nothing checked). Rounds alternate the order; the
median CPU time of one epoch of ``ShardStream`` (rank 0 of 1) is compared. Also printed: the raw
``zlib.crc32`` speed on this machine.

    python benchmarks/bench_block_checksums.py --pairs 100000 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


from scaletrain.data.shards import MANIFEST, load_manifest  # noqa: E402
from scaletrain.data.stream import ShardStream  # noqa: E402


def unchecked_copy(src: Path, dst: Path) -> Path:
    """``dst``: symlinks to ``src``'s shards and a manifest without block checksums."""
    dst.mkdir(parents=True)
    d = json.loads((src / MANIFEST).read_text())
    d["format_version"] = 2
    for sp in d["splits"].values():
        for sh in sp["shards"]:
            sh["blocks"].pop("crc32", None)
            os.symlink(src / sh["name"], dst / sh["name"])
    (dst / MANIFEST).write_text(json.dumps(d))
    assert not load_manifest(dst).block_checksums and load_manifest(src).block_checksums
    return dst


def epoch_cpu(shard_dir: Path, max_tokens: int, max_bytes: int) -> tuple[float, int]:
    c = time.process_time()
    n = sum(b.size for b in ShardStream(shard_dir, "train", max_tokens=max_tokens, max_bytes=max_bytes, epochs=1))
    return time.process_time() - c, n


def main() -> None:
    from bench_data_stream import corpus_args, fresh_opus

    ap = corpus_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), 100_000, "/tmp/bench_block_checksums")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    checked = fresh_opus(a)
    unchecked = unchecked_copy(checked, Path(a.workdir) / "unchecked")
    info = load_manifest(checked).split("train")
    total = sum(sh.bytes for sh in info.shards)
    blob = (checked / info.shards[0].name).read_bytes()
    t = time.perf_counter()
    for _ in range(20):
        zlib.crc32(blob)
    crc_mbs = 20 * len(blob) / (time.perf_counter() - t) / 1e6
    epoch_cpu(checked, a.max_tokens, a.max_bytes)  # warm the page cache
    times: dict[str, list[float]] = {"checked": [], "unchecked": []}
    for r in range(a.rounds):
        order = ("checked", "unchecked") if r % 2 == 0 else ("unchecked", "checked")
        for name in order:
            cpu, n = epoch_cpu(checked if name == "checked" else unchecked, a.max_tokens, a.max_bytes)
            times[name].append(cpu)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{info.n_examples:,} train examples, {info.n_blocks} blocks, {total / 1e6:.1f} MB of shards; "
          f"{a.rounds} interleaved rounds, load average {os.getloadavg()[0]:.1f}")
    print(f"zlib.crc32 alone: {crc_mbs:,.0f} MB/s")
    for k, v in times.items():
        print(f"  {k:<10} epoch CPU s: median {med[k]:.3f}  (all: {', '.join(f'{x:.3f}' for x in v)})")
    print(f"checked / unchecked CPU time: {med['checked'] / med['unchecked']:.3f} "
          f"(+{100 * (med['checked'] / med['unchecked'] - 1):.1f}%)")


if __name__ == "__main__":
    main()
