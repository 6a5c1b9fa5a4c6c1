"""`scaletrain tracking sync RUN_DIR`: upload to MLflow what the tracking server missed during an outage.

    scaletrain tracking sync runs/small-XXXX [--uri http://host:5000]

Training appends every metric, param, tag, artifact, dataset input, checkpoint (as a logged model) and the end
status to ``RUN_DIR/tracking/journal.jsonl`` before sending it; this command sends whatever is not on the
server yet (metrics matched by key, step and timestamp, datasets and logged models found by name, so running
it twice uploads nothing twice) and ends the run with the status the job recorded.
The work is :func:`scaletrain.tracking.sync_run`.
"""
from __future__ import annotations


def register(subparsers) -> None:
    tr = subparsers.add_parser("tracking", help="MLflow tracking maintenance (sync after a server outage)")
    sub = tr.add_subparsers(dest="tracking_command", required=True, metavar="ACTION")
    sy = sub.add_parser(
        "sync", help="upload what the tracking server missed (idempotent)",
        description="Upload the metrics, params, tags, artifacts, dataset inputs, checkpoints' logged models and "
                    "end status recorded in RUN_DIR/tracking/journal.jsonl that the MLflow server does not have "
                    "yet. Metrics are matched by (key, step, timestamp), datasets and logged models by what they "
                    "are: running it twice sends nothing twice.",
    )
    sy.add_argument("run_dir", metavar="RUN_DIR", help="a training run's out_dir (holds tracking/journal.jsonl)")
    sy.add_argument("--uri", default=None, help="tracking URI to send to (default: the one the run used)")
    sy.set_defaults(func=run_sync)


def run_sync(args) -> int:
    from scaletrain.tracking import sync_run

    for r in sync_run(args.run_dir, uri=args.uri):
        status = f", status set to {r.status}" if r.status else ""
        print(f"run {r.run_id}: {r.metrics_sent} metric values sent ({r.metrics_present} already there), "
              f"{r.artifacts} artifacts, {r.datasets} dataset inputs, {r.models} new logged models "
              f"({r.model_updates} model tags and metric values){status}")
    return 0
