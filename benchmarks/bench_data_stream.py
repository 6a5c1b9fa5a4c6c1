"""Stream throughput, shard overhead and padding waste, measured in one run.

Corpora (both real text):
* ``django``: the bundled gettext corpus (14 languages <-> en), as ``prepare`` writes it by default;
* ``opus``: an OPUS-100-layout corpus of ``--pairs`` pairs made by repeating the django pairs with a
  distinct id per line, through ``prepare --source opus100`` (1024-example blocks).

Printed per corpus:
* raw reading of the same tar files (the limit): plain ``read()`` of each file, and Python's
  ``tarfile`` iterating members; expressed as payload MB/s (UTF-8 bytes of both sides carried);
* ``ShardStream`` (one process = one worker) over one epoch: payload MB/s and batches/s, with
  the ratio to the raw-read limit;
* ``ShardLoader`` in this process and with 1 and 2 DataLoader worker processes, in the same run,
  3 epochs each: batches/s (wall, worker start-up included) and the ratio to the in-process
  loader, plus the training process's CPU time per batch (what the workers take off the training
  loop);
* a naive one-pair-per-sample WebDataset layout (``webdataset`` + per-pair decode + collate) on
  the same pairs, the common layout the shard format is measured against;
* shard overhead: tar bytes / UTF-8 payload (target <= 1.15);
* padding waste of the bucketed token-budget batches: padded tokens / all tokens (target <= 10%),
  per budget (``--max-tokens`` and the training default 4096) and window size, with the mean batch
  fill (padded tokens / budget); on the django corpus also the optimal cut of the same order (a
  dynamic programme over cut points at the same batch count), the bound for any cut of that order.

    python benchmarks/bench_data_stream.py --pairs 200000
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from scaletrain.data.batch import Example, collate  # noqa: E402
from scaletrain.data.shards import load_manifest, read_split  # noqa: E402
from scaletrain.data.batching import greedy_cut, hilbert_index  # noqa: E402
from scaletrain.data.loader import ShardLoader  # noqa: E402
from scaletrain.data.stream import ShardStream  # noqa: E402

MB = 1e6


def payload(shard_dir: Path, split: str = "train") -> int:
    info = load_manifest(shard_dir).split(split)
    return sum(d.src_bytes + d.tgt_bytes for d in info.directions.values())


def raw_read(shard_dir: Path) -> tuple[float, float, int]:
    files = [shard_dir / sh.name for sh in load_manifest(shard_dir).split("train").shards]
    t = time.perf_counter()
    n = 0
    for f in files:
        with open(f, "rb") as fh:
            n += len(fh.read())
    t_read = time.perf_counter() - t
    t = time.perf_counter()
    for f in files:
        with tarfile.open(f, "r|") as tar:
            for m in tar:
                tar.extractfile(m).read()
    t_tar = time.perf_counter() - t
    return t_read, t_tar, n


def run_stream(shard_dir: Path, max_tokens: int, max_bytes: int, buffer: int, workers: int | None, epochs: int = 1):
    """(wall s, cpu s of this process, batches, real tokens, padded tokens) for ``epochs`` epochs of rank 0
    of 1. ``workers=None``: ShardStream; else ShardLoader with that many workers (0 = in this process).
    Timed from the start, worker start-up included (run 2+ epochs to amortise it)."""
    kw = dict(max_tokens=max_tokens, max_bytes=max_bytes, epochs=epochs, buffer_size=buffer)
    t, c = time.perf_counter(), time.process_time()
    it = ShardStream(shard_dir, "train", **kw) if workers is None else \
        ShardLoader(shard_dir, "train", num_workers=workers, **kw)
    nb = real = padded = 0
    for b in it:
        nb += 1
        real += b.n_src_tokens + b.n_tgt_tokens
        padded += b.padded_tokens
    return time.perf_counter() - t, time.process_time() - c, nb, real, padded


def optimal_cut(s: np.ndarray, t: np.ndarray, max_tokens: int, n_batches: int) -> list[int]:
    """Cut points of the order (s, t) with the fewest padded tokens among cuts into at most
    ``n_batches`` budget-respecting batches (dynamic programme, Lagrangian on the batch count):
    the best any cut of this order can do at that count. O(n * batch size): small corpora only."""
    n = len(s)

    def solve(lam):
        f = np.full(n + 1, np.inf)
        f[0] = 0.0
        arg = np.zeros(n + 1, np.int64)
        for j in range(1, n + 1):
            lo = max(0, j - max_tokens // 3)
            ss = np.maximum.accumulate(s[lo:j][::-1])
            tt = np.maximum.accumulate(t[lo:j][::-1])
            size = np.arange(1, j - lo + 1)
            c = size * (ss + tt)
            tot = np.where((c <= max_tokens) | (size == 1), f[j - size] + c + lam, np.inf)
            k = int(np.argmin(tot))
            f[j], arg[j] = tot[k], j - (k + 1)
        bounds = [n]
        while bounds[-1] > 0:
            bounds.append(int(arg[bounds[-1]]))
        return bounds[::-1]

    lam = float(max_tokens)
    bounds = solve(lam)
    while len(bounds) - 1 > n_batches:  # penalise batches more until the count is matched
        lam *= 2
        bounds = solve(lam)
    return bounds


def padding(shard_dir: Path, max_tokens: int, max_bytes: int, buffer: int, dp: bool = False) -> dict:
    """Padding waste and batch count of one epoch's plans (lengths only): the stream's Hilbert order
    vs the baseline sort by (longer side, sum) that the stream used before, same windows; ``dp``: also
    the optimal cut of the Hilbert order at the greedy cut's batch count.
    Per order: [padded tokens, real tokens, batches]."""
    s = ShardStream(shard_dir, "train", max_tokens=max_tokens, max_bytes=max_bytes, buffer_size=buffer)
    out = {"hilbert": [0, 0, 0], "longer-side sort": [0, 0, 0]}
    if dp:
        out["hilbert, optimal cut"] = [0, 0, 0]
    for w in range(s.n_windows):
        for slot, ids in enumerate(s.planner.slot_blocks(0, w)):
            sl, tl = s.planner.lengths(s.blocks.read(ids, lengths_only=True))
            rng = np.random.default_rng([0, w, slot])
            perm = rng.permutation(len(sl))
            a, b = sl[perm], tl[perm]
            orders = {"hilbert": np.argsort(hilbert_index(a, b), kind="stable"),
                      "longer-side sort": np.lexsort((a + b, np.maximum(a, b)))}
            if dp:
                orders["hilbert, optimal cut"] = orders["hilbert"]
            for name, o in orders.items():
                x, y = a[o], b[o]
                bounds = greedy_cut(x, y, max_tokens)
                if name == "hilbert, optimal cut":
                    bounds = optimal_cut(x, y, max_tokens, len(bounds) - 1)
                r = out[name]
                for lo, hi in zip(bounds[:-1], bounds[1:]):
                    r[0] += (hi - lo) * (int(x[lo:hi].max()) + int(y[lo:hi].max()))
                r[1] += int((x + y).sum())
                r[2] += len(bounds) - 1
    return out


def naive_webdataset(shard_dir: Path, work: Path, limit: int, max_bytes: int) -> tuple[float, int]:
    """One tar member pair (.src/.tgt/.json) per example, read with webdataset, collated per 64."""
    import json

    import webdataset as wds

    exs = read_split(shard_dir, "train")[:limit]
    path = work / "naive-000000.tar"
    with tarfile.open(path, "w") as tar:
        for i, e in enumerate(exs):
            for ext, data in (("src", e.src), ("tgt", e.tgt),
                              ("json", json.dumps({"s": e.src_lang, "t": e.tgt_lang}).encode())):
                ti = tarfile.TarInfo(f"{i:09d}.{ext}")
                ti.size = len(data)
                tar.addfile(ti, io.BytesIO(data))
    t = time.perf_counter()
    ds = wds.WebDataset(str(path), shardshuffle=False).decode()
    buf, n = [], 0
    for s in ds:
        meta = s["json"]
        buf.append(Example(meta["s"], meta["t"], s["src"], s["tgt"]))
        n += len(s["src"]) + len(s["tgt"])
        if len(buf) == 64:
            collate(buf, max_bytes)
            buf = []
    return time.perf_counter() - t, n


def make_opus(work: Path, n: int) -> Path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_data_memory import real_pairs, write_corpus

    from scaletrain.prepare import prepare_opus100

    root, out = work / "opus_src", work / "opus"
    write_corpus(root, n, real_pairs())
    prepare_opus100(root, out, progress=False, overwrite=True)
    # a small valid split is not needed for streaming; stats only concern train
    return out


def corpus_args(ap: argparse.ArgumentParser, pairs: int, workdir: str) -> argparse.ArgumentParser:
    """The corpus options of the data benchmarks that stream a generated OPUS-layout corpus."""
    ap.add_argument("--pairs", type=int, default=pairs, help="pairs of the OPUS-layout corpus")
    ap.add_argument("--workdir", default=workdir)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--max-bytes", type=int, default=800)
    return ap


def fresh_opus(a: argparse.Namespace) -> Path:
    """One torch thread, an emptied ``a.workdir``, and a corpus of ``a.pairs`` pairs sharded in it."""
    torch.set_num_threads(1)
    work = Path(a.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return make_opus(work, a.pairs)


def main() -> None:
    ap = corpus_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), 200_000, "/tmp/bench_data_stream")
    ap.add_argument("--naive-pairs", type=int, default=20_000)
    ap.add_argument("--buffer", type=int, default=64, help="stream buffer_size (blocks per batch slot per window)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(a.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    from scaletrain.prepare import prepare_gettext

    corpora = {"django": prepare_gettext(out=work / "django", progress=False) and work / "django",
               "opus": make_opus(work, a.pairs)}
    for name, d in corpora.items():
        m = load_manifest(d)
        info = m.split("train")
        pay = payload(d)
        tar_bytes = sum(sh.bytes for sh in info.shards)
        print(f"\n== {name}: {info.n_examples:,} train examples, {len(info.shards)} shards, {info.n_blocks} blocks, "
              f"payload {pay / MB:.1f} MB ==")
        raw_read(d)  # warm the page cache; the second pass is the one that counts
        t_read, t_tar, _ = raw_read(d)
        runs = [run_stream(d, a.max_tokens, a.max_bytes, a.buffer, None) for _ in range(2)]
        t_s, c_s, nb, real, padded = min(runs, key=lambda r: r[1])
        loaders = {w: run_stream(d, a.max_tokens, a.max_bytes, a.buffer, w, epochs=3) for w in (0, 1, 2)}
        t_n, n_naive = naive_webdataset(d, work, a.naive_pairs, a.max_bytes)
        limit = pay / t_tar / MB
        print(f"{'reader':<34}{'payload MB/s':>13}{'batches/s':>11}{'MB/s/worker':>12}{'vs tarfile':>11}")
        rows = [
            ("raw file read() (page cache)", pay / t_read / MB, None, pay / t_read / MB),
            ("raw tarfile member reads", limit, None, limit),
            ("ShardStream, 1 worker (wall)", pay / t_s / MB, nb / t_s, pay / t_s / MB),
            ("ShardStream, 1 worker (CPU time)", pay / c_s / MB, nb / c_s, pay / c_s / MB),
            ("naive 1-pair-per-sample wds", n_naive / t_n / MB, None, n_naive / t_n / MB),
        ]
        for label, mbs, bps, per in rows:
            print(f"{label:<34}{mbs:>13.1f}{(f'{bps:.0f}' if bps else '-'):>11}{per:>12.1f}{mbs / limit:>11.3f}")
        t0 = loaders[0][0]
        print(f"ShardLoader, 3 epochs, wall incl. start-up (load average {os.getloadavg()[0]:.1f}):")
        print(f"  {'workers':<22}{'batches/s':>10}{'payload MB/s':>13}{'vs in-process':>14}{'main CPU ms/batch':>19}")
        for w, (tw, cw, nbw, _, _) in loaders.items():
            label = "0 (in this process)" if w == 0 else f"{w} worker process{'es' if w > 1 else ''}"
            print(f"  {label:<22}{nbw / tw:>10.0f}{3 * pay / tw / MB:>13.1f}{t0 / tw:>14.2f}{1e3 * cw / nbw:>19.3f}")
        per_worker = pay / c_s / MB
        print(f"stream (CPU time) / naive wds: {per_worker / (n_naive / t_n / MB):.0f}x; target >= 25 MB/s per worker: "
              f"{'met' if per_worker >= 25 else 'NOT met'} ({per_worker:.1f} MB/s per CPU-second)")
        print(f"shard overhead: tar bytes / payload = {tar_bytes:,} / {pay:,} = {tar_bytes / pay:.3f} (target <= 1.15)")
        print(f"padding waste of the stream's batches (buffer {a.buffer} blocks, max_tokens {a.max_tokens}): "
              f"{100 * (1 - real / padded):.2f}% (target <= 10%); plans by budget, order and window size:")
        for mt in sorted({4096, a.max_tokens}):
            for buf in sorted({16, a.buffer, 4 * a.buffer}):
                p = padding(d, mt, a.max_bytes, buf, dp=name == "django" and buf == a.buffer)
                base = p["longer-side sort"]
                for order, (pad, rl, n) in p.items():
                    print(f"  max_tokens {mt:>6} buffer {buf:>4} {order:<21} waste {100 * (1 - rl / pad):6.2f}%  "
                          f"batches {n:>6}  fill {pad / (n * mt):5.3f}  padded tokens vs longer-side sort "
                          f"{pad / base[0]:.3f}")


if __name__ == "__main__":
    main()
