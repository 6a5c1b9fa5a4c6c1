"""``scaletrain data spm shards/NAME --vocab-size N``: add a SentencePiece BPE model to prepared shards.

Registered as an action of the ``data`` command (which `scaletrain.commands.data` defines; modules
register in name order, so it exists by the time this one runs). Same options as
``prepare --spm-vocab-size`` (see ``scaletrain.subword``).
"""
from __future__ import annotations

import argparse


def _spm(args) -> int:
    from pathlib import Path

    from scaletrain.data.spm_train import add_spm_model, check_spm_args

    check_spm_args(args.vocab_size, args.sentences, args.character_coverage, args.threads)
    e = add_spm_model(args.shard_dir, args.vocab_size, max_sentences=args.sentences,
                      character_coverage=args.character_coverage, num_threads=args.threads,
                      overwrite=args.overwrite, progress=not args.no_progress, flag_prefix="--")
    print(f"{Path(args.shard_dir) / e['file']}: SentencePiece BPE, {e['vocab_size']:,} pieces, "
          f"sha256 {e['sha256']} (recorded in the manifest)")
    return 0


def _data_actions(subparsers):
    data = subparsers.choices.get("data")
    if data is None:
        return None
    for a in data._actions:  # argparse keeps a parser's sub-commands in a _SubParsersAction
        if isinstance(a, argparse._SubParsersAction):
            return a
    return None


def register(subparsers) -> None:
    from scaletrain.data.prepare_args import add_spm_arguments

    actions = _data_actions(subparsers)
    helptext = "train a SentencePiece BPE model on the train split and record it in the manifest"
    if actions is not None:
        p = actions.add_parser("spm", help=helptext)
    else:  # no `data` command: stand alone as `scaletrain spm`
        p = subparsers.add_parser("spm", help=helptext)
    p.add_argument("shard_dir", help="directory written by `scaletrain prepare` (holds manifest.json)")
    add_spm_arguments(p, prefix="--")
    p.add_argument("--overwrite", action="store_true", help="retrain and replace a model of the same size")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_spm)
