"""Arguments of ``scaletrain prepare`` (kept free of heavy imports so building the CLI parser is fast).

The CLI adds them with ``add_prepare_arguments(parser)`` and runs
``scaletrain.prepare.build.prepare_from_args(args)``.
"""
from __future__ import annotations

from scaletrain.prepare.gettext import EXCLUDED_DOMAINS, SYSTEM_LOCALE_DIRS

_SHARD_LINES = 50_000  # = build.PARALLEL_SHARD_LINES
_BLOCK_SIZE = 1024  # = build.PARALLEL_BLOCK_SIZE
SOURCES = ("gettext", "opus100", "hf-parquet", "moses", "tsv")
DEFAULT_OUT = {"gettext": "shards/django", "opus100": "shards/opus100"}
CATALOGS_OUT = "shards/catalogs"  # gettext with catalogs other than Django's alone


def add_prepare_arguments(p) -> None:
    """All arguments of ``scaletrain prepare`` (gettext, OPUS-100, Hub Parquet, Moses file pairs, TSV)."""
    p.add_argument("--source", default="gettext", choices=SOURCES, help="input format (default gettext)")
    p.add_argument("--out", default=None, help="output directory (default shards/django for the bundled gettext "
                   f"corpus, {CATALOGS_OUT} for other gettext catalogs, shards/opus100 for opus100; required otherwise)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--langs", default=None, help="comma-separated language codes (gettext: 'all' = every language "
                   "found; default the bundled 14 for Django alone, else the 28 of gettext.CATALOG_LANGS that have "
                   "catalogs on this machine; opus100 and tsv with --tsv-lang-columns: default every language found; "
                   "hf-parquet: keep the pairs whose languages are all listed or en)")
    p.add_argument("--max-bytes", type=int, default=800, help="drop pairs with a side longer than this many UTF-8 "
                   "bytes (default 800; gettext: counted as too_long)")
    g = p.add_argument_group("gettext (catalog roots are merged in the order system, --locale-dir, packages; "
                             "nothing named = the bundled corpus, Django's catalogs)")
    g.add_argument("--catalogs", default=None, metavar="SETS", help="comma-separated catalog sets: system (every "
                   f"existing one of {', '.join(SYSTEM_LOCALE_DIRS)}), packages (every installed Python package "
                   "with gettext catalogs, e.g. django); e.g. --catalogs system,packages")
    g.add_argument("--package", action="append", default=None, metavar="NAME", help="an installed Python package "
                   "whose catalogs to read (repeatable; default django when no other catalogs are named)")
    g.add_argument("--locale-dir", action="append", default=None, metavar="DIR", help="a tree of "
                   "<DIR>/<locale>/LC_MESSAGES/*.mo to read (repeatable; e.g. /usr/share/locale)")
    g.add_argument("--exclude-domains", default=",".join(EXCLUDED_DOMAINS), metavar="PATTERNS",
                   help="comma-separated shell patterns of catalog domains (file names without .mo) to skip "
                   f"(default {','.join(EXCLUDED_DOMAINS)}: ISO 639-3 language and ISO 3166-2 subdivision name "
                   "lists; '' = none)")
    g.add_argument("--max-per-lang", type=int, default=0, metavar="N", help="keep at most N pairs per language, "
                   "chosen by a seeded hash of the English string (0 = all, default)")
    g.add_argument("--valid-frac", type=float, default=0.05)
    g.add_argument("--test-frac", type=float, default=0.05)
    g.add_argument("--seed", type=int, default=0, help="seed of the split hash, the caps and the train shuffle")
    o = p.add_argument_group("opus100")
    o.add_argument("--opus-root", default=None, help="OPUS-100 release folder (the one holding opus-100-corpus, "
                   "or it, its v1.0, or supervised)")
    h = p.add_argument_group("hf-parquet (Hugging Face Hub layout, e.g. OPUS-100 from the Hub)")
    h.add_argument("--input", default=None, help="folder with one <l1>-<l2> subfolder per language pair holding "
                   "<split>-*.parquet files (train, validation, test) with a 'translation' column "
                   "{l1: sentence, l2: sentence}; read with pyarrow in row batches")
    m = p.add_argument_group("moses / tsv (line-aligned files)")
    m.add_argument("--src-lang", default=None, help="source language code (moses, tsv)")
    m.add_argument("--tgt-lang", default=None, help="target language code (moses, tsv)")
    m.add_argument("--prefix", default=None, help="moses train files PREFIX.SRC_LANG and PREFIX.TGT_LANG")
    m.add_argument("--src-file", default=None, help="moses train source file (instead of --prefix)")
    m.add_argument("--tgt-file", default=None, help="moses train target file (instead of --prefix)")
    m.add_argument("--valid-prefix", default=None, help="moses valid files PREFIX.SRC_LANG / PREFIX.TGT_LANG")
    m.add_argument("--test-prefix", default=None, help="moses test files PREFIX.SRC_LANG / PREFIX.TGT_LANG")
    m.add_argument("--tsv-file", default=None, help="tsv train file: src<TAB>tgt per line")
    m.add_argument("--tsv-lang-columns", action="store_true", help="the tsv files have 4 columns, "
                   "src_lang<TAB>tgt_lang<TAB>src<TAB>tgt (languages per line, many directions in one file); "
                   "--langs then lists the languages to keep (default: every code in the files)")
    m.add_argument("--valid-tsv", default=None, help="tsv valid file")
    m.add_argument("--test-tsv", default=None, help="tsv test file")
    f = p.add_argument_group("line-aligned sources (opus100, hf-parquet, moses, tsv): filters and parallelism")
    f.add_argument("--max-ratio", type=float, default=None, help="drop pairs whose longer/shorter byte ratio "
                   "exceeds this (off by default)")
    f.add_argument("--keep-invalid-utf8", action="store_true", help="keep pairs with invalid UTF-8 as raw bytes "
                   "(they are counted either way)")
    f.add_argument("--one-direction", action="store_true", help="write only src->tgt (default: both directions)")
    f.add_argument("--workers", type=int, default=1, help="worker processes writing shards (default 1)")
    f.add_argument("--resume", action="store_true", help="continue an interrupted prepare in --out: complete shards "
                   "(checksum) are kept, the rest redone")
    f.add_argument("--shard-lines", type=int, default=_SHARD_LINES,
                   help=f"input lines (Parquet: rows) per shard (default {_SHARD_LINES:,})")
    f.add_argument("--block-size", type=int, default=_BLOCK_SIZE,
                   help=f"examples per block (default {_BLOCK_SIZE})")
    add_spm_arguments(p.add_argument_group("subword baseline (SentencePiece BPE trained on the train split)"),
                      prefix="--spm-")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


