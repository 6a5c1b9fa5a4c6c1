"""`scaletrain compare`: runs side by side (config keys that differ, final/best metrics, BLEU/chrF per group,
throughput, wall time, status), as a table, Markdown, CSV or JSON, with an optional PNG of the learning curves.
An ``evaluation (<split>)`` row names the evaluation each run's scores come from (its full one of the split
when it has one; ``--evaluation GLOB`` picks another by name).

    scaletrain compare runs/small runs/moce_d4 --plot compare.png
    scaletrain compare --experiment scaletrain --filter "tags.arch = 'moce'" --format md
    scaletrain compare 3f2a... 9c1b... --format json
    scaletrain compare runs/a runs/b --evaluation 'test.full.beam4.*'
    scaletrain compare --experiment scaletrain --metric train/grad_norm --param optim.lr

The work is :mod:`scaletrain.tracking.compare`; the default local MLflow store is enough, no server needed.
"""
from __future__ import annotations

from scaletrain.tracking.compare import FORMATS


def register(subparsers) -> None:
    cp = subparsers.add_parser(
        "compare", help="compare training runs side by side (table/md/csv/json, PNG of learning curves)",
        description="Compare MLflow runs side by side: the config keys that differ (found automatically), "
                    "final and best train loss / valid nll / BLEU / chrF, evaluation scores per group (with the "
                    "name of the evaluation they come from: each run's full evaluation of the split unless "
                    "--evaluation picks another), throughput, wall time and status.",
    )
    cp.add_argument("runs", nargs="*", metavar="RUN", help="run id, or a training run directory (its out_dir)")
    cp.add_argument("--experiment", default=None, help="add the runs of this MLflow experiment (newest first)")
    cp.add_argument("--filter", default="", help="MLflow filter for --experiment, e.g. \"tags.arch = 'moce'\"")
    cp.add_argument("--max-runs", type=int, default=20, help="at most this many runs from --experiment (20)")
    cp.add_argument("--uri", default=None, help="tracking URI (default: $MLFLOW_TRACKING_URI, else ./mlruns.db; "
                                                "a run directory brings its own)")
    cp.add_argument("--format", default="table", choices=FORMATS, help="output format (default table)")
    cp.add_argument("--plot", default=None, metavar="FILE",
                    help="write overlaid learning curves and test chrF per group to this PNG")
    cp.add_argument("--directions", action="store_true", help="also list evaluation scores per direction")
    cp.add_argument("--metric", action="append", default=[], metavar="KEY",
                    help="also show this metric's final, min and max value (repeatable), e.g. train/grad_norm")
    cp.add_argument("--param", action="append", default=[], metavar="KEY",
                    help="also show this config key where the runs agree (repeatable), e.g. optim.lr")
    cp.add_argument("--evaluation", default=None, metavar="GLOB",
                    help="show the evaluations whose name matches GLOB (e.g. 'test.full.beam4.*'); default: each "
                         "run's full evaluation of the split, else the best match (see `scaletrain evaluate`)")
    cp.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from scaletrain.tracking.compare import compare, load_runs, plot_comparison

    runs = load_runs(args.runs, experiment=args.experiment, filter_string=args.filter, uri=args.uri,
                     project_dir=Path.cwd(), max_runs=args.max_runs, metrics=args.metric)
    cmp = compare(runs, directions=args.directions, evaluation=args.evaluation, metrics=args.metric,
                  params=args.param)
    print(cmp.format(args.format))
    if args.plot:
        out = plot_comparison(runs, args.plot, evaluation=args.evaluation)
        if args.format in ("table", "md"):
            print(f"wrote {out}")
    return 0
