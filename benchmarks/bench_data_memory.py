"""Constant memory: peak RSS of `prepare` and of the training stream vs corpus size.

For each size N (pairs) an OPUS-100-layout corpus is written by repeating the real django
gettext corpus (14 languages, en<->xx) with a distinct id prefixed to every line, streamed from a
generator (never held in memory). Then, each in a fresh process:

* ``prepare``: ``prepare_opus100`` with ``--workers`` processes; peak RSS of the main process
  and of the largest worker;
* ``stream``: ``ShardStream`` (rank 0 of 2) over the N-pair train split: the first
  ``--stream-batches`` batches, then a jump (``load_state_dict``) to the last window of the epoch
  and ``--stream-batches`` more; peak RSS of that process.

Printed: absolute peaks, and each size's peak as a ratio of the smallest size's (the target:
growth 1M -> 55M <= 10%, i.e. ratio <= 1.10).

``--link-sizes`` adds stream-only points without running prepare again: the shards of the largest
prepared size are hard-linked under new shard names until the manifest lists that many pairs
(a real manifest of that size: shard and block tables, direction counts; the text repeats).

    python benchmarks/bench_data_memory.py 1e6 1e7 5.5e7 --workdir /tmp/bench_mem --workers 2
    python benchmarks/bench_data_memory.py 1e6 1e7 --link-sizes 5.5e7 --workdir /tmp/bench_mem
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PREPARE_CHILD = r"""
import json, resource, sys
from scaletrain.prepare import prepare_opus100
root, out, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
m = prepare_opus100(root, out, workers=workers, progress=False, overwrite=True)
own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"main_kb": own, "worker_kb": kids, "examples": m.splits["train"].n_examples,
                  "shards": len(m.splits["train"].shards), "blocks": m.splits["train"].n_blocks}))
"""

STREAM_CHILD = r"""
import json, resource, sys
from scaletrain.data.stream import ShardStream
out, k = sys.argv[1], int(sys.argv[2])
s = ShardStream(out, "train", rank=0, world_size=2, max_tokens=16384, max_bytes=800, buffer_size=64)
n = 0
for i, b in zip(range(k), s):
    n += b.padded_tokens
st = s.state_dict()
st["window"], st["batch"] = s.n_windows - 1, 0
s.load_state_dict(st)
for i, b in zip(range(k), s):
    n += b.padded_tokens
print(json.dumps({"kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "windows": s.n_windows,
                  "tokens": n}))
