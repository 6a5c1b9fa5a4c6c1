"""`scaletrain export`: a checkpoint (ZeRO shards too) as one safetensors file, or as a Hugging Face model.

    scaletrain export runs/x --out model.safetensors [--dtype bf16|fp32]
    scaletrain export runs/x --format hf --out hf_model/ [--eval-json eval.json]
    scaletrain export runs/x --format ct2 --out ct2_model/ [--quantization int8]
    scaletrain export runs/x --format hf --out hf_model/ --register nmt-small   # + a Model Registry version

``--format safetensors`` is :func:`scaletrain.export.export_checkpoint`; ``--format hf``
(:func:`scaletrain.export.export_hf`) writes a ``MarianMTModel`` directory (weights, config,
generation config, byte-level tokenizer, model card) for the byte Transformer recipes that map onto
Marian (post-LN, shared embeddings: ``base``, ``small``) and refuses the others with the reason;
``--format ct2`` (:func:`scaletrain.export.export_ct2`) converts that export with CTranslate2's
``TransformersConverter``. ``--register NAME`` then makes the export a new version of the registered model
``NAME`` (:func:`scaletrain.tracking.models.register_export`).
"""
from __future__ import annotations

DTYPES = ("bf16", "fp16", "fp32")  # scaletrain.export.DTYPES (named here: the parser imports no torch)


def register(subparsers) -> None:
    ex = subparsers.add_parser("export", help="consolidate a checkpoint (ZeRO shards too) into one safetensors "
                                              "file, or export it as a Hugging Face MarianMTModel (--format hf)")
    ex.add_argument("checkpoint", help="checkpoint dir, or a run dir (uses its latest checkpoint)")
    ex.add_argument("--out", required=True, help="output file (safetensors, e.g. model.safetensors: translate / "
                    "evaluate --checkpoint load it directly) or directory (hf, ct2)")
    ex.add_argument("--format", default="safetensors", choices=("safetensors", "hf", "ct2"),
                    help="safetensors: our weights in one file (default); hf: a MarianMTModel directory that "
                    "transformers loads with AutoTokenizer / AutoModelForSeq2SeqLM (post-LN byte Transformer "
                    "with shared embeddings only: recipes base, small); ct2: that model converted to a CTranslate2 "
                    "directory (needs pip install ctranslate2)")
    ex.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="stored dtype (default fp32)")
    ex.add_argument("--eval-json", default=None, help="hf: the report of `scaletrain evaluate --json FILE`, "
                    "shown in the model card (BLEU/chrF per direction with sacrebleu signatures)")
    ex.add_argument("--quantization", default=None, help="ct2: CTranslate2 weight type (e.g. int8, int8_float32, "
                    "float16; default: as exported)")
    ex.add_argument("--overwrite", action="store_true", help="hf, ct2: replace a non-empty --out directory")
    ex.add_argument("--register", metavar="NAME", default=None,
                    help="also register the export in the MLflow Model Registry as a new version of the model NAME "
                    "(the export's files uploaded as a logged model of the run that trained the checkpoint, in the "
                    "tracking store of its recipe or $MLFLOW_TRACKING_URI)")
    ex.set_defaults(func=run)


def _register(args, out) -> None:
    """``--register NAME``: the export as a new version of the registered model NAME (the checkpoint's run and
    tracking store from its ``trainer_state.json`` and ``config.yaml``)."""
    import json
    from pathlib import Path

    import yaml

    from scaletrain.checkpoint import resolve_checkpoint
    from scaletrain.config import from_dict
    from scaletrain.tracking import resolve_tracking_uri
    from scaletrain.tracking.models import register_export

    ck = resolve_checkpoint(args.checkpoint)
    cfg = from_dict(yaml.safe_load((ck / "config.yaml").read_text()))
    state = json.loads((ck / "trainer_state.json").read_text())
    uri = resolve_tracking_uri(cfg.tracking.uri or None, Path.cwd())
    mv = register_export(uri, args.register, out, run_id=state.get("run_id"), experiment=cfg.tracking.experiment,
                         step=state.get("step"), fmt=args.format, checkpoint=ck, model_prefix=cfg.name,
                         project_dir=Path.cwd())
    print(f"registered {out} as version {mv.version} of model {args.register!r} (models:/{args.register}/{mv.version}) "
          f"in {uri}")


def run(args) -> int:
    from scaletrain.oom import oom_guard

    # the consolidated weights (and their --dtype copy) are held in host memory; every format writes under a
    # temporary name and renames, so --out is as it was
    with oom_guard(f"export --format {args.format}", f"consolidating checkpoint {args.checkpoint} (--dtype {args.dtype})",
                   "export holds the whole model in host memory: close other processes or export on a machine with "
                   f"more memory; {args.out} is as it was", device="cpu"):
        return _export(args)


def _export(args) -> int:
    if args.format == "hf":
        from scaletrain.export import export_hf

        out = export_hf(args.checkpoint, args.out, args.dtype, eval_json=args.eval_json, overwrite=args.overwrite)
        print(f"wrote {out}: MarianMTModel ({args.dtype}), tokenizer, generation config, README.md")
        if args.register:
            _register(args, out)
        return 0
    from scaletrain.errors import ScaletrainError

    if args.format == "ct2":
        from scaletrain.export import export_ct2

        if args.dtype != "fp32":
            raise ScaletrainError("--format ct2 takes --quantization (e.g. int8, float16), not --dtype")
        out = export_ct2(args.checkpoint, args.out, quantization=args.quantization, eval_json=args.eval_json,
                         overwrite=args.overwrite)
        print(f"wrote {out}: CTranslate2 model ({args.quantization or 'float32'}) and tokenizer files")
        if args.register:
            _register(args, out)
        return 0
    if args.quantization:
        raise ScaletrainError("--quantization belongs to --format ct2")
    from scaletrain.export import export_checkpoint

    if args.eval_json or args.overwrite:
        raise ScaletrainError("--eval-json and --overwrite belong to --format hf and ct2")
    out = export_checkpoint(args.checkpoint, args.out, args.dtype)
    print(f"wrote {out} ({args.dtype})")
    if args.register:
        _register(args, out)
    return 0
