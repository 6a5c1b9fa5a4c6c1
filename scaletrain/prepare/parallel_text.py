"""Line-aligned parallel text: Moses-style file pairs (``corpus.de`` / ``corpus.en``) and TSV.

TSV comes in two layouts: ``src<TAB>tgt`` (one direction for the whole file, languages given by
the caller) and, with ``lang_columns=True`` (``prepare --tsv-lang-columns``),
``src_lang<TAB>tgt_lang<TAB>src<TAB>tgt``: languages per line, so one file can hold many directions
(e.g. a mixed OPUS dump). Rules for the language columns (no auto-detection: the flag says which
layout a file has, because a 4-column line can be legitimate text in the 2-column layout):
    * a code is ASCII letters (2-3) with optional ``-``/``_`` subtags (``en``, ``pt_BR``,
      ``sr-Latn``, ``zh-Hans``), surrounding spaces stripped; anything else (empty, a sentence, a
      number) means the file is not in this layout: ``ScaletrainError`` naming ``file:line``;
    * a line without exactly 4 columns, or with the same language on both sides, is ``malformed``
      (counted, dropped), like a 2-column line without exactly one tab;
    * a well-formed code outside the corpus' language list (``prepare --langs``) is counted as
      ``unknown_lang`` and dropped; without ``--langs`` the list is every code in the files
      (``tsv_languages``, one streaming pass).

A UTF-8 byte order mark at the start of a file (Windows editors write one) is not text: it is removed
from the first line. Everything streams: files are read line by line in binary (never a whole corpus in memory).
A cheap first pass (``index_lines``) counts lines with numpy and records the byte offset of every
``every``-th line, so the work can be cut into independent line ranges (one output shard each)
that worker processes read with one seek.

Filtering (``PairFilter``), per pair, first rule that fires is counted:
    ``malformed``     TSV line without exactly one tab (4-column TSV: not 3 tabs, or src_lang == tgt_lang)
    ``nul``           either side holds a NUL byte (binary junk, never text)
    ``invalid_utf8``  either side is not valid UTF-8
    ``empty``         either side empty after stripping surrounding whitespace
    ``too_long``      either side longer than ``max_bytes`` (default 800) bytes
    ``ratio``         ``max_ratio`` set and longer/shorter byte length above it

With ``keep_invalid_utf8=True`` a pair with invalid UTF-8 is kept as raw bytes (ASCII whitespace
stripped) when no other rule fires; it is counted as ``invalid_utf8_kept``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from scaletrain.errors import ScaletrainError

FILTER_REASONS = ("malformed", "nul", "invalid_utf8", "empty", "too_long", "ratio")
BOM = b"\xef\xbb\xbf"
KEPT_NOTES = ("invalid_utf8_kept",)  # "reasons" that are counted but do not drop the pair
_CHUNK = 1 << 22


@dataclass(frozen=True)
class LineIndex:
    path: str
    n_lines: int
    offsets: tuple[int, ...]  # byte offset of lines 0, every, 2*every, ...
    every: int


def index_lines(path: str | Path, every: int) -> LineIndex:
    """Count lines (a final line without newline counts) and record every ``every``-th line start."""
    path = Path(path)
    offsets = [0]
    n = 0
    pos = 0
    last = b"\n"
    try:
        with open(path, "rb") as f:
            while True:
                chunk = f.read(_CHUNK)
                if not chunk:
                    break
                nl = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
                # line numbers that start right after each newline: n+1, n+2, ...
                starts = np.arange(n + 1, n + 1 + len(nl))
                pick = nl[starts % every == 0]
                offsets.extend((pos + pick + 1).tolist())
                n += len(nl)
                pos += len(chunk)
                last = chunk[-1:]
    except OSError as e:
        raise ScaletrainError(f"cannot read {path}: {e}") from None
    if pos and last != b"\n":
        n += 1  # unterminated last line
    if offsets and offsets[-1] >= pos and len(offsets) > 1:
        offsets.pop()  # a newline at EOF does not start a line
    if n == 0:
        offsets = [0]
    return LineIndex(str(path), n, tuple(offsets), every)


def check_same_lines(a: LineIndex, b: LineIndex) -> None:
    if a.n_lines != b.n_lines:
        raise ScaletrainError(
            f"line counts differ: {a.path} has {a.n_lines:,} lines, {b.path} has {b.n_lines:,}; "
            "parallel files must be line aligned"
        )


def read_lines(path: str | Path, offset: int, n: int) -> Iterator[bytes]:
    """``n`` raw lines (without the newline) starting at byte ``offset``; a UTF-8 BOM opening the file is
    dropped."""
    with open(path, "rb") as f:
        f.seek(offset)
        for i in range(n):
            line = f.readline()
            if not line:
                return
            if i == 0 and offset == 0 and line.startswith(BOM):
                line = line[len(BOM):]
            yield line[:-1] if line.endswith(b"\n") else line


def read_pair_range(src_path, tgt_path, src_off: int, tgt_off: int, n: int) -> Iterator[tuple[bytes, bytes] | None]:
    yield from zip(read_lines(src_path, src_off, n), read_lines(tgt_path, tgt_off, n))


def read_tsv_range(path, off: int, n: int) -> Iterator[tuple[bytes, bytes] | None]:
    """(src, tgt) per line, ``None`` for a malformed line (not exactly two columns)."""
    for line in read_lines(path, off, n):
        parts = line.split(b"\t")
        yield (parts[0], parts[1]) if len(parts) == 2 else None


LANG_CODE = re.compile(rb"[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{1,8})*")


def lang_code(code: bytes, path, line_no: int) -> str:
    """A language column's code as str; not a code -> ScaletrainError naming ``path:line_no`` (1-based)."""
    c = code.strip()
    if not LANG_CODE.fullmatch(c):
        shown = code[:40].decode("utf-8", "replace")
        raise ScaletrainError(
            f"{path}:{line_no}: language column holds {shown!r}, not a language code (e.g. en, de, pt_BR, "
            "sr-Latn); with --tsv-lang-columns every line is src_lang<TAB>tgt_lang<TAB>src<TAB>tgt "
            "(drop the flag for src<TAB>tgt files)"
        )
    return c.decode("ascii")


