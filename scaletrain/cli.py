"""Command line: thin; builds the parser from :mod:`scaletrain.commands`, parses, dispatches.

Every subcommand is a module of :mod:`scaletrain.commands` that registers itself. Errors a user can fix
are printed as one line without a traceback (``--debug`` shows one), exit code 2; running out of memory
(:mod:`scaletrain.oom`) is one line too, anywhere, exit code :data:`~scaletrain.oom.OOM_EXIT` (71); a lost
peer rank or host is exit code 76 (retry: :mod:`scaletrain.engine.heartbeat`). Under torchrun's elastic agent
a configuration error (exit 2) is not retried: the attempt's line is kept in the agent's attempt directory
and a restart (``TORCHELASTIC_RESTART_COUNT`` > 0) after it prints the same line and exits 2 at once, while a
lost peer (76) restarts.
Before a command runs, this module sets up the console (:func:`scaletrain.console.setup_console`: our log
lines, the libraries' noise filtered unless ``--verbose``) and, for the commands that decode (``evaluate``,
``translate``), torch's CPU threads (:func:`scaletrain.threads.apply_threads`, ``--threads N``). Building
the parser imports no heavy library: ``scaletrain train`` with a wrong path fails before torch's engines
load.
"""
from __future__ import annotations

import argparse
import sys

from scaletrain import __version__
from scaletrain.errors import ScaletrainError
from scaletrain.oom import OOM_EXIT, as_oom, is_oom


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


DECODING_COMMANDS = ("evaluate", "translate")  # get --threads and the inference thread rule
STDOUT_IS_DATA = ("translate",)  # log lines go to stderr: stdout carries the translations only


def _setup_logging(debug: bool) -> None:
    """For scripts run under a launcher that call :func:`main`'s set-up without its parser (test drivers)."""
    from scaletrain.console import setup_console

    setup_console(debug=debug)


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
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs (implies --verbose)")
    p.add_argument("--verbose", action="store_true",
                   help="show every library's log lines (DeepSpeed, Accelerate, MLflow, ...); also SCALETRAIN_VERBOSE=1")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in _commands():
        command.register(sub)
    for name in DECODING_COMMANDS:
        sub.choices[name].add_argument(
            "--threads", type=int, default=None, metavar="N",
            help="CPU threads (default: $OMP_NUM_THREADS, else the usable cores that are idle; logged)")
    return p


def _setup_threads(args) -> None:
    if args.command not in DECODING_COMMANDS:
        return  # training sets its own per rank (engine.threads); the other commands barely compute
    if args.threads is not None and args.threads < 1:
        raise ScaletrainError(f"--threads must be >= 1, got {args.threads}")
    if getattr(args, "device", None) not in (None, "cpu"):
        return
    from scaletrain.threads import apply_threads

    # translate is a filter: stdout has the translations, stderr only what went wrong
    apply_threads(requested=args.threads, inference=True, announce=args.command != "translate")


ELASTIC_EXIT_FILE = "scaletrain_exit.json"  # beside torchelastic's error.json of an attempt: {"code", "line"}


def _attempt_file(attempt_offset: int = 0) -> str | None:
    """Under torchrun's elastic agent: this rank's file in the agent's directory of the current attempt
    (``attempt_offset`` -1: the previous one), beside ``$TORCHELASTIC_ERROR_FILE`` (``.../attempt_N/R/error.json``,
    kept by the agent until it exits); None elsewhere."""
    import os
    from pathlib import Path

    err, count = os.environ.get("TORCHELASTIC_ERROR_FILE"), os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if not err or count is None or not count.isdigit():
        return None
    rank_dir = Path(err).parent
    n = int(count) + attempt_offset
    if n < 0 or rank_dir.parent.name != f"attempt_{count}":
        return None
    return str(rank_dir.parent.parent / f"attempt_{n}" / rank_dir.name / ELASTIC_EXIT_FILE)


def _previous_config_error() -> str | None:
    """The one line of the previous elastic attempt when it ended with a configuration error (exit 2): the
    same command would fail the same way, so a restart refuses at once instead of waiting for a rendezvous,
    loading the model and failing again (a lost peer, exit 76, restarts as it should)."""
    import json

    path = _attempt_file(-1)
    if path is None:
        return None
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec.get("line") if rec.get("code") == 2 else None


def _record_attempt(code: int, line: str) -> None:
    import json
    import os

    path = _attempt_file(0)
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"code": code, "line": line}, f)
    except OSError:
        pass


def _refuse(line: str) -> int:
    print(f"scaletrain: error: {line}", file=sys.stderr)
    _record_attempt(2, line)  # the next restart refuses too
    from scaletrain.engine.heartbeat import record_exit

    record_exit(2)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = _strip_launcher_args(list(sys.argv[1:] if argv is None else argv))
    previous = _previous_config_error()
    if previous is not None:  # an elastic restart after a configuration error: not retried
        return _refuse(previous)
    args = build_parser().parse_args(argv)
    from scaletrain.console import setup_console

    setup_console(debug=args.debug, verbose=args.verbose,
                  log_stream=sys.stderr if args.command in STDOUT_IS_DATA else sys.stdout)
    try:
        _setup_threads(args)
        return int(args.func(args) or 0)
    except ScaletrainError as e:
        if args.debug:
            raise
        code = getattr(e, "exit_code", 2)  # 2: fix the input; OOM_EXIT: out of memory; 76: a peer was lost (retry)
        if code == 2:
            return _refuse(str(e))
        print(f"scaletrain: error: {e}", file=sys.stderr)
        from scaletrain.engine.heartbeat import record_exit

        record_exit(code)  # for launch.sh under torchrun / accelerate launch, which exit 1 whatever the code
        return code
    except KeyboardInterrupt:
        print("scaletrain: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - out of memory where no stage caught it is one line too
        if args.debug or not is_oom(e):
            raise
        # no stage named it (loading a model, moving a batch): the command, the error's first sentence, the memory
        line = as_oom(e, f"scaletrain {args.command}", "use a smaller batch setting of the command or a device with "
                      "more memory (--debug shows where it ran out)")
        print(f"scaletrain: error: {line}", file=sys.stderr)
        return OOM_EXIT


if __name__ == "__main__":
    raise SystemExit(main())
