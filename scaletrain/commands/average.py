"""`scaletrain average`: average checkpoints into one that ``evaluate`` and ``translate`` accept.

    scaletrain average runs/x --last 5 --out runs/x/avg5
    scaletrain average runs/x/checkpoints/step-0001000 runs/x/checkpoints/step-0002000 --out avg

The work is :func:`scaletrain.checkpoint.average_checkpoints`.
"""
from __future__ import annotations

import json


def register(subparsers) -> None:
    av = subparsers.add_parser("average", help="average checkpoints into one that evaluate/translate accept")
    av.add_argument("checkpoints", nargs="+", help="checkpoint dirs, or one run dir with --last K")
    av.add_argument("--last", type=int, default=0, help="average the last K checkpoints of the run dir(s) given")
    av.add_argument("--out", required=True, help="output checkpoint directory")
    av.set_defaults(func=run)


def run(args) -> int:
    from scaletrain.checkpoint import average_checkpoints

    out = average_checkpoints(args.checkpoints, args.out, last=args.last)
    state = json.loads((out / "trainer_state.json").read_text())
    print(f"wrote {out}: average of {len(state['averaged_from'])} checkpoint(s)")
    return 0
