"""``scaletrain model summary RECIPE [KEY=VALUE ...]``: parameters per component and FLOPs per token.

The vocabulary is the byte layout (4 specials + 256 bytes + one tag per language): ``--langs N``
(default 100, the OPUS-100 layout of the papers: 360 ids) or ``--shards DIR`` to take the languages
of a shard manifest. Subword recipes (``data.tokenizer: spm``) use the shard directory's SentencePiece
model with ``--shards``, else a stand-in vocabulary of ``--spm-size`` pieces. The model is built on the meta device, so paper-size models cost no memory.
"""
from __future__ import annotations

import json

from scaletrain.errors import ScaletrainError


def _summary(args) -> int:
    from scaletrain.config import load_config
    from scaletrain.models.summary import format_summary, model_summary
    from scaletrain.vocab import LANG_OFFSET

    cfg = load_config(args.recipe, args.overrides)
    from scaletrain.data.shards import load_manifest

    if args.shards:
        n_langs = len(load_manifest(args.shards).languages)
    else:
        n_langs = args.langs
    if n_langs < 0:
        raise ScaletrainError(f"--langs must be >= 0, got {n_langs}")
    if args.src_len < 1 or args.tgt_len < 1:
        raise ScaletrainError("--src-len and --tgt-len must be >= 1")
    pieces = None
    if cfg.data.tokenizer == "byte":
        vocab_size = LANG_OFFSET + n_langs
    elif args.shards:  # the real SentencePiece model of those shards
        from scaletrain.data.spm_models import load_shard_vocab

        vocab = load_shard_vocab(load_manifest(args.shards).languages, "spm", args.shards,
                           vocab_size=cfg.data.spm_vocab_size)
        vocab_size, pieces = vocab.size, vocab.pieces()
    else:  # no shards: a stand-in vocabulary of the configured size (pieces of 1-6 latin letters)
        n_spm = args.spm_size or cfg.data.spm_vocab_size or 8000
        vocab_size = n_spm + n_langs
        pieces = [""] * 4 + [chr(0x61 + i % 26) * (1 + i % 6) for i in range(n_spm - 4)] + [""] * n_langs
    s = model_summary(cfg.model, vocab_size, args.src_len, args.tgt_len, pieces=pieces, moe=cfg.moe)
    if args.json:
        print(json.dumps({**s, "recipe": cfg.name, "components": dict(s["components"])}, indent=2))
    else:
        print(format_summary(s, title=f"recipe {cfg.name}"))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("model", help="inspect model architectures (parameters, FLOPs)")
    sub = p.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    s = sub.add_parser("summary", help="parameters per component and training FLOPs per target token")
    s.add_argument("recipe", help="recipe name (packaged) or path to a YAML file")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. model.d_model=256")
    s.add_argument("--langs", type=int, default=100,
                   help="number of language tags in the vocabulary (default 100: OPUS-100, 360 ids)")
    s.add_argument("--shards", default=None, help="take the languages (and, with data.tokenizer=spm, the "
                   "SentencePiece vocabulary) from this shard directory")
    s.add_argument("--spm-size", type=int, default=0, help="data.tokenizer=spm without --shards: pieces in the "
                   "stand-in vocabulary (default data.spm_vocab_size, else 8000)")
    s.add_argument("--src-len", type=int, default=100, help="source tokens per sentence for FLOPs (default 100)")
    s.add_argument("--tgt-len", type=int, default=100, help="target tokens per sentence for FLOPs (default 100)")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=_summary)
