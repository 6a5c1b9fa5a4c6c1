"""``scaletrain prepare``: corpus -> shards + manifest (gettext catalogs; line-aligned corpora such as OPUS-100,
Moses file pairs, TSV, the Hub's Parquet layout), written in parallel and resumable."""
from __future__ import annotations

import json
import shutil
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from scaletrain.data.example import Example
from scaletrain.data.shards import (
    MANIFEST,
    SPLITS,
    DirectionStats,
    Manifest,
    ShardInfo,
    SplitInfo,
    SplitWriter,
    load_manifest,
    prepare_out_dir,
    shard_name,
    write_manifest,
)
from scaletrain.errors import ScaletrainError
from scaletrain.fileio import atomic_write_bytes, sha256_file
from scaletrain.prepare.args import CATALOGS_OUT, DEFAULT_OUT
from scaletrain.prepare.gettext import (
    CATALOG_LANGS,
    DEFAULT_LANGS,
    EXCLUDED_DOMAINS,
    PIVOT,
    CatalogRoot,
    single_root,
    check_fracs,
    read_catalogs,
    resolve_roots,
    split_key,
    split_of,
)
from scaletrain.prepare.hf_parquet import check_schema, hf_parquet_corpora, read_parquet_range
from scaletrain.prepare.opus import opus100_corpora
from scaletrain.prepare.parallel_text import (
    FILTER_REASONS,
    KEPT_NOTES,
    PairFilter,
    ParallelCorpus,
    check_same_lines,
    index_lines,
    lang_code,
    read_pair_range,
    read_tsv_lang_range,
    read_tsv_range,
    tsv_languages,
)
from scaletrain.prepare.spm_train import add_spm_model, check_spm_args

GETTEXT_SHARD_SIZE = 2048  # examples per shard at least: the bundled django train set gives >= 4 train shards
GETTEXT_TRAIN_SHARDS = 32  # larger corpora: about this many train shards (enough for ranks x loader workers)
GETTEXT_BLOCK_SIZE = 256  # examples per block


