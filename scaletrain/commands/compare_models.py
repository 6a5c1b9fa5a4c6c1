"""`scaletrain compare-models`: the papers' models for the same minutes on the same shards, evaluated and compared.

    scaletrain compare-models                                   # every model, 10 min each, paper sizes (a GPU)
    scaletrain compare-models --minutes 2 --size tiny --beam 1 --eval-lines 20 --out results/cpu-smoke
    scaletrain compare-models --models base,moce_d5_lid --base-seeds 1,2,3 --set optim.lr=7e-4

The work is :func:`scaletrain.eval.compare_models.compare_models`.
"""
from __future__ import annotations


def register(subparsers) -> None:
    from scaletrain.eval.compare_models import DEFAULT_MODELS, SIZES

    p = subparsers.add_parser(
        "compare-models", help="train the papers' models for equal minutes on the same shards, evaluate, compare",
        description="Train each model (a recipe name; the catalogs overlay gives them one data, budget and "
                    "evaluation section) for the same minutes on the same shards, one process per model, evaluate "
                    "each on the test split and write `scaletrain compare`'s table (Markdown, CSV, JSON) and plot "
                    "into --out. Resumable: finished trainings and evaluations are kept, nothing written is "
                    "overwritten; re-run the same command after an interruption (Ctrl-C or SIGTERM: the running "
                    "training checkpoints and the command stops). A model that fails is in the table as failed, "
                    "with its reason, and the others go on. Exit status: 0 all done, 1 some model failed, 2 bad "
                    "input (nothing ran), 128+N stopped by signal N (130 Ctrl-C, 143 SIGTERM).")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help=f"comma-separated recipe names (default {','.join(DEFAULT_MODELS)}); NAME runs the packaged "
                        "catalogs_NAME, or NAME with overlays/catalogs.yaml")
    p.add_argument("--out", default="results/compare-models", help="output folder (default results/compare-models)")
    p.add_argument("--minutes", type=float, default=10.0, help="training budget of every model (default 10)")
    p.add_argument("--size", default="paper", choices=list(SIZES),
                   help="model size preset: paper (the recipes' d 512, 6+6), small (d 320, 3+3, 4,096 tokens per "
                        "update), tiny (d 320, 2+2, 2,048 tokens; CPU smoke runs) (default paper)")
    p.add_argument("--seeds", default="1", help="comma-separated seeds of every model but base (default 1)")
    p.add_argument("--base-seeds", default="1,2", help="seeds of the byte Transformer, base (default 1,2)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a dotted override for every model (repeatable), e.g. --set optim.lr=7e-4")
    p.add_argument("--shards", default="shards/catalogs", help="the shards every model trains on (default "
                   "shards/catalogs)")
    p.add_argument("--beam", type=int, default=0, help="evaluation beam of every model (default 0: the recipes' 5)")
    p.add_argument("--eval-lines", type=int, default=0,
                   help="evaluate the first N test lines per direction (default 0: every line)")
    p.add_argument("--dry-run", action="store_true", help="print each run's train command and exit")
    p.set_defaults(func=run)


def run(args) -> int:
    from scaletrain.eval.compare_models import parse_seeds, compare_models

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    return compare_models(models, out=args.out, seeds=parse_seeds(args.seeds, "--seeds"),
                          base_seeds=parse_seeds(args.base_seeds, "--base-seeds"), minutes=args.minutes,
                          size=args.size, sets=args.set, shards=args.shards, beam=args.beam,
                          eval_lines=args.eval_lines, dry_run=args.dry_run)