"""


def real_pairs():
    from scaletrain.prepare.gettext import read_gettext

    c = read_gettext("django")
    return {l: [(en.replace("\n", " "), xx.replace("\n", " ")) for en, xx in c.pairs[l]] for l in c.langs}


def write_corpus(root: Path, n: int, pairs: dict) -> int:
    """n pairs spread over the languages in proportion to their real counts; returns input bytes."""
    sup = root / "opus-100-corpus" / "v1.0" / "supervised"
    total = sum(len(v) for v in pairs.values())
    langs = sorted(pairs)
    written = 0
    nbytes = 0
    for k, lang in enumerate(langs):
        m = n - written if k == len(langs) - 1 else n * len(pairs[lang]) // total
        written += m
        d = sup / f"en-{lang}"
        d.mkdir(parents=True, exist_ok=True)
        base = pairs[lang]
        with open(d / f"opus.en-{lang}-train.en", "w", encoding="utf-8") as fe, \
                open(d / f"opus.en-{lang}-train.{lang}", "w", encoding="utf-8") as fx:
            chunk = 100_000
            for start in range(0, m, chunk):
                ids = range(start, min(m, start + chunk))
                e = "".join(f"{i} {base[i % len(base)][0]}\n" for i in ids)
                x = "".join(f"{i} {base[i % len(base)][1]}\n" for i in ids)
                fe.write(e)
                fx.write(x)
                nbytes += len(e.encode()) + len(x.encode())
    return nbytes


def link_shards(src: Path, dst: Path, pairs: int) -> int:
    """A shard directory of about ``pairs`` pairs (both directions: 2x examples) made of hard links to
    the train shards of ``src``; returns the number of blocks."""
    import math

    from scaletrain.data.shards import DirectionStats, Manifest, ShardInfo, SplitInfo, load_manifest, write_manifest

    m = load_manifest(src)
    tr = m.split("train")
    reps = math.ceil(2 * pairs / tr.n_examples)
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    shards, k = [], 0
    for _ in range(reps):
        for sh in tr.shards:
            name = f"train-{k:06d}.tar"
            os.link(src / sh.name, dst / name)
            d = sh.to_dict()
            d["name"] = name
            shards.append(ShardInfo.from_dict(d))
            k += 1
    dirs = {key: DirectionStats(v.n * reps, v.src_bytes * reps, v.tgt_bytes * reps) for key, v in tr.directions.items()}
    write_manifest(dst, Manifest(m.languages, {"train": SplitInfo(tr.n_examples * reps, shards, dirs)},
                                 source={"type": "hard links", "from": str(src), "copies": reps}))
    return sum(s.n_blocks for s in shards)


def child(code: str, *args: str) -> tuple[dict, float]:
    t = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"child failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1]), time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sizes", nargs="*", default=["1e6", "1e7", "5.5e7"], help="corpus sizes in pairs")
    ap.add_argument("--workdir", default="/tmp/bench_data_memory", help="scratch directory (needs ~200 bytes/pair)")
    ap.add_argument("--workers", type=int, default=2, help="prepare worker processes")
    ap.add_argument("--stream-batches", type=int, default=300, help="batches read at the start and at the end")
    ap.add_argument("--keep", action="store_true", help="keep the corpora and shards")
    ap.add_argument("--link-sizes", nargs="*", default=[], help="stream-only sizes built by hard-linking the "
                    "largest prepared size's shards")
    a = ap.parse_args()
    sizes = [int(float(s)) for s in a.sizes]
    work = Path(a.workdir)
    pairs = real_pairs()
    print(f"real corpus: {sum(len(v) for v in pairs.values()):,} pairs, {len(pairs)} languages; "
          f"prepare workers={a.workers}; stream rank 0/2, {a.stream_batches}+{a.stream_batches} batches", flush=True)
    rows = []
    for n in sizes:
        root, out = work / f"opus_{n}", work / f"shards_{n}"
        shutil.rmtree(root, ignore_errors=True)
        t = time.perf_counter()
        nbytes = write_corpus(root, n, pairs)
        t_gen = time.perf_counter() - t
        prep, t_prep = child(PREPARE_CHILD, str(root), str(out), str(a.workers))
        strm, t_strm = child(STREAM_CHILD, str(out), str(a.stream_batches))
        disk = sum(p.stat().st_size for p in out.glob("*.tar"))
        rows.append(dict(n=n, in_mb=nbytes / 1e6, shard_mb=disk / 1e6, gen_s=t_gen, prep_s=t_prep, strm_s=t_strm,
                         prep_main=prep["main_kb"] / 1024, prep_worker=prep["worker_kb"] / 1024,
                         stream=strm["kb"] / 1024, blocks=prep["blocks"], windows=strm["windows"]))
        r = rows[-1]
        print(f"  N={n:,}: input {r['in_mb']:.0f} MB, shards {r['shard_mb']:.0f} MB, {r['blocks']:,} blocks; "
              f"write {t_gen:.0f}s, prepare {t_prep:.0f}s ({n / t_prep / 1e3:.0f}k pairs/s), stream {t_strm:.0f}s; "
              f"peak RSS prepare main {r['prep_main']:.0f} MB / worker {r['prep_worker']:.0f} MB, "
              f"stream {r['stream']:.0f} MB", flush=True)
        shutil.rmtree(root, ignore_errors=True)
        if not a.keep and n != sizes[-1]:
            shutil.rmtree(out, ignore_errors=True)
    for n in (int(float(x)) for x in a.link_sizes):
        out = work / f"linked_{n}"
        blocks = link_shards(work / f"shards_{sizes[-1]}", out, n)
        strm, t_strm = child(STREAM_CHILD, str(out), str(a.stream_batches))
        rows.append(dict(n=n, blocks=blocks, prep_main=float("nan"), prep_worker=float("nan"), stream=strm["kb"] / 1024))
        print(f"  N={n:,} (hard-linked shards, stream only): {blocks:,} blocks; stream {t_strm:.0f}s; "
              f"peak RSS stream {rows[-1]['stream']:.0f} MB", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    if not a.keep:
        shutil.rmtree(work / f"shards_{sizes[-1]}", ignore_errors=True)
    b = rows[0]
    print()
    print(f"{'pairs':>12} {'blocks':>8} {'prep main MB':>13} {'ratio':>6} {'prep worker MB':>15} {'ratio':>6} "
          f"{'stream MB':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['n']:>12,} {r['blocks']:>8,} {r['prep_main']:>13.0f} {r['prep_main'] / b['prep_main']:>6.3f} "
              f"{r['prep_worker']:>15.0f} {r['prep_worker'] / max(b['prep_worker'], 1e-9):>6.3f} "
              f"{r['stream']:>10.0f} {r['stream'] / b['stream']:>6.3f}")
    ratios = [x for r in rows for x in (r["prep_main"] / b["prep_main"], r["prep_worker"] / max(b["prep_worker"], 1e-9),
                                         r["stream"] / b["stream"]) if x == x]  # nan: not measured
    worst = max(ratios)
    print(f"largest growth vs {b['n']:,} pairs: {100 * (worst - 1):.1f}% (target <= 10%)")


if __name__ == "__main__":
    main()
