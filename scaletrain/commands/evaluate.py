"""`scaletrain evaluate`: decode a split of a checkpoint and print BLEU/chrF per direction.

    scaletrain evaluate --checkpoint runs/small-XXXX --beam 4 --lenpen 1.0 --json out.json

The work is :func:`scaletrain.eval.evaluate.evaluate_checkpoint`; every hypothesis is written under the run
directory (``RUN/eval/<split>/hyp.<src>-<tgt>.txt``, line-aligned with ``ref.*`` and ``src.*``); the report is printed beside a
copy-the-source baseline, drawn as per-group BLEU/chrF bars (``RUN/plots/eval_<split>_scores.png`` + ``.json``),
optionally written as JSON and logged to the training run in MLflow.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("scaletrain")


def register(subparsers) -> None:
    ev = subparsers.add_parser("evaluate", help="decode a split and score BLEU/chrF per direction")
    ev.add_argument("--checkpoint", required=True, help="checkpoint dir, a run dir (uses its latest checkpoint), or "
                    "a .safetensors file written by `scaletrain export`")
    ev.add_argument("--split", default=None, help="split to decode (default: eval.split of the recipe, test)")
    ev.add_argument("--shards", default=None, help="shard directory (default: the one the model was trained on)")
    ev.add_argument("--beam", type=int, default=None, help="beam size (1 = greedy)")
    ev.add_argument("--lenpen", type=float, default=None, help="length penalty")
    ev.add_argument("--max-lines", type=int, default=0, help="decode only the first N lines per direction (0 = all)")
    ev.add_argument("--json", default=None, help="write the report as JSON here")
    ev.add_argument("--hyp-dir", default=None,
                    help="write src/ref/hyp.<src>-<tgt>.txt per direction here (default: RUN_DIR/eval/<split>)")
    ev.add_argument("--no-track", action="store_true", help="do not log to the training run in MLflow")
    ev.set_defaults(func=run)


def run(args) -> int:
    import torch

    from scaletrain.checkpoint import atomic_write_text
    from scaletrain.eval.evaluate import (evaluate_checkpoint, log_to_mlflow, plot_scores, result_to_json,
                                          run_dir_of, write_hypotheses)
    from scaletrain.eval.scoring import format_table

    result = evaluate_checkpoint(
        args.checkpoint, split=args.split, shards=args.shards, beam=args.beam, lenpen=args.lenpen,
        max_lines=args.max_lines, device="cuda" if torch.cuda.is_available() else "cpu",
    )
    print(f"checkpoint {result['checkpoint']} (step {result['step']}), split {result['split']}: "
          f"{result['lines']} lines, beam {result['beam']}, {result['sentences_per_s']:.1f} sentences/s; "
          f"{result['cut_invalid_utf8']} hypotheses stopped at invalid UTF-8, {result['at_length_limit']} at their "
          "length limit")
    print(format_table(result["report"], baseline=result["baseline"]))
    for s in result["samples"][:6]:
        print(f"  [{s['direction']}] src: {s['source']!r}\n      ref: {s['reference']!r}\n      hyp: {s['hypothesis']!r}")
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(result_to_json(result), indent=2, ensure_ascii=False))
        print(f"wrote {args.json}")
    hyp_dir = Path(args.hyp_dir) if args.hyp_dir else run_dir_of(result["checkpoint"]) / "eval" / result["split"]
    files = write_hypotheses(result, hyp_dir)
    print(f"wrote {len(files) // 3} directions' src/ref/hyp files to {hyp_dir}")
    plots = []
    try:
        plots.append(plot_scores(result, run_dir_of(result["checkpoint"])))
        print(f"wrote {plots[0]}")
    except Exception as e:  # noqa: BLE001 - a plot must not lose an evaluation that already ran
        log.warning("could not plot the scores: %s", e)
    if not args.no_track:
        try:
            log_to_mlflow(result, hyp_dir, plots=tuple(plots))
        except Exception as e:  # tracking must not lose an evaluation that already ran
            log.warning("could not log evaluation to MLflow run %s: %s", result.get("run_id"), e)
    return 0
