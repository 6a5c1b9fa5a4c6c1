"""`scaletrain evaluate`: decode a split of a checkpoint and print BLEU/chrF per direction.

    scaletrain evaluate --checkpoint runs/small-XXXX --beam 4 --lenpen 1.0 --json out.json

The work is :func:`scaletrain.eval.evaluate.evaluate_checkpoint`. Every evaluation is named by what it
evaluated (``test.full.beam5.lp1.0.step1200``, ``test.first5.beam4.lp1.0.step1200``; see
:mod:`scaletrain.tracking.records`) and recorded under that name: ``RUN/eval/<name>/`` holds ``eval.json``, the
hypotheses (``hyp.<src>-<tgt>.txt``, line-aligned with ``ref.*`` and ``src.*``) and ``scores.png`` (per-group
BLEU/chrF beside a copy-the-source baseline); MLflow gets a run of that name nested under the training run.
Only the run's full evaluation (every line, the recipe's decoding settings) updates the training run's own
``<split>/bleu/...`` metrics; any other evaluation is recorded beside it and replaces nothing but an earlier
run of itself. It prints where it wrote.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from scaletrain.errors import ScaletrainError

log = logging.getLogger("scaletrain")


def register(subparsers) -> None:
    ev = subparsers.add_parser(
        "evaluate", help="decode a split and score BLEU/chrF per direction",
        description="Decode a split of a checkpoint, score BLEU/chrF per direction and group, and record the "
                    "evaluation under a name that says what was evaluated (RUN_DIR/eval/NAME and a nested "
                    "MLflow run); only the run's full evaluation updates the training run's own metrics.")
    ev.add_argument("--checkpoint", required=True, help="checkpoint dir, a run dir (uses its latest checkpoint), or "
                    "a .safetensors file written by `scaletrain export`")
    ev.add_argument("--split", default=None, help="split to decode (default: eval.split of the recipe, test)")
    ev.add_argument("--shards", default=None, help="shard directory (default: the one the model was trained on)")
    ev.add_argument("--beam", type=int, default=None, help="beam size (1 = greedy; default: eval.beam of the recipe)")
    ev.add_argument("--lenpen", type=float, default=None, help="length penalty (default: eval.lenpen of the recipe)")
    ev.add_argument("--max-len-a", type=float, default=None,
                    help="output length limit A * source length + B: A (default: eval.max_len_a of the recipe)")
    ev.add_argument("--max-len-b", type=int, default=None, help="... and B (default: eval.max_len_b of the recipe)")
    ev.add_argument("--max-lines", type=int, default=0, help="decode only the first N lines per direction (0 = all)")
    ev.add_argument("--batch-tokens", type=int, default=None, metavar="N",
                    help="most beam-expanded padded source tokens per model call (default: eval.batch_tokens of the "
                         "recipe); lower it when decoding runs out of memory")
    ev.add_argument("--json", default=None, help="also write the report as JSON here")
    ev.add_argument("--hyp-dir", default=None,
                    help="write src/ref/hyp.<src>-<tgt>.txt per direction here (default: RUN_DIR/eval/NAME)")
    ev.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    ev.set_defaults(func=run)


def _write_json(path: Path, data: dict) -> None:
    """``--json``: the path the user named; say so when it held another evaluation's report."""
    from scaletrain.fileio import atomic_write_text

    before = None
    if path.is_file():
        try:
            before = json.loads(path.read_text(encoding="utf-8")).get("name", "an unnamed evaluation")
        except (OSError, ValueError, AttributeError):
            before = "a file that is not an evaluation report"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False))
    note = f" (replaced {before})" if before and before != data["name"] else ""
    print(f"  {path}{note}")


def _print_tracking(logged, spec) -> None:
    keys = sorted({k.rsplit("/", 1)[0] + "/*" for k in logged.metric_keys})
    print(f"MLflow {logged.uri}, experiment {logged.experiment_id}:")
    print(f"  run {logged.run_id} '{logged.run_name}' nested under training run {logged.parent_run_id} "
          f"'{logged.parent_run_name}': {', '.join(keys)} at step {spec.step}, files as artifacts")
    if logged.replaced:
        print(f"  replaced the earlier record of this same evaluation: run {', '.join(logged.replaced)} (deleted)")
    if logged.headline:
        print(f"  training run's own {', '.join(keys)} updated: this is its full {spec.split} evaluation")
    elif spec.primary and not spec.headline:
        print(f"  training run's own {spec.split}/* metrics left as they are: they are its in-training validation's")
    elif logged.headline_kept:
        print(f"  training run's own {spec.split}/* metrics kept: they are {logged.headline_kept}, of a later step")
    else:
        print(f"  training run's own {spec.split}/* metrics left as they are: not its full {spec.split} "
              "evaluation (every line, the recipe's beam, lenpen and max_len)")


def run(args) -> int:
    import torch

    from scaletrain.eval.evaluate import (evaluate_checkpoint, log_to_mlflow, result_to_json, run_dir_of, spec_of,
                                          write_record)
    from scaletrain.eval.scoring import format_table

    if args.batch_tokens is not None and args.batch_tokens < 1:
        raise ScaletrainError(f"--batch-tokens must be >= 1, got {args.batch_tokens}")
    result = evaluate_checkpoint(
        args.checkpoint, split=args.split, shards=args.shards, beam=args.beam, lenpen=args.lenpen,
        max_lines=args.max_lines, max_len_a=args.max_len_a, max_len_b=args.max_len_b,
        device="cuda" if torch.cuda.is_available() else "cpu", batch_tokens=args.batch_tokens,
    )
    spec = spec_of(result)
    print(f"evaluation {spec.name}: {spec.describe()}")
    print(f"checkpoint {result['checkpoint']}, {result['sentences_per_s']:.1f} sentences/s; "
          f"{result['cut_invalid_utf8']} hypotheses stopped at invalid UTF-8, {result['at_length_limit']} at their "
          "length limit")
    print(format_table(result["report"], baseline=result["baseline"]))
    for s in result["samples"][:6]:
        print(f"  [{s['direction']}] src: {s['source']!r}\n      ref: {s['reference']!r}\n      hyp: {s['hypothesis']!r}")
    record = write_record(result, run_dir_of(result["checkpoint"]), hyp_dir=args.hyp_dir)
    print("wrote:")
    print(f"  {record}/ (eval.json, scores.png + scores.json"
          + (")" if args.hyp_dir else ", src/ref/hyp.<src>-<tgt>.txt per direction)"))
    if args.hyp_dir:
        print(f"  {args.hyp_dir}/ (src/ref/hyp.<src>-<tgt>.txt per direction)")
    if args.json:
        _write_json(Path(args.json), result_to_json(result))
    if args.no_track:
        return 0
    try:
        logged = log_to_mlflow(result, record)
    except Exception as e:  # noqa: BLE001 - tracking must not lose an evaluation that already ran
        log.warning("could not log evaluation %s to MLflow (training run %s): %s; its record is in %s",
                    spec.name, result.get("run_id"), e, record)
        return 0
    if logged is None:
        print("MLflow: not logged (the checkpoint names no training run)")
    else:
        _print_tracking(logged, spec)
    return 0