def read_tsv_lang_range(path, off: int, n: int) -> Iterator[tuple[bytes, bytes, bytes, bytes] | None]:
    """(src_lang, tgt_lang, src, tgt) per line of a 4-column TSV; ``None`` when not exactly 4 columns."""
    for line in read_lines(path, off, n):
        parts = line.split(b"\t")
        yield (parts[0], parts[1], parts[2], parts[3]) if len(parts) == 4 else None


def tsv_languages(path: str | Path) -> set[str]:
    """Every language code in the language columns of a 4-column TSV (one streaming pass; lines
    without 4 columns or with the same language twice are skipped here, prepare counts them as
    malformed)."""
    langs: set[str] = set()
    seen: set[bytes] = set()
    try:
        with open(path, "rb") as f:
            for i, line in enumerate(f, 1):
                if i == 1 and line.startswith(BOM):
                    line = line[len(BOM):]
                if line.count(b"\t") != 3:
                    continue
                a, b, _ = line.split(b"\t", 2)
                if a not in seen:  # validate each distinct raw code once
                    lang_code(a, path, i)
                    seen.add(a)
                if b not in seen:
                    lang_code(b, path, i)
                    seen.add(b)
                ca, cb = a.strip(), b.strip()
                if ca != cb:  # a line with one language on both sides is malformed: it adds none
                    langs.add(ca.decode("ascii"))
                    langs.add(cb.decode("ascii"))
    except OSError as e:
        raise ScaletrainError(f"cannot read {path}: {e}") from None
    return langs


@dataclass(frozen=True)
class PairFilter:
    max_bytes: int = 800
    max_ratio: float | None = None
    keep_invalid_utf8: bool = False

    def __post_init__(self):
        if self.max_bytes < 1:
            raise ScaletrainError(f"max_bytes filter must be >= 1 (got {self.max_bytes})")
        if self.max_ratio is not None and self.max_ratio < 1:
            raise ScaletrainError(f"max_ratio filter must be >= 1 (got {self.max_ratio})")

    def __call__(self, pair: tuple[bytes, bytes] | None) -> tuple[str | None, bytes, bytes]:
        """(reason or None if kept, src, tgt) with surrounding whitespace stripped.

        A reason in ``KEPT_NOTES`` means: kept, but counted under that name."""
        if pair is None:
            return "malformed", b"", b""
        src, tgt = pair
        if b"\0" in src or b"\0" in tgt:
            return "nul", b"", b""
        note = None
        try:  # validate; re-encode only when stripping changed something
            u, v = src.decode("utf-8"), tgt.decode("utf-8")
            us, vs = u.strip(), v.strip()
            if len(us) != len(u):
                src = us.encode("utf-8")
            if len(vs) != len(v):
                tgt = vs.encode("utf-8")
        except UnicodeDecodeError:
            if not self.keep_invalid_utf8:
                return "invalid_utf8", b"", b""
            src, tgt, note = src.strip(), tgt.strip(), "invalid_utf8_kept"
        if not src or not tgt:
            return "empty", src, tgt
        ls, lt = len(src), len(tgt)
        if ls > self.max_bytes or lt > self.max_bytes:
            return "too_long", src, tgt
        if self.max_ratio is not None and max(ls, lt) / min(ls, lt) > self.max_ratio:
            return "ratio", src, tgt
        return note, src, tgt


@dataclass(frozen=True)
class ParallelCorpus:
    """One line-aligned corpus of one split: a file pair or a TSV file (src<TAB>tgt), or a TSV file with
    language columns (``lang_columns=True``: src_lang<TAB>tgt_lang<TAB>src<TAB>tgt; ``src_lang`` /
    ``tgt_lang`` are then unused, pass ""), or a Parquet file with a ``translation`` column
    (``parquet_path``, Hugging Face Hub layout: rows are the "lines", see ``scaletrain.prepare.hf_parquet``)."""

    split: str
    src_lang: str
    tgt_lang: str
    src_path: str | None = None
    tgt_path: str | None = None
    tsv_path: str | None = None
    lang_columns: bool = False
    parquet_path: str | None = None

    def __post_init__(self):
        if self.split not in ("train", "valid", "test"):
            raise ScaletrainError(f"split must be train, valid or test (got {self.split!r})")
        kinds = (self.tsv_path is not None) + (self.src_path is not None or self.tgt_path is not None) \
            + (self.parquet_path is not None)
        if kinds != 1 or (self.src_path is None) != (self.tgt_path is None):
            raise ScaletrainError("give either tsv_path, parquet_path or both src_path and tgt_path")
        if self.parquet_path is not None and self.lang_columns:
            raise ScaletrainError("language columns are for TSV files, not Parquet")
        if self.lang_columns and self.tsv_path is None:
            raise ScaletrainError("language columns (src_lang<TAB>tgt_lang<TAB>src<TAB>tgt) need a tsv_path")
        for p in (self.src_path, self.tgt_path, self.tsv_path, self.parquet_path):
            if p is not None and not Path(p).is_file():
                raise ScaletrainError(f"corpus file {p} does not exist")

    @property
    def name(self) -> str:
        if self.lang_columns:
            return f"{self.split}:{Path(self.tsv_path).name}"
        return f"{self.split}:{self.src_lang}-{self.tgt_lang}"
