"""Start the ranks of a single-node job with DeepSpeed's per-node launcher, in this process.

    python -m scaletrain.engine.launch --nproc 2 [--master_port P] [--log_level error] -- scaletrain train ...
    python -m scaletrain.engine.launch --nproc 2 -- path/to/script.py ARGS...      # a script (the tests' drivers)

``launch.sh`` uses it for single-node DeepSpeed runs (a hostfile, several nodes or ``--no_ssh`` keep the
``deepspeed`` command). The ``deepspeed`` command is a dispatcher (``deepspeed.launcher.runner``): on one
node it only encodes ``{"localhost": [slots]}`` and starts ``deepspeed.launcher.launch`` in a second Python
process, and each of the two imports all of DeepSpeed before the first rank starts: 3.5 CPU-s each on the
2-core CPU we measure on, 1.4 of them MLflow, which DeepSpeed's autotuner imports when it is installed
and a launcher never uses. Here ``deepspeed.launcher.launch`` (the same code, the same rank environment:
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, MASTER_ADDR/PORT) runs in this process, imported without MLflow:
2.1 CPU-s instead of 7 before the ranks start.

Devices: the slots are the first ``--nproc`` ids of ``CUDA_VISIBLE_DEVICES`` when it lists numeric ids (the
launcher then gives the ranks exactly those), else ``0..nproc-1``. A list with GPU UUIDs is passed to the
``deepspeed`` command unchanged. Without ``--master_port`` a free port is taken, so two jobs on one machine
do not collide on DeepSpeed's default 29500.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import sys


def local_slots(nproc: int, visible: str | None) -> list[int] | None:
    """The device ids for ``nproc`` local ranks; None where ``visible`` names devices by UUID."""
    ids = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if not ids:
        return list(range(nproc))
    if not all(v.isdigit() for v in ids):
        return None
    if nproc > len(ids):
        from scaletrain.errors import ScaletrainError

        raise ScaletrainError(f"--nproc {nproc} but CUDA_VISIBLE_DEVICES={visible} lists {len(ids)} device(s)")
    return [int(v) for v in ids[:nproc]]


def world_info(slots: list[int]) -> str:
    """DeepSpeed's ``--world_info``: urlsafe base64 of the JSON host -> slots map (as its runner encodes it)."""
    return base64.urlsafe_b64encode(json.dumps({"localhost": slots}).encode("utf-8")).decode("utf-8")


def launcher_argv(slots: list[int], port: int, log_level: str, command: list[str]) -> list[str]:
    """``deepspeed.launcher.launch``'s arguments for ``command``: a module and its arguments, or a Python
    script (a path ending in ``.py``) and its arguments."""
    module = [] if command[0].endswith(".py") else ["--module"]
    return [f"--world_info={world_info(slots)}", "--master_addr=127.0.0.1", f"--master_port={port}", *module,
            "--no_local_rank", f"--log_level={log_level}", *command]


def _import_launcher():
    """``deepspeed.launcher.launch`` with MLflow kept out of DeepSpeed's import (its autotuner takes it
    when present); a later ``import mlflow`` in this process works as usual."""
    from scaletrain.engine.deepspeed_internals import import_deepspeed

    return import_deepspeed("deepspeed.launcher.launch")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scaletrain.engine.launch",
                                 description="start the ranks of a single-node job (DeepSpeed's per-node launcher)")
    ap.add_argument("--nproc", type=int, required=True, help="processes on this node")
    ap.add_argument("--master_port", type=int, default=0, help="rendezvous port (default: a free one)")
    ap.add_argument("--log_level", default="info", choices=("debug", "info", "warning", "error", "critical"))
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- MODULE|SCRIPT.py [ARGS...] run by every rank")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.nproc < 1:
        ap.error("give --nproc N >= 1 and -- MODULE|SCRIPT.py [ARGS...]")
    from scaletrain.errors import ScaletrainError

    try:
        slots = local_slots(args.nproc, os.environ.get("CUDA_VISIBLE_DEVICES"))
    except ScaletrainError as e:
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return 2
    from scaletrain.engine.env import _free_port

    port = args.master_port or _free_port()
    if slots is None:  # GPU UUIDs: DeepSpeed's own runner decides
        exe = shutil.which("deepspeed") or "deepspeed"
        os.execvp(exe, [exe, "--log_level", args.log_level, "--num_gpus", str(args.nproc), "--master_port", str(port),
                        "--no_local_rank", "--module", *command])
    launch = _import_launcher()
    sys.argv = ["deepspeed.launcher.launch", *launcher_argv(slots, port, args.log_level, command)]
    launch.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
