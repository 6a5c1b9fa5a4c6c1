"""``scaletrain data stats DIR`` and ``scaletrain data verify DIR``: look at a prepared shard directory."""
from __future__ import annotations

import json


def _stats(args) -> int:
    from scaletrain.data.inspect import data_stats, format_stats

    splits = [s.strip() for s in args.splits.split(",") if s.strip()] if args.splits else None
    stats = data_stats(args.shard_dir, splits)
    if args.json:
        print(json.dumps(stats, indent=1, ensure_ascii=False))
    else:
        print(format_stats(stats))
    return 0


def _verify(args) -> int:
    from scaletrain.data.inspect import verify

    rep = verify(args.shard_dir, checksums=not args.no_checksums)
    for p in rep.problems:
        print(f"PROBLEM {p}")
    status = "OK" if rep.ok else f"FAILED ({len(rep.problems)} problem(s))"
    print(f"{args.shard_dir}: {rep.shards} shards, {rep.blocks} blocks, {rep.examples:,} examples decoded: {status}")
    return 0 if rep.ok else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("data", help="inspect a prepared shard directory (stats, verify)")
    sub = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")

    st = sub.add_parser("stats", help="per-direction pairs, bytes, length percentiles, filter counts")
    st.add_argument("shard_dir", help="directory written by `scaletrain prepare` (holds manifest.json)")
    st.add_argument("--splits", default=None, help="comma-separated splits (default: all in the manifest)")
    st.add_argument("--json", action="store_true", help="print the statistics as JSON")
    st.set_defaults(func=_stats)

    ve = sub.add_parser("verify", help="check sizes, checksums, tar tables and decode every block; "
                                       "exits 1 naming each bad shard")
    ve.add_argument("shard_dir", help="directory written by `scaletrain prepare` (holds manifest.json)")
    ve.add_argument("--no-checksums", action="store_true", help="skip the sha256 pass (sizes and decoding only)")
    ve.set_defaults(func=_verify)
