"""Command line: thin; builds the parser from :mod:`scaletrain.commands`, parses, dispatches.

Every subcommand is a module of :mod:`scaletrain.commands` that registers itself. Errors a user can fix
are printed as one line without a traceback (``--debug`` shows one).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from scaletrain import __version__
from scaletrain.errors import ScaletrainError


def _strip_launcher_args(argv: list[str]) -> list[str]:
    """The deepspeed launcher appends --local_rank=N; we read LOCAL_RANK from the environment."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a.startswith("--local_rank=") or a.startswith("--local-rank="):
            continue
        if a in ("--local_rank", "--local-rank"):
            skip = True
            continue
        out.append(a)
    return out


def _setup_logging(debug: bool) -> None:
    rank = int(os.environ.get("RANK", "0"))
    level = logging.DEBUG if debug else (logging.INFO if rank == 0 else logging.WARNING)
    logging.basicConfig(level=level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "mlflow", "alembic", "urllib3", "git"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _commands() -> tuple:
    """The command modules, in the order ``--help`` lists them (imported here: ``import scaletrain.cli``
    stays cheap)."""
    from scaletrain.commands import (average, compare, compare_models, data, evaluate, export, model, prepare,
                                     tracking, train, translate)

    return (prepare, train, evaluate, export, average, data, model, translate, compare, compare_models, tracking)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scaletrain",
        description="Distributed training of byte-level multilingual NMT models (DeepSpeed / Accelerate).",
    )
    p.add_argument("--version", action="version", version=f"scaletrain {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in _commands():
        command.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = _strip_launcher_args(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    _setup_logging(args.debug)
    try:
        return int(args.func(args) or 0)
    except ScaletrainError as e:
        if args.debug:
            raise
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("scaletrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
