"""Command line: thin; parses, loads config, calls the library.

Errors a user can fix are printed as one line without a traceback (``--debug`` shows one).
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scaletrain",
        description="Distributed training of byte-level multilingual NMT models (DeepSpeed / Accelerate).",
    )
    p.add_argument("--version", action="version", version=f"scaletrain {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pr = sub.add_parser("prepare", help="extract a corpus and write WebDataset shards + manifest.json")
    from scaletrain.data.prepare_args import add_prepare_arguments

    add_prepare_arguments(pr)

    tr = sub.add_parser("train", help="train a model (run under `deepspeed` or `accelerate launch` for >1 rank)")
    tr.add_argument("--config", default="small", help="recipe name (packaged) or path to a YAML file")
    tr.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. optim.lr=1e-3")
    tr.add_argument("--print-config", action="store_true", help="print the resolved config and exit")

    ev = sub.add_parser("evaluate", help="decode a split and score BLEU/chrF per direction")
    ev.add_argument("--checkpoint", required=True, help="checkpoint dir, or a run dir (uses its latest checkpoint)")
    ev.add_argument("--split", default=None, help="split to decode (default: eval.split of the recipe, test)")
    ev.add_argument("--shards", default=None, help="shard directory (default: the one the model was trained on)")
    ev.add_argument("--beam", type=int, default=None, help="beam size (1 = greedy)")
    ev.add_argument("--lenpen", type=float, default=None, help="length penalty")
    ev.add_argument("--max-lines", type=int, default=0, help="decode only the first N lines per direction (0 = all)")
    ev.add_argument("--json", default=None, help="write the report as JSON here")
    ev.add_argument("--no-track", action="store_true", help="do not log to the training run in MLflow")

    from scaletrain.commands import register_all

    register_all(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = _strip_launcher_args(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    _setup_logging(args.debug)
    try:
        return _dispatch(args)
    except ScaletrainError as e:
        if args.debug:
            raise
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("scaletrain: interrupted", file=sys.stderr)
        return 130


def _dispatch(args) -> int:
    if args.command == "prepare":
        from scaletrain.data.prepare import prepare_from_args

        return prepare_from_args(args)
    if args.command == "train":
        from scaletrain.config import dump_yaml, load_config

        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(dump_yaml(cfg), end="")
            return 0
        from scaletrain.train import train

        res = train(cfg)
        if int(os.environ.get("RANK", "0")) == 0:
            first, last = res.valid_nll[0][1], res.valid_nll[-1][1]
            print(
                f"trained {res.steps} steps, {res.tokens:,} target tokens in {res.train_seconds:.0f}s; "
                f"valid nll {first:.3f} -> {last:.3f} (target-unigram baseline {res.unigram_nll:.3f}); "
                f"checkpoint {res.final_checkpoint}; MLflow run {res.run_id}"
            )
        return 0
    if args.command == "evaluate":
        from scaletrain.eval.evaluate import evaluate_cli

        return evaluate_cli(args)
    func = getattr(args, "func", None)
    if func is None:
        raise AssertionError(args.command)
    return int(func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