def prepare_gettext(
    package: str = "django",
    langs: Sequence[str] | None = None,
    out: str | Path = "shards/django",
    overwrite: bool = False,
    valid_frac: float = 0.05,
    test_frac: float = 0.05,
    seed: int = 0,
    shard_size: int | None = None,
    progress: bool = True,
    *,
    block_size: int = GETTEXT_BLOCK_SIZE,
    locale_dir: str | Path | None = None,
    roots: Sequence[CatalogRoot] | None = None,
    default_langs: Sequence[str] = CATALOG_LANGS,
    exclude_domains: Sequence[str] = EXCLUDED_DOMAINS,
    max_per_lang: int = 0,
    max_bytes: int = 0,
    notes: Sequence[str] = (),
) -> Manifest:
    """Read gettext catalogs, clean, merge, split by English-string hash, write both directions to shards.

    ``roots`` (see ``gettext.resolve_roots``): the catalog trees to merge; without them the single
    ``package`` (or ``locale_dir``), whose languages default to ``DEFAULT_LANGS`` (all required); with them
    the ``default_langs`` (``CATALOG_LANGS``) that have catalogs there. ``max_per_lang`` / ``max_bytes``: see
    ``gettext.read_catalogs``. ``shard_size`` (examples per shard) defaults to ``GETTEXT_SHARD_SIZE`` or
    enough for about ``GETTEXT_TRAIN_SHARDS`` train shards, whichever is larger. ``notes`` (e.g. catalog
    sets that found nothing) are recorded in the manifest beside the reader's own.

    Manifest languages are ``["en", *langs]`` (the vocabulary order). The train split is shuffled
    with ``seed`` before sharding (so every block mixes languages); valid/test keep a readable
    order (language, then catalog order; xx->en and en->xx interleaved per pair).
    """
    check_fracs(valid_frac, test_frac)
    if roots is None:
        roots = [single_root(package, locale_dir)]
        langs = list(DEFAULT_LANGS) if langs is None else langs
    corpus = read_catalogs(roots, langs, default_langs=default_langs,
                           exclude_domains=exclude_domains, max_per_lang=max_per_lang, max_bytes=max_bytes, seed=seed)
    languages = [PIVOT, *corpus.langs]
    by_split, split_counts = _gettext_splits(corpus, valid_frac, test_frac, seed)
    if shard_size is None:
        shard_size = max(GETTEXT_SHARD_SIZE, -(-len(by_split["train"]) // GETTEXT_TRAIN_SHARDS))
    out = prepare_out_dir(out, overwrite)
    total = sum(len(v) for v in by_split.values())
    bar = tqdm(total=total, desc=f"prepare {out}", unit="ex", disable=not progress)
    splits = {}
    for s in SPLITS:
        if not by_split[s]:
            continue
        w = SplitWriter(out, s, languages, shard_size=shard_size, block_size=block_size,
                        on_shard=lambda sh: bar.update(sh.n_examples))
        w.add_all(by_split[s])
        splits[s] = w.close()
    bar.close()
    cleaning = {
        "rules": "scaletrain.prepare.gettext (see module doc)",
        "total": corpus.total_counters(),
        "per_lang": corpus.counters,
        "per_source": corpus.per_source,
        "scripts": corpus.scripts,
        "pairs_per_split": split_counts,
        "notes": [*notes, *corpus.notes],
    }
    params = {
        "valid_frac": valid_frac,
        "test_frac": test_frac,
        "seed": seed,
        "shard_size": shard_size,
        "block_size": block_size,
        "directions": "both (xx-en and en-xx)",
        "split_key": "gettext.split_key (NFKC, case folded, punctuation runs as one space)",
    }
    manifest = Manifest(languages=languages, splits=splits, cleaning=cleaning, source=corpus.source, params=params)
    write_manifest(out, manifest)
    return manifest


def _gettext_splits(corpus, valid_frac: float, test_frac: float, seed: int):
    """Both directions of every pair, by split (the hash of the English string's split key decides), the
    train split shuffled with ``seed``; and the pairs per split and language (for the manifest)."""
    by_split: dict[str, list[Example]] = {s: [] for s in SPLITS}
    split_counts: dict[str, dict[str, int]] = {s: {} for s in SPLITS}
    split_memo: dict[str, str] = {}  # one English string recurs in many languages: hash it once
    for li, lang in enumerate(corpus.langs, start=1):
        for en, xx in corpus.pairs[lang]:
            s = split_memo.get(en)
            if s is None:
                s = split_memo[en] = split_of(split_key(en), valid_frac, test_frac, seed)
            e, x = en.encode("utf-8"), xx.encode("utf-8")
            by_split[s].append(Example(li, 0, x, e))
            by_split[s].append(Example(0, li, e, x))
            split_counts[s][lang] = split_counts[s].get(lang, 0) + 1
    if not by_split["train"]:
        raise ScaletrainError("no training pairs left after cleaning; choose more languages or another source")
    rng = np.random.default_rng([seed, 0x5EED])
    train = by_split["train"]
    by_split["train"] = [train[i] for i in rng.permutation(len(train))]
    return by_split, split_counts


# ---------------------------------------------------------------------------------------------
# line-aligned corpora (Moses file pairs, TSV, OPUS-100): streaming, parallel, resumable
# ---------------------------------------------------------------------------------------------
PARALLEL_SHARD_LINES = 50_000  # input lines per shard (x2 examples with both directions)
PARALLEL_BLOCK_SIZE = 1024
STATE_DIR = ".prepare"  # per-shard completion records while a prepare runs; removed at the end
PLAN_KEYS = ("corpus", "src_off", "tgt_off", "n_lines", "index")  # what plan.json records of each task


def _vocab_order(corpora: Sequence[ParallelCorpus]) -> list[str]:
    """Languages of the corpora, the pivot (en) first, then sorted; 4-column TSVs are scanned."""
    langs = {l for c in corpora if not c.lang_columns for l in (c.src_lang, c.tgt_lang)}
    for c in corpora:
        if c.lang_columns:
            langs |= tsv_languages(c.tsv_path)
    return order_languages(langs)


def order_languages(langs) -> list[str]:
    langs = set(langs)
    return ([PIVOT] if PIVOT in langs else []) + sorted(langs - {PIVOT})


def _lang_column_pairs(task: dict, counters: Counter, lang_idx: dict):
    """(src_idx, tgt_idx, (src, tgt) or None) per line of a 4-column TSV range: malformed lines give
    ``None`` pairs, unknown languages are counted and skipped, a non-code is an error (file:line)."""
    path, first = task["corpus"]["tsv_path"], task["first_line"]
    for j, row in enumerate(read_tsv_lang_range(path, task["src_off"], task["n_lines"])):
        if row is None:
            yield 0, 0, None
            continue
        a, b = lang_code(row[0], path, first + j + 1), lang_code(row[1], path, first + j + 1)
        if a == b:
            yield 0, 0, None
            continue
        if a not in lang_idx or b not in lang_idx:
            counters["lines"] += 1
            counters["unknown_lang"] += 1
            continue
        yield lang_idx[a], lang_idx[b], (row[2], row[3])


def _index_corpus(c: ParallelCorpus, every: int) -> tuple[int, list[tuple[int, int]]]:
    """(n_lines, [(src_offset, tgt_offset)] per range); line-count mismatch -> ScaletrainError.
    A Parquet corpus counts rows, and its offsets are row numbers."""
    if c.parquet_path is not None:
        n = check_schema(c.parquet_path, c.src_lang, c.tgt_lang)
        return n, [(r, r) for r in range(0, n, every)] or [(0, 0)]
    if c.tsv_path is not None:
        ix = index_lines(c.tsv_path, every)
        return ix.n_lines, [(o, o) for o in ix.offsets]
    a, b = index_lines(c.src_path, every), index_lines(c.tgt_path, every)
    check_same_lines(a, b)
    return a.n_lines, list(zip(a.offsets, b.offsets))


def _run_task(task: dict) -> dict:
    """Read one line range, filter, write one shard (if anything survives) and its completion record."""
    c = ParallelCorpus(**task["corpus"])
    flt = PairFilter(task["max_bytes"], task["max_ratio"], task.get("keep_invalid_utf8", False))
    si, ti = task["src_idx"], task["tgt_idx"]
    so, to, n = task["src_off"], task["tgt_off"], task["n_lines"]
    counters = Counter({k: 0 for k in ("lines", "kept", *FILTER_REASONS, *KEPT_NOTES)})
    if c.lang_columns:
        counters["unknown_lang"] = 0
        rows = _lang_column_pairs(task, counters, {l: i for i, l in enumerate(task["languages"])})
    else:
        if c.parquet_path:
            pairs = read_parquet_range(c.parquet_path, c.src_lang, c.tgt_lang, so, n)
        elif c.tsv_path:
            pairs = read_tsv_range(c.tsv_path, so, n)
        else:
            pairs = read_pair_range(c.src_path, c.tgt_path, so, to, n)
        rows = ((si, ti, p) for p in pairs)
    out = Path(task["out"])
    w = SplitWriter(out, c.split, task["languages"], shard_size=1 << 62, block_size=task["block_size"],
                    first_index=task["index"])
    for si, ti, pair in rows:
        counters["lines"] += 1
        reason, src, tgt = flt(pair)
        if reason is not None:
            counters[reason] += 1
            if reason not in KEPT_NOTES:
                continue
        counters["kept"] += 1
        w.add(Example(si, ti, src, tgt))
        if task["both"]:
            w.add(Example(ti, si, tgt, src))
    if counters["lines"] != n:
        raise ScaletrainError(f"{c.src_path or c.tsv_path or c.parquet_path}: file changed while preparing (read {counters['lines']} "
                              f"of {n} lines at byte {so})")
    info = w.close()
    rec = {
        "index": task["index"],
        "split": c.split,
        "corpus": c.name,
        "shard": info.shards[0].to_dict() if info.shards else None,
        "counters": dict(counters),
        "directions": {k: asdict(v) for k, v in info.directions.items()},
    }
    atomic_write_bytes(out / STATE_DIR / f"{task['split_key']}.json", json.dumps(rec).encode())
    return rec


def _record_if_complete(out: Path, task: dict) -> dict | None:
    """The completion record of a task whose shard is on disk with the recorded checksum."""
    p = out / STATE_DIR / f"{task['split_key']}.json"
    try:
        rec = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    sh = rec.get("shard")
    if sh is None:
        return rec
    f = out / sh["name"]
    try:
        if f.stat().st_size != sh["bytes"] or sha256_file(f) != sh["sha256"]:
            return None
    except OSError:
        return None
    return rec


def prepare_parallel(
    corpora: Sequence[ParallelCorpus],
    out: str | Path,
    *,
    languages: Sequence[str] | None = None,
    both_directions: bool = True,
    max_bytes: int = 800,
    max_ratio: float | None = None,
    keep_invalid_utf8: bool = False,
    shard_lines: int = PARALLEL_SHARD_LINES,
    block_size: int = PARALLEL_BLOCK_SIZE,
    workers: int = 1,
    overwrite: bool = False,
    resume: bool = False,
    progress: bool = True,
    source: dict | None = None,
) -> Manifest:
    """Line-aligned corpora -> shards + manifest, streaming, in ``workers`` processes.

    Every ``shard_lines`` input lines of a corpus become one shard (numbered per split in corpus
    order, so names do not depend on scheduling; a range whose lines are all filtered out leaves a
    gap in the numbers). Blocks hold one language pair (both directions interleaved); the stream
    mixes blocks. ``resume=True`` continues an interrupted run in the same directory: shards whose
    completion record and sha256 match are kept, the rest are redone.
    """
    if not corpora:
        raise ScaletrainError("no corpora given")
    if shard_lines < 1 or workers < 1:
        raise ScaletrainError(f"shard_lines ({shard_lines}) and workers ({workers}) must be >= 1")
    PairFilter(max_bytes, max_ratio, keep_invalid_utf8)  # validates
    languages = _check_corpora(corpora, languages)
    out = Path(out)
    state = out / STATE_DIR
    if resume and (out / MANIFEST).is_file() and not state.exists():
        return load_manifest(out)  # already complete
    params = {"both_directions": both_directions, "max_bytes": max_bytes, "max_ratio": max_ratio,
              "shard_lines": shard_lines, "block_size": block_size}
    if keep_invalid_utf8:
        params["keep_invalid_utf8"] = True
    _open_state_dir(out, resume, overwrite)
    filters = {"both": both_directions, "max_bytes": max_bytes, "max_ratio": max_ratio, "block_size": block_size,
               "keep_invalid_utf8": keep_invalid_utf8}
    tasks = _plan_tasks(corpora, out, languages, shard_lines, filters, progress)
    _check_plan(out, {"languages": languages, "params": params, "tasks": [{k: t[k] for k in PLAN_KEYS} for t in tasks]})
    records = _run_tasks(out, tasks, resume, workers, progress)
    splits, per_corpus = _assemble_splits(tasks, records)
    total: Counter = Counter()
    for c in per_corpus.values():
        total.update(c)
    cleaning = {"rules": "scaletrain.prepare.parallel_text.PairFilter", "total": dict(total),
                "per_corpus": {k: dict(v) for k, v in per_corpus.items()}}
    src = dict(source or {"type": "parallel"})
    src["corpora"] = [asdict(c) for c in corpora]
    manifest = Manifest(languages=languages, splits=splits, cleaning=cleaning, source=src, params=params)
    write_manifest(out, manifest)
    shutil.rmtree(state, ignore_errors=True)
    return manifest


def _check_corpora(corpora: Sequence[ParallelCorpus], languages: Sequence[str] | None) -> list[str]:
    """The vocabulary's languages (given, or those of the corpora); every corpus language must be
    among them and there must be a train corpus."""
    languages = list(languages) if languages is not None else _vocab_order(corpora)
    for c in corpora:
        for l in (() if c.lang_columns else (c.src_lang, c.tgt_lang)):
            if l not in languages:
                raise ScaletrainError(f"corpus {c.name}: language {l!r} is not in languages {languages}")
    if not any(c.split == "train" for c in corpora):
        raise ScaletrainError("no train corpus given")
    return languages


def _open_state_dir(out: Path, resume: bool, overwrite: bool) -> None:
    """Start a run (an empty ``out`` with a fresh state directory) or, with ``resume``, continue the
    interrupted one whose state directory is there (its manifest, if any, goes first)."""
    state = out / STATE_DIR
    if not (resume and state.is_dir()):
        if state.is_dir() and not overwrite:
            raise ScaletrainError(f"{out} holds an interrupted prepare; pass resume=True (--resume) to continue it "
                                  "or overwrite=True (--overwrite) to start again")
        if overwrite and state.is_dir():
            shutil.rmtree(state)
        prepare_out_dir(out, overwrite)
        state.mkdir()
    elif (out / MANIFEST).exists():
        (out / MANIFEST).unlink()


def _plan_tasks(corpora: Sequence[ParallelCorpus], out: Path, languages: list[str], shard_lines: int,
                filters: dict, progress: bool) -> list[dict]:
    """Index every corpus (one streaming pass) and cut it into line ranges: one task (and at most
    one shard) per ``shard_lines`` lines, numbered per split in corpus order. ``filters`` holds the
    settings every task shares (both, max_bytes, max_ratio, block_size, keep_invalid_utf8)."""
    lang_idx = {l: i for i, l in enumerate(languages)}
    tasks = []
    next_index = {s: 0 for s in SPLITS}
    for c in tqdm(corpora, desc="index corpora", unit="corpus", disable=not progress):
        n, offs = _index_corpus(c, shard_lines)
        for k, (so, to) in enumerate(offs if n else []):
            i = next_index[c.split]
            next_index[c.split] += 1
            tasks.append({
                "corpus": asdict(c), "src_idx": lang_idx.get(c.src_lang, -1), "tgt_idx": lang_idx.get(c.tgt_lang, -1),
                "src_off": so, "tgt_off": to, "n_lines": min(shard_lines, n - k * shard_lines),
                "index": i, "split_key": shard_name(c.split, i)[:-4], "out": str(out), "languages": languages,
                **filters, "first_line": k * shard_lines,
            })
    return tasks


def _check_plan(out: Path, plan: dict) -> None:
    """Write the run's plan to the state directory, or check that an interrupted run had the same one."""
    plan_path = out / STATE_DIR / "plan.json"
    if plan_path.is_file():
        if json.loads(plan_path.read_text()) != json.loads(json.dumps(plan)):
            raise ScaletrainError(f"{out}: the interrupted prepare used other inputs or settings; "
                                  "rerun with overwrite=True (--overwrite) instead of resume")
    else:
        atomic_write_bytes(plan_path, json.dumps(plan).encode())


def _run_tasks(out: Path, tasks: list[dict], resume: bool, workers: int, progress: bool) -> dict[str, dict]:
    """Run every task not already complete (``resume``), in ``workers`` processes; returns the
    completion records by split key, each shard entry held as a ShardInfo (block tables as arrays:
    the main process stays small however many shards there are)."""
    records: dict[str, dict] = {}

    def keep(rec: dict) -> dict:
        if rec["shard"] is not None:
            rec["shard"] = ShardInfo.from_dict(rec["shard"])
        records[f"{rec['split']}-{rec['index']:06d}"] = rec
        return rec

    todo = []
    for t in tasks:
        rec = _record_if_complete(out, t) if resume else None
        if rec is not None:
            keep(rec)
        else:
            todo.append(t)
    bar = tqdm(total=sum(t["n_lines"] for t in tasks), desc=f"prepare {out}", unit="line", disable=not progress)
    bar.update(sum(r["counters"]["lines"] for r in records.values()))
    if workers == 1 or len(todo) <= 1:
        for t in todo:
            bar.update(keep(_run_task(t))["counters"]["lines"])
    else:
        for rec in _run_in_pool(todo, workers):
            bar.update(keep(rec)["counters"]["lines"])
    bar.close()
    return records


def _run_in_pool(todo: list[dict], workers: int) -> Iterator[dict]:
    """Completion records of ``todo`` run in ``workers`` processes, as they finish."""
    with ProcessPoolExecutor(max_workers=workers) as ex:
        pending = {ex.submit(_run_task, t) for t in todo[: 2 * workers]}
        queue = iter(todo[2 * workers:])
        while pending:  # a bounded number of tasks in flight: no future holds a result for long
            done = next(as_completed(pending))
            pending.remove(done)
            yield done.result()
            t = next(queue, None)
            if t is not None:
                pending.add(ex.submit(_run_task, t))


def _assemble_splits(tasks: list[dict], records: dict[str, dict]) -> tuple[dict[str, SplitInfo], dict[str, Counter]]:
    """The manifest's splits in shard order, and the filter counters summed per corpus."""
    splits: dict[str, SplitInfo] = {}
    per_corpus: dict[str, Counter] = {}
    for t in tasks:
        rec = records[t["split_key"]]
        per_corpus.setdefault(rec["corpus"], Counter()).update(rec["counters"])
        si = splits.setdefault(rec["split"], SplitInfo(0, [], {}))
        if rec["shard"] is not None:
            sh = rec["shard"]
            si.shards.append(sh)
            si.n_examples += sh.n_examples
        for k, v in rec["directions"].items():
            d = si.directions.setdefault(k, DirectionStats())
            d.n += v["n"]
            d.src_bytes += v["src_bytes"]
            d.tgt_bytes += v["tgt_bytes"]
    splits = {s: splits[s] for s in SPLITS if s in splits}
    for si in splits.values():
        si.directions = dict(sorted(si.directions.items()))
    if "train" not in splits or not splits["train"].shards:
        raise ScaletrainError("no training pairs left after filtering; check the corpus files and filters")
    return splits, per_corpus


def prepare_opus100(root: str | Path, out: str | Path, *, langs: Sequence[str] | None = None, **kwargs) -> Manifest:
    """OPUS-100 (``opus-100-corpus/v1.0/supervised``) -> shards; kwargs as ``prepare_parallel``."""
    corpora, source = opus100_corpora(root, langs)
    return prepare_parallel(corpora, out, source=source, **kwargs)


def prepare_hf_parquet(root: str | Path, out: str | Path, *, langs: Sequence[str] | None = None,
                       **kwargs) -> Manifest:
    """Hugging Face Hub layout (``<l1>-<l2>/<split>-*.parquet`` with a ``translation`` column) -> shards;
    kwargs as ``prepare_parallel``. See ``scaletrain.prepare.hf_parquet``."""
    corpora, source = hf_parquet_corpora(root, langs)
    return prepare_parallel(corpora, out, source=source, **kwargs)


# ---------------------------------------------------------------------------------------------
# command line: `scaletrain prepare` (the CLI adds these arguments and calls prepare_from_args)
# ---------------------------------------------------------------------------------------------
def _split_langs(s: str | None) -> list[str] | None:
    return [x.strip() for x in s.split(",") if x.strip()] if s else None


def corpora_from_args(args) -> tuple[list[ParallelCorpus], dict]:
    """The line-aligned corpora named by moses / tsv arguments (and a source description)."""
    src, tgt = args.src_lang, args.tgt_lang
    lang_columns = getattr(args, "tsv_lang_columns", False)
    if lang_columns:
        if args.source != "tsv":
            raise ScaletrainError("--tsv-lang-columns belongs to --source tsv")
        if src or tgt:
            raise ScaletrainError("--src-lang/--tgt-lang do not apply with --tsv-lang-columns: each line names its "
                                  "languages (src_lang<TAB>tgt_lang<TAB>src<TAB>tgt); use --langs to restrict them")
    elif not src or not tgt:
        raise ScaletrainError(f"--source {args.source} needs --src-lang and --tgt-lang (e.g. --src-lang de --tgt-lang en)")
    if src == tgt and not lang_columns:
        raise ScaletrainError(f"--src-lang and --tgt-lang are both {src!r}")
    corpora = []
    if args.source == "moses":
        if args.tsv_file or args.valid_tsv or args.test_tsv:
            raise ScaletrainError("--tsv-file/--valid-tsv/--test-tsv belong to --source tsv, not moses")
        if args.prefix and (args.src_file or args.tgt_file):
            raise ScaletrainError("give either --prefix or --src-file/--tgt-file, not both")
        if args.prefix:
            corpora.append(ParallelCorpus("train", src, tgt, f"{args.prefix}.{src}", f"{args.prefix}.{tgt}"))
        elif args.src_file and args.tgt_file:
            corpora.append(ParallelCorpus("train", src, tgt, args.src_file, args.tgt_file))
        else:
            raise ScaletrainError("--source moses needs --prefix PREFIX (PREFIX.SRC_LANG, PREFIX.TGT_LANG) "
                                  "or both --src-file and --tgt-file")
        for split, pre in (("valid", args.valid_prefix), ("test", args.test_prefix)):
            if pre:
                corpora.append(ParallelCorpus(split, src, tgt, f"{pre}.{src}", f"{pre}.{tgt}"))
    elif getattr(args, "tsv_lang_columns", False):
        if args.prefix or args.src_file or args.tgt_file or args.valid_prefix or args.test_prefix:
            raise ScaletrainError("--prefix/--src-file/--tgt-file/--valid-prefix/--test-prefix belong to "
                                  "--source moses, not tsv")
        if not args.tsv_file:
            raise ScaletrainError("--source tsv needs --tsv-file FILE (src_lang<TAB>tgt_lang<TAB>src<TAB>tgt per line "
                                  "with --tsv-lang-columns)")
        for split, path in (("train", args.tsv_file), ("valid", args.valid_tsv), ("test", args.test_tsv)):
            if path:
                corpora.append(ParallelCorpus(split, "", "", tsv_path=path, lang_columns=True))
    else:
        if args.prefix or args.src_file or args.tgt_file or args.valid_prefix or args.test_prefix:
            raise ScaletrainError("--prefix/--src-file/--tgt-file/--valid-prefix/--test-prefix belong to "
                                  "--source moses, not tsv")
        if not args.tsv_file:
            raise ScaletrainError("--source tsv needs --tsv-file FILE (src<TAB>tgt per line)")
        for split, path in (("train", args.tsv_file), ("valid", args.valid_tsv), ("test", args.test_tsv)):
            if path:
                corpora.append(ParallelCorpus(split, src, tgt, tsv_path=path))
    return corpora, ({"type": args.source, "lang_columns": True} if lang_columns else {"type": args.source})


def cleaning_summary(cleaning: dict) -> str:
    """One line of what the cleaning kept and dropped (the manifest's ``cleaning.total``), e.g.
    ``cleaning: 1,000 lines read, 990 kept; dropped: malformed 3, nul 2, too_long 5``."""
    total = dict((cleaning or {}).get("total") or {})
    if not total:
        return ""
    read_key = "lines" if "lines" in total else "entries"
    read, kept = total.pop(read_key, 0), total.pop("kept", 0)
    notes = {k: total.pop(k) for k in list(total) if k in KEPT_NOTES or k.endswith("_stripped")}
    dropped = ", ".join(f"{k} {v:,}" for k, v in total.items() if v) or "none"
    line = f"cleaning: {read:,} {'lines' if read_key == 'lines' else 'catalog entries'} read, {kept:,} kept; dropped: {dropped}"
    kept_notes = ", ".join(f"{k} {v:,}" for k, v in notes.items() if v)
    return line + (f"; kept with notes: {kept_notes}" if kept_notes else "")


def _gettext_bundled(args) -> bool:
    """No catalogs named, or Django's alone: the bundled corpus (its languages, its directory)."""
    return not (getattr(args, "catalogs", None) or getattr(args, "locale_dir", None)) and \
        (getattr(args, "package", None) or ["django"]) == ["django"]


def _gettext_default_out(args) -> str:
    return DEFAULT_OUT["gettext"] if _gettext_bundled(args) else CATALOGS_OUT


def _prepare_gettext_from_args(args, out: str, langs: list[str] | None, progress: bool) -> Manifest:
    if args.resume or args.workers != 1 or args.opus_root:
        raise ScaletrainError("--resume, --workers and --opus-root are for line-aligned sources "
                              "(--source opus100/hf-parquet/moses/tsv); gettext catalogs are read in one pass")
    roots, notes = resolve_roots(_split_langs(args.catalogs) or (), args.locale_dir or (), args.package or ())
    for n in notes:
        print(f"note: {n}")
    exclude = [x.strip() for x in (args.exclude_domains or "").split(",") if x.strip()]
    return prepare_gettext(langs=langs, out=out, overwrite=args.overwrite, valid_frac=args.valid_frac,
                           test_frac=args.test_frac, seed=args.seed, progress=progress, roots=roots,
                           default_langs=DEFAULT_LANGS if _gettext_bundled(args) else CATALOG_LANGS,
                           exclude_domains=exclude, max_per_lang=args.max_per_lang, max_bytes=args.max_bytes,
                           notes=notes)


def gettext_report(m: Manifest) -> str:
    """What a gettext prepare read and kept: one line per catalog root, one per language (script, pairs per
    split, what its rules dropped), the number of languages and scripts, and the notes."""
    cl = m.cleaning or {}
    lines = []
    for label, c in (cl.get("per_source") or {}).items():
        quiet = ("catalogs", "entries", "kept", "accel_stripped", "excluded_catalogs")
        dropped = ", ".join(f"{k} {v:,}" for k, v in c.items() if v and k not in quiet)
        lines.append(f"source {label}: {c.get('catalogs', 0):,} catalogs ({c.get('excluded_catalogs', 0):,} excluded "
                     f"by domain), {c.get('entries', 0):,} entries, {c.get('kept', 0):,} pairs kept"
                     + (f"; dropped: {dropped}" if dropped else ""))
    scripts = cl.get("scripts") or {}
    per_split = cl.get("pairs_per_split") or {}
    langs = m.languages[1:]
    lines.append(f"{len(langs)} languages (+ en) in {len(set(scripts.values()))} scripts:")
    lines.append(f"  {'lang':8} {'script':11} {'pairs':>8} {'train':>8} {'valid':>6} {'test':>6}  dropped")
    for lang in langs:
        c = (cl.get("per_lang") or {}).get(lang, {})
        n = [per_split.get(s, {}).get(lang, 0) for s in SPLITS]
        dropped = ", ".join(f"{k} {v:,}" for k, v in c.items() if v and k not in ("entries", "kept", "accel_stripped"))
        lines.append(f"  {lang:8} {scripts.get(lang, '?'):11} {sum(n):8,} {n[0]:8,} {n[1]:6,} {n[2]:6,}  {dropped}")
    lines += [f"note: {x}" for x in cl.get("notes") or []]
    return "\n".join(lines)


def prepare_from_args(args) -> int:
    """Run ``prepare`` for parsed ``add_prepare_arguments`` args; prints a summary, returns 0."""
    source = args.source
    if getattr(args, "tsv_lang_columns", False) and source != "tsv":
        raise ScaletrainError(f"--tsv-lang-columns belongs to --source tsv, not {source}")
    out = args.out or (_gettext_default_out(args) if source == "gettext" else DEFAULT_OUT.get(source))
    if out is None:
        raise ScaletrainError(f"--source {source} needs --out DIR")
    progress = not getattr(args, "no_progress", False)
    if getattr(args, "spm_vocab_size", 0):
        check_spm_args(args.spm_vocab_size, args.spm_sentences, args.spm_character_coverage, args.spm_threads,
                       prefix="--spm-")
    langs = _split_langs(args.langs)
    if getattr(args, "input", None) and source != "hf-parquet":
        raise ScaletrainError(f"--input belongs to --source hf-parquet, not {source}")
    if source == "gettext":
        m = _prepare_gettext_from_args(args, out, langs, progress)
    else:
        kw = dict(both_directions=not args.one_direction, max_bytes=args.max_bytes, max_ratio=args.max_ratio,
                  keep_invalid_utf8=args.keep_invalid_utf8, shard_lines=args.shard_lines,
                  block_size=args.block_size, workers=args.workers, overwrite=args.overwrite, resume=args.resume,
                  progress=progress)
        if source == "opus100":
            if not args.opus_root:
                raise ScaletrainError("--source opus100 needs --opus-root DIR (the OPUS-100 release folder)")
            m = prepare_opus100(args.opus_root, out, langs=langs, **kw)
        elif source == "hf-parquet":
            if not args.input:
                raise ScaletrainError("--source hf-parquet needs --input DIR (one <l1>-<l2> folder per pair with "
                                      "<split>-*.parquet files, as on the Hugging Face Hub)")
            m = prepare_hf_parquet(args.input, out, langs=langs, **kw)
        else:
            lang_columns = getattr(args, "tsv_lang_columns", False)
            if langs and not lang_columns:
                raise ScaletrainError(f"--langs is for gettext, opus100 and --tsv-lang-columns; --source {source} "
                                      "uses --src-lang/--tgt-lang")
            corpora, src = corpora_from_args(args)
            if langs:  # 4-column TSV: the languages to keep (others are counted as unknown_lang)
                kw["languages"] = order_languages(langs)
            m = prepare_parallel(corpora, out, source=src, **kw)
    if getattr(args, "spm_vocab_size", 0):
        e = add_spm_model(out, args.spm_vocab_size, max_sentences=args.spm_sentences,
                          character_coverage=args.spm_character_coverage, num_threads=args.spm_threads,
                          progress=progress)  # a complete --resume keeps its recorded model
        print(f"wrote {Path(out) / e['file']}: SentencePiece BPE, {e['vocab_size']:,} pieces "
              f"(sha256 {e['sha256'][:12]})")
    n = {s: info.n_examples for s, info in m.splits.items()}
    print(f"wrote {out}: {len(m.languages)} languages, {sum(n.values()):,} examples "
          f"({', '.join(f'{s} {v:,}' for s, v in n.items())})")
    if source == "gettext":
        print(gettext_report(m))
    summary = cleaning_summary(m.cleaning)
    if summary:
        print(summary)
    no_eval = m.source.get("no_eval") if isinstance(m.source, dict) else None
    if no_eval:
        print(f"train only (no valid/test, left out of evaluation): {', '.join(no_eval)}")
    return 0
