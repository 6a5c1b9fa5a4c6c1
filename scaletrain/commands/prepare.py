"""`scaletrain prepare`: extract a corpus and write WebDataset shards + manifest.json.

The flags are defined by :mod:`scaletrain.data.prepare_args`; the work is
:func:`scaletrain.data.prepare.prepare_from_args`.
"""
from __future__ import annotations


def register(subparsers) -> None:
    from scaletrain.data.prepare_args import add_prepare_arguments

    p = subparsers.add_parser("prepare", help="extract a corpus and write WebDataset shards + manifest.json")
    add_prepare_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from scaletrain.data.prepare import prepare_from_args

    return prepare_from_args(args)
