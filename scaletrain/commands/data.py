"""`scaletrain data`: actions on a prepared shard directory.

    scaletrain data stats DIR                   # per-direction pairs, bytes, length percentiles, filters
    scaletrain data verify DIR                  # checksums + decode every block; names a bad shard
    (stats and verify also take an http(s):// URL or a pipe:COMMAND, see scaletrain.data.sources)
    scaletrain data spm DIR --vocab-size N      # add a SentencePiece BPE model to prepared shards
    scaletrain data export DIR --split test --out TXT [--direction de-en]
                                                # line-aligned plain text, one file pair per direction

``data spm`` has the same options as ``prepare --spm-vocab-size`` (see ``scaletrain.prepare.spm_train``).
"""
from __future__ import annotations

import json


def _stats(args) -> int:
    from scaletrain.data.inspect_shards import data_stats, format_stats

    splits = [s.strip() for s in args.splits.split(",") if s.strip()] if args.splits else None
    stats = data_stats(args.shard_dir, splits)
    if args.json:
        print(json.dumps(stats, indent=1, ensure_ascii=False))
    else:
        print(format_stats(stats))
    return 0


def _verify(args) -> int:
    from scaletrain.data.inspect_shards import verify

    rep = verify(args.shard_dir, checksums=not args.no_checksums)
    for p in rep.problems:
        print(f"PROBLEM {p}")
    status = "OK" if rep.ok else f"FAILED ({len(rep.problems)} problem(s))"
    print(f"{args.shard_dir}: {rep.shards} shards, {rep.blocks} blocks, {rep.examples:,} examples decoded: {status}")
    return 0 if rep.ok else 1


def _spm(args) -> int:
    from pathlib import Path

    from scaletrain.prepare.spm_train import add_spm_model, check_spm_args

    check_spm_args(args.vocab_size, args.sentences, args.character_coverage, args.threads)
    e = add_spm_model(args.shard_dir, args.vocab_size, max_sentences=args.sentences,
                      character_coverage=args.character_coverage, num_threads=args.threads,
                      overwrite=args.overwrite, progress=not args.no_progress, flag_prefix="--")
    print(f"{Path(args.shard_dir) / e['file']}: SentencePiece BPE, {e['vocab_size']:,} pieces, "
          f"sha256 {e['sha256']} (recorded in the manifest)")
    return 0


def _export(args) -> int:
    from scaletrain.prepare.export_text import export_split

    dirs = [d.strip() for d in args.direction.split(",") if d.strip()] if args.direction else None
    for e in export_split(args.shard_dir, args.split, args.out, dirs):
        note = f" ({e.line_breaks} sentence(s) with line breaks written as spaces)" if e.line_breaks else ""
        print(f"{e.direction}: {e.n:,} lines -> {e.src_path}, {e.tgt_path}{note}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("data", help="inspect a prepared shard directory (stats, verify, spm, export)")
    sub = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")

    st = sub.add_parser("stats", help="per-direction pairs, bytes, length percentiles, filter counts")
    st.add_argument("shard_dir", help="directory written by `scaletrain prepare` (holds manifest.json), or its "
                                      "http(s):// URL, or pipe:COMMAND with {name} (e.g. 'pipe:curl -fsS URL/{name}')")
    st.add_argument("--splits", default=None, help="comma-separated splits (default: all in the manifest)")
    st.add_argument("--json", action="store_true", help="print the statistics as JSON")
    st.set_defaults(func=_stats)

    ve = sub.add_parser("verify", help="check sizes, checksums, tar tables and decode every block; "
                                       "exits 1 naming each bad shard")
    ve.add_argument("shard_dir", help="directory written by `scaletrain prepare` (holds manifest.json), or its "
                                      "http(s):// URL, or pipe:COMMAND with {name} (every shard is fetched whole)")
    ve.add_argument("--no-checksums", action="store_true", help="skip the sha256 pass (sizes and decoding only)")
    ve.set_defaults(func=_verify)

    from scaletrain.prepare.args import add_spm_arguments

    sp = sub.add_parser("spm", help="train a SentencePiece BPE model on the train split and record it in the manifest")
    sp.add_argument("shard_dir", help="directory written by `scaletrain prepare` (holds manifest.json)")
    add_spm_arguments(sp, prefix="--")
    sp.add_argument("--overwrite", action="store_true", help="retrain and replace a model of the same size")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp.set_defaults(func=_spm)

    ex = sub.add_parser("export", help="write a split as line-aligned plain text: OUT/SPLIT.SRC-TGT.SRC and "
                                       "OUT/SPLIT.SRC-TGT.TGT per direction (for sacrebleu and other scorers)")
    ex.add_argument("shard_dir", help="directory written by `scaletrain prepare` (holds manifest.json)")
    ex.add_argument("--split", default="test", help="split to write (default test)")
    ex.add_argument("--direction", default=None, help="comma-separated directions such as de-en,en-de "
                    "(default: every direction of the split)")
    ex.add_argument("--out", required=True, help="output directory (created; files of the same names are replaced "
                    "atomically)")
    ex.set_defaults(func=_export)
