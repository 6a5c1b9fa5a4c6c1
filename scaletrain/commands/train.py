"""`scaletrain train`: train a model (run under `deepspeed` or `accelerate launch` for >1 rank).

    scaletrain train --config small data.shards=shards/mini optim.lr=2e-3
    scaletrain train --config small --print-config
    scaletrain train --config small --explain-config    # each key with its documentation

The config, the shard manifest and the output directory are checked first
(:func:`scaletrain.engine.preflight.check_inputs`), before DeepSpeed, Accelerate or MLflow is imported: a
wrong path fails in a second or two. The work is :func:`scaletrain.train.train`; rank 0 prints a one-line
summary at the end, after every rank has finished its process groups and threads
(:func:`scaletrain.engine.shutdown.finishing_distributed`: a job that finished exits 0, not as a crash). SIGTERM,
SIGUSR1 or SIGINT: a checkpoint at the next step boundary, the MLflow run ends KILLED, exit code 75;
re-running the same command resumes. Out of memory anywhere: one line, the run FAILED, exit code 71
(:mod:`scaletrain.oom`).
"""
from __future__ import annotations

import os


def register(subparsers) -> None:
    tr = subparsers.add_parser(
        "train", help="train a model (run under `deepspeed` or `accelerate launch` for >1 rank)",
        epilog="SIGTERM/SIGUSR1/SIGINT: checkpoint at the next step boundary, MLflow run KILLED, exit 75 "
               "(train.preempt_grace_seconds); re-run the same command to resume. Out of memory: one line naming the "
               "stage, the batch and the setting to lower (train.on_oom), MLflow run FAILED, exit 71. A resume at "
               "another world size (an elastic restart, a re-run on fewer ranks) keeps the run's global batch: "
               "engine.grad_accum is re-derived from the batch slots recorded in the checkpoint "
               "(engine.global_batch_slots), in one log line.")
    tr.add_argument("--config", default="small", help="recipe name (packaged) or path to a YAML file")
    tr.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. optim.lr=1e-3")
    tr.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    tr.add_argument("--explain-config", action="store_true",
                    help="print the resolved config with each key's documentation (meaning, unit, allowed values) "
                         "as YAML comments and exit")
    tr.add_argument("--threads", type=int, default=None, metavar="N",
                    help="CPU threads per rank (= engine.threads=N; default: usable cores / ranks on the node, "
                         "or $OMP_NUM_THREADS)")
    tr.set_defaults(func=run)


def run(args) -> int:
    from scaletrain.config import dump_yaml, load_config

    overrides = list(args.overrides)
    if args.threads is not None:
        overrides.append(f"engine.threads={args.threads}")
    cfg = load_config(args.config, overrides)
    if args.print_config or args.explain_config:
        print(dump_yaml(cfg, docs=args.explain_config), end="")
        return 0
    from scaletrain.engine.preflight import check_inputs

    check_inputs(cfg)  # before the engines' libraries load: a wrong path fails in a second or two
    from scaletrain.engine.shutdown import finishing_distributed
    from scaletrain.train import train

    with finishing_distributed():  # process groups and our threads end before the interpreter does
        res = train(cfg)
    if res.preempted:
        from scaletrain.train.preemption import PREEMPTED_EXIT

        if int(os.environ.get("RANK", "0")) == 0:
            print(f"preempted at step {res.steps}: checkpoint {res.final_checkpoint}; MLflow run {res.run_id} "
                  f"ended KILLED; exit {PREEMPTED_EXIT}; re-run the same command to resume")
        return PREEMPTED_EXIT
    if int(os.environ.get("RANK", "0")) == 0:
        first, last = res.valid_nll[0][1], res.valid_nll[-1][1]
        print(
            f"trained {res.steps} steps, {res.tokens:,} target tokens in {res.train_seconds:.0f}s; "
            f"valid nll {first:.3f} -> {last:.3f} (target-unigram baseline {res.unigram_nll:.3f}); "
            f"checkpoint {res.final_checkpoint}; MLflow run {res.run_id}"
        )
    return 0
