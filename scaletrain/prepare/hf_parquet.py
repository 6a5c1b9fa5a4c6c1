"""Hugging Face Hub layout of translation datasets (e.g. OPUS-100 as published on the Hub) -> corpora.

Layout (what a snapshot of the dataset repository holds)::

    DIR/<l1>-<l2>/<split>-00000-of-00001.parquet   # one folder per language pair
    DIR/<l1>-<l2>/<split>-00001-of-00002.parquet   # a split may come in several files

Each Parquet file has a ``translation`` column: a struct with one string field per language code
(``{"de": "...", "en": "..."}``). Pairs come from the folder names (``de-en``: source ``de``,
target ``en``; with both directions, the default, the order does not matter), splits from the file
names (``train``; ``validation``, ``valid`` or ``dev`` -> valid; ``test``). ``DIR`` may also be a
single pair folder. Other files (README.md, .gitattributes) and hidden folders are ignored.

Files are read in record batches with ``pyarrow`` (no ``datasets`` at run time); each task reads
one range of rows and seeks to it through the row-group metadata, so workers split a file the
way they split the lines of a text corpus. A row whose struct or either sentence is null counts
as ``malformed``; the other filters are those of ``PairFilter``.

Problems found before any work starts, each reported in one line naming the file or folder: a
Parquet file without a ``translation`` struct column, a struct without a field for each language
of its folder, a file name that is no known split, a folder of Parquet files whose name is not a
language pair.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Iterator, Sequence

from scaletrain.errors import ScaletrainError
from scaletrain.prepare.parallel_text import ParallelCorpus

log = logging.getLogger(__name__)

COLUMN = "translation"
SPLIT_NAMES = {"train": "train", "validation": "valid", "valid": "valid", "dev": "valid", "test": "test"}
_SPLIT_FILE = re.compile(r"([A-Za-z]+)(?:[-_.].*)?\.parquet")
_CODE = r"[A-Za-z]{2,3}(?:_[A-Za-z0-9]{1,8})*"
PAIR_DIR = re.compile(rf"({_CODE})-({_CODE})")
BATCH_ROWS = 8192


def _import_pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:  # pragma: no cover - a dependency, but say what to do if it is missing
        raise ScaletrainError("--source hf-parquet needs pyarrow (pip install pyarrow)") from None
    return pyarrow


def _parquet_file(path: str | Path):
    pa = _import_pyarrow()
    try:
        return pa.parquet.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise ScaletrainError(f"{path}: cannot read as Parquet: {e}") from None


def check_schema(path: str | Path, src: str, tgt: str) -> int:
    """Row count of a Parquet file after checking its ``translation`` column holds ``src`` and ``tgt``
    as strings; anything else -> ScaletrainError naming the file."""
    pa = _import_pyarrow()
    pf = _parquet_file(path)
    schema = pf.schema_arrow
    if COLUMN not in schema.names:
        raise ScaletrainError(f"{path}: no {COLUMN!r} column (columns: {', '.join(schema.names) or 'none'}); "
                              f"expected a struct mapping each language code to its sentence")
    t = schema.field(COLUMN).type
    if not pa.types.is_struct(t):
        raise ScaletrainError(f"{path}: column {COLUMN!r} is {t}, expected a struct mapping each language code "
                              "to its sentence")
    names = [t.field(i).name for i in range(t.num_fields)]
    for lang in (src, tgt):
        if lang not in names:
            raise ScaletrainError(f"{path}: {COLUMN!r} has fields {', '.join(names)}; its folder {src}-{tgt} needs "
                                  f"{src} and {tgt}")
        ft = t.field(lang).type
        if not (pa.types.is_string(ft) or pa.types.is_large_string(ft) or pa.types.is_binary(ft)
                or pa.types.is_large_binary(ft)):
            raise ScaletrainError(f"{path}: {COLUMN}.{lang} is {ft}, expected strings")
    return pf.metadata.num_rows


def read_parquet_range(path: str | Path, src: str, tgt: str, start: int, n: int,
                       batch_rows: int = BATCH_ROWS) -> Iterator[tuple[bytes, bytes] | None]:
    """(src, tgt) as UTF-8 bytes for rows ``start .. start+n`` of a Parquet file, ``None`` for a row
    whose struct or either side is null. Only the row groups that overlap the range are read."""
    pf = _parquet_file(path)
    md = pf.metadata
    groups, first_row, row = [], None, 0
    for i in range(md.num_row_groups):
        k = md.row_group(i).num_rows
        if row + k > start and row < start + n:
            groups.append(i)
            if first_row is None:
                first_row = row
        row += k
    if not groups:
        return
    skip, left = start - first_row, n
    for batch in pf.iter_batches(batch_size=batch_rows, row_groups=groups, columns=[COLUMN]):
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        col = batch.column(0).slice(skip, left)
        skip = 0
        t = col.type
        fields = col.flatten()  # children with the struct's nulls applied
        a = fields[t.get_field_index(src)].to_pylist()
        b = fields[t.get_field_index(tgt)].to_pylist()
        for x, y in zip(a, b):
            if x is None or y is None:
                yield None
            else:
                yield (x.encode("utf-8") if isinstance(x, str) else x, y.encode("utf-8") if isinstance(y, str) else y)
        left -= len(a)
        if left <= 0:
            return


def _pair_dirs(root: Path) -> list[Path]:
    """Folders holding Parquet files: ``root``'s subfolders, or ``root`` itself when it holds them."""
    if not root.is_dir():
        raise ScaletrainError(f"--input {root} is not a directory")
    dirs = [d for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".")
            and any(d.glob("*.parquet"))]
    if not dirs and any(root.glob("*.parquet")):
        dirs = [root]
    if not dirs:
        raise ScaletrainError(f"{root} holds no <l1>-<l2>/<split>-*.parquet files (the Hugging Face Hub layout of "
                              "a translation dataset, e.g. de-en/train-00000-of-00001.parquet)")
    return dirs