SPM_SENTENCES = 2_000_000  # = scaletrain.prepare.spm_train.DEFAULT_SENTENCES
SPM_COVERAGE = 0.9995
SPM_THREADS = 4


def add_spm_arguments(g, prefix: str = "--") -> None:
    """SentencePiece options: ``prepare --spm-vocab-size N ...`` and ``data spm DIR --vocab-size N ...``."""
    if prefix == "--spm-":
        g.add_argument("--spm-vocab-size", type=int, default=0, help="also train a SentencePiece BPE model of this "
                       "size on the train split and store it beside the shards as spmN.model (0 = none, default)")
    else:
        g.add_argument("--vocab-size", type=int, required=True, help="SentencePiece vocabulary size (specials, 256 "
                       "byte pieces, characters and merges; language tags come on top)")
    g.add_argument(f"{prefix}sentences", type=int, default=SPM_SENTENCES,
                   help=f"train on at most this many sentences, sampled with a fixed seed (default {SPM_SENTENCES:,})")
    g.add_argument(f"{prefix}character-coverage", type=float, default=SPM_COVERAGE,
                   help=f"share of characters the model keeps as pieces; the rest are spelled as bytes "
                   f"(0.98..1, default {SPM_COVERAGE})")
    g.add_argument(f"{prefix}threads", type=int, default=SPM_THREADS,
                   help=f"trainer threads; recorded in the model file, keep it fixed for identical models "
                   f"(default {SPM_THREADS})")
