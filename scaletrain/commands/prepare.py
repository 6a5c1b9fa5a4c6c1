"""`scaletrain prepare`: extract a corpus and write WebDataset shards + manifest.json.

The flags are defined by :mod:`scaletrain.prepare.args`; the work is
:func:`scaletrain.prepare.build.prepare_from_args`.
"""
from __future__ import annotations


def register(subparsers) -> None:
    from scaletrain.prepare.args import add_prepare_arguments

    p = subparsers.add_parser("prepare", help="extract a corpus and write WebDataset shards + manifest.json")
    add_prepare_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from scaletrain.prepare import prepare_from_args

    return prepare_from_args(args)
