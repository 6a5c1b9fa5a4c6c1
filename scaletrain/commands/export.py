"""`scaletrain export`: consolidate a checkpoint (ZeRO shards too) into one safetensors file.

    scaletrain export runs/x --out model.safetensors [--dtype bf16|fp32]

The work is :func:`scaletrain.checkpoint_tools.export_checkpoint`.
"""
from __future__ import annotations

from scaletrain.checkpoint_tools import DTYPES, export_checkpoint


def register(subparsers) -> None:
    ex = subparsers.add_parser("export", help="consolidate a checkpoint (ZeRO shards too) into one safetensors file")
    ex.add_argument("checkpoint", help="checkpoint dir, or a run dir (uses its latest checkpoint)")
    ex.add_argument("--out", required=True, help="output file, e.g. model.safetensors")
    ex.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="stored dtype (default fp32)")
    ex.set_defaults(func=run)


def run(args) -> int:
    out = export_checkpoint(args.checkpoint, args.out, args.dtype)
    print(f"wrote {out} ({args.dtype})")
    return 0