def hf_parquet_corpora(root: str | Path, langs: Sequence[str] | None = None) -> tuple[list[ParallelCorpus], dict]:
    """Corpora for every pair folder and split file under ``root``, plus a source description.

    ``langs`` keeps the pairs whose languages are all in ``langs`` or English (the pivot), as
    ``--langs`` does for OPUS-100; a language in no pair is an error."""
    root = Path(root)
    found: dict[str, dict[str, list[ParallelCorpus]]] = {}
    for d in _pair_dirs(root):
        m = PAIR_DIR.fullmatch(d.name)
        if m is None or m.group(1) == m.group(2):
            raise ScaletrainError(f"{d}: folder name {d.name!r} is not a language pair such as de-en (one folder per "
                                  "pair holding <split>-*.parquet files)")
        src, tgt = m.group(1), m.group(2)
        for f in sorted(d.glob("*.parquet")):
            sm = _SPLIT_FILE.fullmatch(f.name)
            split = SPLIT_NAMES.get(sm.group(1).lower()) if sm else None
            if split is None:
                raise ScaletrainError(f"{f}: file name names no split (expected train-*, validation-*, valid-*, "
                                      "dev-* or test-*.parquet)")
            if check_schema(f, src, tgt) == 0:
                continue
            found.setdefault(d.name, {}).setdefault(split, []).append(
                ParallelCorpus(split, src, tgt, parquet_path=str(f)))
    if langs is not None:
        keep = set(langs) | {"en"}
        missing = [l for l in langs if not any(l in p.split("-") for p in found)]
        if missing:
            raise ScaletrainError(f"{root} has no pair folder for {', '.join(missing)}; "
                                  f"available: {', '.join(sorted(found))}")
        found = {p: s for p, s in found.items() if set(PAIR_DIR.fullmatch(p).groups()) <= keep}
    if not found:
        raise ScaletrainError(f"{root}: every Parquet file is empty")
    no_eval = sorted(p for p, s in found.items() if "valid" not in s and "test" not in s)
    if no_eval:
        log.warning("%s: %s have a train set only; trained on, left out of evaluation", root, ", ".join(no_eval))
    corpora = [c for p in sorted(found) for s in ("train", "valid", "test") for c in found[p].get(s, [])]
    source = {"type": "hf-parquet", "root": str(root), "pairs": sorted(found), "no_eval": no_eval}
    return corpora, source
