"""Side-by-side comparison of training runs (``scaletrain compare``).

Runs are named by MLflow run id, by a training run directory (its ``tracking/run.json`` names the run and
the store) or by experiment (``--experiment NAME``, optionally filtered with an MLflow filter string; the
evaluation runs nested under training runs are not listed as runs of their own).
:func:`compare` returns one column per run and one row per field:

* ``config: KEY`` rows for every logged parameter whose value differs between the runs (found
  automatically; keys that differ by construction, such as the output directory, are left out), and for
  the keys asked for with ``--param`` even where the runs agree,
* the run's status, wall time (training-loop seconds) and steps,
* ``final`` and ``best`` of the learning-curve metrics (train loss, validation nll, in-training BLEU/chrF),
* ``final``, ``min`` and ``max`` of any other metric asked for with ``--metric`` (``-`` where a run has none),
* per evaluated split, an ``evaluation (<split>)`` row naming the evaluation the scores below it come
  from (:mod:`scaletrain.tracking.records`), then its scores per group (``<split>/bleu/<group>``,
  ``<split>/chrf/<group>``). Of a run's evaluations of a split the run's full one is shown (every line, the
  recipe's settings; the latest step), else a full-split one with other settings, else a record from
  before evaluations were named (the training run's own metrics, labelled ``old record``), else a
  subset; ``--evaluation GLOB`` picks by name instead;
* throughput (mean target tokens/s, mean bytes/s, mean MFU and model TFLOP/s) and peak memory.

:func:`plot_comparison` draws the runs' learning curves overlaid (with each run's target-unigram
validation NLL as a dashed line) and the chrF per group of each run's shown test evaluation as bars (a run
without one gets a hatched "not evaluated" bar, not a zero), each bar marked with the chrF of copying the source
on that evaluation's own lines (runs on different corpora start from different floors), into one PNG
(matplotlib, Agg backend) and, beside it, ``<name>.plot.json`` with the numbers drawn and the figure's structure.
Everything works on the default local SQLite store, no server needed.
"""
from __future__ import annotations

import csv
import fnmatch
import io
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from scaletrain.errors import ScaletrainError
from scaletrain.tracking.records import EVALUATION, KIND_TAG, TAG_PREFIX, headline_tag
from scaletrain.tracking.evaluations import evaluation_runs
from scaletrain.tracking.journal import RUN_FILE
from scaletrain.tracking.plots import BASELINE_KEY
from scaletrain.tracking.store import resolve_tracking_uri, safe_key, tracking_client

__all__ = ["RunData", "Evaluation", "Comparison", "load_runs", "compare", "plot_comparison", "plot_data_path",
           "FORMATS", "COPY_MARK"]

FORMATS = ("table", "md", "csv", "json")
CURVES = ("train/loss", "valid/nll")  # (step, value) learning curves
BEST_MODE = {"train/loss": min, "valid/nll": min}  # other curve metrics (BLEU, chrF): max
IGNORED_PARAMS = ("train.out_dir", "tracking.run_name")  # differ between any two runs by construction
SCORES = ("bleu", "chrf")
NOT_EVALUATED = "not evaluated"
COPY_MARK = "copy the source: chrF on the same test lines"  # the label of the marks beside the chrF bars
_EVAL_KEY = re.compile(r"^(?P<split>[A-Za-z0-9_-]+)/(?:bleu|chrf)/")


@dataclass
class Evaluation:
    """One evaluation of a run: a nested evaluation run, or (``old``) the scores an evaluation written
    before evaluations were named left on the training run itself."""

    name: str
    split: str
    primary: bool  # the run's full evaluation: every line, the recipe's settings
    full: bool  # every line of the split
    step: int | None
    metrics: dict[str, float]  # <split>/bleu/<group or direction>, <split>/chrf/...
    run_id: str | None = None  # the nested run (None: an old record on the training run)
    start_time: int = 0
    old: bool = False
    copy_chrf: dict[str, float] = field(default_factory=dict)  # group -> chrF of copying the source, same lines

    def rank(self) -> tuple:
        """Higher is preferred: the run's full evaluation, a full split, an old record, a subset; then the
        later step, the newer record."""
        kind = 3 if self.primary else 2 if self.full else 1 if self.old else 0
        return kind, -1 if self.step is None else self.step, self.start_time


@dataclass
class RunData:
    run_id: str
    run_name: str
    status: str
    params: dict[str, str]
    tags: dict[str, str]
    metrics: dict[str, float]  # last values
    histories: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # key -> [(step, value)]
    start_time: int | None = None
    end_time: int | None = None
    evaluations: list[Evaluation] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The run name (``small · runs/small-2026... · a1b2c3``) and the architecture where the name does not
        say it; older names without the short id get the id's first 8 digits."""
        arch = self.tags.get("arch", "")
        name = self.run_name
        if self.run_id[:6] in name:
            return name if not arch or arch in name else f"{name} [{arch}]"
        name = name if not arch or arch in name else f"{name}/{arch}"  # e.g. small/moce
        return f"{name} ({self.run_id[:8]})" if name else self.run_id[:8]

    def evaluation(self, split: str, pattern: str | None = None) -> Evaluation | None:
        """The evaluation of ``split`` whose scores stand for the run (see the module docstring)."""
        cands = [e for e in self.evaluations
                 if e.split == split and (pattern is None or fnmatch.fnmatchcase(e.name, pattern))]
        return max(cands, key=Evaluation.rank) if cands else None


# a score key per direction ("test/bleu/de-en", "zh_Hans-en", "pt-br-en", "en-zh-hant": a language code is 2-3
# letters with an optional region or script subtag of 2-4 letters); groups are "all", "latin", "utf8-2byte",
# "low-resource", "non-latin", ...
_CODE = r"[A-Za-z]{2,3}(?:[_-](?:[A-Za-z]{2}|[A-Za-z]{4}|\d{3}))?"
_DIRECTION = re.compile(rf"^{_CODE}-{_CODE}$")


def is_direction_key(key: str) -> bool:
    return bool(_EVAL_KEY.match(key)) and bool(_DIRECTION.match(key.rsplit("/", 1)[-1]))


def _curve_keys(metrics: Iterable[str]) -> list[str]:
    keys = [k for k in metrics if k in CURVES or k.startswith(("valid/bleu_avg/", "valid/chrf_avg/"))]
    return sorted(keys, key=lambda k: (k not in CURVES, CURVES.index(k) if k in CURVES else 0, k))


MEAN_ROWS = (("train/tokens_per_s", "tokens/s (mean)"), ("train/bytes_per_s", "bytes/s (mean)"),
             ("train/mfu", "MFU (mean)"), ("train/model_tflops", "model TFLOP/s (mean)"))


def _scores(metrics: dict[str, float], split: str) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith(tuple(f"{split}/{s}/" for s in SCORES))}


def _copy_chrf(metrics: dict[str, float], split: str) -> dict[str, float]:
    """Group -> chrF of the copy-the-source baseline an evaluation logged (``<split>/copy_baseline/chrf`` for
    all lines, ``<split>/copy_baseline_chrf/<group>`` per group; older evaluations logged the first alone)."""
    prefix = f"{split}/copy_baseline_chrf/"
    out = {k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix)}
    if f"{split}/copy_baseline/chrf" in metrics:
        out.setdefault("all", metrics[f"{split}/copy_baseline/chrf"])
    return out


def _nested(run) -> Evaluation:
    t = run.data.tags
    split = t.get(TAG_PREFIX + "split", "")
    step = t.get(TAG_PREFIX + "step", "")
    metrics = dict(run.data.metrics)
    return Evaluation(t.get(TAG_PREFIX + "name", run.info.run_name), split, t.get(TAG_PREFIX + "primary") == "true",
                      t.get(TAG_PREFIX + "full") == "True", int(step) if step.isdigit() else None,
                      _scores(metrics, split), run.info.run_id, run.info.start_time or 0,
                      copy_chrf=_copy_chrf(metrics, split))


def _old_name(client, run_id: str, split: str) -> str:
    """What the run's ``eval_<split>.json`` artifact (written by ``evaluate`` before evaluations were named)
    says the training run's own scores are; they may be those of a subset."""
    try:
        with tempfile.TemporaryDirectory() as d:
            r = json.loads(Path(client.download_artifacts(run_id, f"eval_{split}.json", d)).read_text())
        return (f"{split} (old record: {r['lines']} lines, beam {r['beam']}, lenpen {r['lenpen']}, "
                f"step {r['step']})")
    except Exception:  # noqa: BLE001 - no such artifact, or an unreadable one: say what is known
        return f"{split} (old record, settings not recorded)"


def _evaluations(client, run) -> list[Evaluation]:
    """The nested evaluation runs of a training run, and an old record for every split whose scores sit on
    the training run without the tag of a full evaluation."""
    out = [_nested(r) for r in evaluation_runs(client, run.info.experiment_id, run.info.run_id)]
    metrics, tags = dict(run.data.metrics), dict(run.data.tags)
    for split in sorted({m["split"] for k in metrics if (m := _EVAL_KEY.match(k))}):
        if headline_tag(split) in tags:
            continue  # the training run's scores are its full evaluation's, listed above
        hist = client.get_metric_history(run.info.run_id, f"{split}/bleu/all")
        out.append(Evaluation(_old_name(client, run.info.run_id, split), split, False, False,
                              max((m.step for m in hist), default=None), _scores(metrics, split), old=True,
                              copy_chrf=_copy_chrf(metrics, split)))
    return out


def _fetch(client, run_id: str, extra: Iterable[str] = ()) -> RunData:
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        raise ScaletrainError(f"compare: run {run_id!r} not found ({e.message.splitlines()[0]})") from None
    data = RunData(run.info.run_id, run.info.run_name or "", run.info.status, dict(run.data.params),
                   dict(run.data.tags), dict(run.data.metrics), start_time=run.info.start_time,
                   end_time=run.info.end_time)
    for k in [*_curve_keys(data.metrics), *(k for k, _ in MEAN_ROWS), *extra]:
        if k in data.metrics:
            hist = client.get_metric_history(run_id, k)
            data.histories[k] = sorted((m.step, m.value) for m in hist)
    if data.tags.get(KIND_TAG) != EVALUATION:
        data.evaluations = _evaluations(client, run)
    return data


def _experiment_runs(c, experiment: str, uri: str, filter_string: str, max_runs: int) -> list[str]:
    """Training runs of ``experiment``, newest first (nested evaluation runs left out)."""
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        raise ScaletrainError(f"compare: no experiment named {experiment!r} in {uri}")
    ids: list[str] = []
    token = None
    while len(ids) < max_runs:
        page = c.search_runs([exp.experiment_id], filter_string=filter_string, max_results=max(max_runs, 100),
                             order_by=["attributes.start_time DESC"], page_token=token)
        ids += [x.info.run_id for x in page if x.data.tags.get(KIND_TAG) != EVALUATION]
        token = page.token
        if not token:
            break
    return ids[:max_runs]


def load_runs(runs: Iterable[str] = (), *, experiment: str | None = None, filter_string: str = "",
              uri: str | None = None, project_dir: str | os.PathLike = ".", max_runs: int = 50,
              metrics: Iterable[str] = ()) -> list[RunData]:
    """``runs``: run ids or run directories (their ``tracking/run.json``); plus the training runs of
    ``experiment`` (newest first, at most ``max_runs``, MLflow ``filter_string``), each with its evaluations
    and the histories of the learning curves, the throughput and ``metrics`` (any other keys, for
    :func:`compare`'s ``metrics``)."""
    extra = [safe_key(k) for k in metrics]
    default_uri = resolve_tracking_uri(uri, project_dir)
    clients: dict[str, Any] = {}

    def client(u: str):
        if u not in clients:
            clients[u] = tracking_client(u)
        return clients[u]

    out: list[RunData] = []
    for r in runs:
        p = Path(r)
        info_file = p / "tracking" / RUN_FILE if (p / "tracking" / RUN_FILE).is_file() else p / RUN_FILE
        if p.is_dir():
            if not info_file.is_file():
                raise ScaletrainError(f"compare: {p} is a directory without tracking/{RUN_FILE} "
                                      "(not the out_dir of a tracked training run)")
            info = json.loads(info_file.read_text())
            out.append(_fetch(client(uri or info["uri"]), info["run_id"], extra))
        else:
            out.append(_fetch(client(default_uri), str(r), extra))
    if experiment:
        c = client(default_uri)
        seen = {d.run_id for d in out}
        out.extend(_fetch(c, rid, extra) for rid in _experiment_runs(c, experiment, default_uri, filter_string, max_runs)
                   if rid not in seen)
    if not out:
        raise ScaletrainError("compare: no runs (give run ids, run directories or --experiment NAME)")
    return out


@dataclass
class Comparison:
    runs: list[RunData]
    rows: list[tuple[str, list[Any]]]  # (field, one value per run)
    differing: list[str]  # config keys that differ

    def to_json(self) -> dict:
        return {
            "runs": [{"run_id": r.run_id, "run_name": r.run_name, "status": r.status} for r in self.runs],
            "differing_config": self.differing,
            "rows": {name: dict(zip([r.run_id for r in self.runs], vals)) for name, vals in self.rows},
        }

    def format(self, fmt: str = "table") -> str:
        if fmt not in FORMATS:
            raise ScaletrainError(f"compare: --format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        if fmt == "json":
            return json.dumps(self.to_json(), indent=2, allow_nan=False, default=str)
        header = ["", *[r.label for r in self.runs]]
        body = [[name, *[_cell(v) for v in vals]] for name, vals in self.rows]
        if fmt == "csv":
            buf = io.StringIO()
            w = csv.writer(buf, lineterminator="\n")
            w.writerow(["field", *[r.run_id for r in self.runs]])
            w.writerow(["run_name", *[r.run_name for r in self.runs]])
            for name, vals in self.rows:
                w.writerow([name, *["" if v is None else v for v in vals]])
            return buf.getvalue()
        if fmt == "md":
            lines = ["| " + " | ".join(h or "field" for h in header) + " |",
                     "|" + "|".join(["---", *["---:" for _ in self.runs]]) + "|"]
            lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
            return "\n".join(lines)
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip(),
                 "  ".join("-" * w for w in widths)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in body]
        return "\n".join(lines)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    return str(v)


def _clean(v: Any) -> Any:
    return None if isinstance(v, float) and (math.isnan(v) or math.isinf(v)) else v


def _splits(runs: list[RunData]) -> list[str]:
    found = {e.split for r in runs for e in r.evaluations}
    return sorted(found, key=lambda s: (s != "test", s != "valid", s))


def _evaluation_rows(runs: list[RunData], directions: bool, pattern: str | None) -> list[tuple[str, list[Any]]]:
    """Per split: which evaluation the run's scores come from, then the scores."""
    rows: list[tuple[str, list[Any]]] = []
    for split in _splits(runs):
        chosen = [r.evaluation(split, pattern) for r in runs]
        rows.append((f"evaluation ({split})", [e.name if e else NOT_EVALUATED for e in chosen]))
        keys = sorted({k for e in chosen if e for k in e.metrics},
                      key=lambda k: (k.split("/")[1], k.rsplit("/", 1)[1] != "all", k))  # bleu/all first
        for k in keys:
            if directions or not is_direction_key(k):
                rows.append((k, [_clean(e.metrics.get(k)) if e else None for e in chosen]))
    return rows


def compare(runs: list[RunData], directions: bool = False, evaluation: str | None = None,
            metrics: Iterable[str] = (), params: Iterable[str] = ()) -> Comparison:
    """The side-by-side table of ``runs`` (see the module docstring); evaluation scores per group, and per
    direction too with ``directions``; ``evaluation``: a glob the shown evaluations' names must match.
    ``params``: config keys shown even where the runs agree; ``metrics``: other metric keys, each with its
    final, min and max value (load the runs with the same ``metrics`` for min and max)."""
    keys = sorted({k for r in runs for k in r.params})
    known = [r for r in runs if r.params]  # a run without a config (failed before it logged one) differs in nothing
    differing = [k for k in keys if k not in IGNORED_PARAMS and len({r.params.get(k) for r in known}) > 1]
    shown = differing + [k for k in dict.fromkeys(safe_key(p) for p in params) if k not in differing]
    rows: list[tuple[str, list[Any]]] = [("config: " + k, [r.params.get(k) for r in runs]) for k in shown]
    if "params.total" not in differing and any("params.total" in r.params for r in runs):
        rows.append(("parameters", [_int(float(r.params["params.total"])) if "params.total" in r.params else None
                                    for r in runs]))  # shown even when equal
    rows.append(("status", [r.status for r in runs]))
    rows.append(("steps", [_int(r.metrics.get("train/steps")) for r in runs]))
    rows.append(("wall time (s)", [_clean(r.metrics.get("train/seconds")) for r in runs]))
    curve_keys = _curve_keys({k for r in runs for k in r.metrics})
    for k in curve_keys:
        best = BEST_MODE.get(k, max)
        rows.append((f"{k} final", [_clean(r.metrics.get(k)) for r in runs]))
        rows.append((f"{k} best", [_clean(best(v for _, v in r.histories[k])) if r.histories.get(k) else None
                                   for r in runs]))
    rows += _metric_rows(runs, [k for k in dict.fromkeys(safe_key(m) for m in metrics) if k not in curve_keys])
    rows += _evaluation_rows(runs, directions, evaluation)
    for k, name in MEAN_ROWS:
        if any(r.histories.get(k) for r in runs):
            rows.append((name, [_clean(sum(v for _, v in r.histories[k]) / len(r.histories[k]))
                                if r.histories.get(k) else None for r in runs]))
    for k, name in (("sys/cuda_max_allocated_mb", "peak CUDA memory (MB)"), ("sys/max_rss_mb", "peak RSS (MB)")):
        if any(k in r.metrics for r in runs):
            rows.append((name, [_clean(r.metrics.get(k)) for r in runs]))
    return Comparison(runs, rows, differing)


def _metric_rows(runs: list[RunData], keys: list[str]) -> list[tuple[str, list[Any]]]:
    """``<key> final`` (the run's last value), ``<key> min``, ``<key> max`` (over its history) per key."""
    rows: list[tuple[str, list[Any]]] = []
    for k in keys:
        hists = [[v for _, v in r.histories.get(k, [])] for r in runs]
        rows.append((f"{k} final", [_clean(r.metrics.get(k)) for r in runs]))
        rows.append((f"{k} min", [_clean(min(h)) if h else None for h in hists]))
        rows.append((f"{k} max", [_clean(max(h)) if h else None for h in hists]))
    return rows


def _int(v):
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else int(v)


_SUBGROUP = re.compile(r"_(xx2[^_]+|[^_]+2xx)$")  # "latin_xx2en": a group's split by direction


def _bar_groups(chosen: list[Evaluation | None]) -> list[str]:
    """The groups of the test chrF bars: the top-level groups (not their xx->en / en->xx halves)."""
    keys = {k[len("test/chrf/"):] for e in chosen if e for k in e.metrics if k.startswith("test/chrf/")}
    groups = [g for g in keys if not is_direction_key(f"test/chrf/{g}") and not _SUBGROUP.search(g)]
    return sorted(groups, key=lambda g: (g != "all", g))


def _curve_panels(axes, runs: list[RunData], colors, unit: str) -> None:
    from scaletrain.tracking.plots import CURVE_TITLES, STEP_LABEL, curve_labels

    ylabels = curve_labels(unit)
    bases = {r.metrics.get(BASELINE_KEY) for r in runs} - {None}
    for ax, key in zip(axes, CURVES):
        for r, c in zip(runs, colors):
            h = r.histories.get(key)
            if h:
                ax.plot([s for s, _ in h], [v for _, v in h], color=c, marker="." if len(h) < 30 else None,
                        label=r.label)
            base = r.metrics.get(BASELINE_KEY)
            if key == "valid/nll" and base is not None and len(bases) > 1:  # runs on different shards
                ax.axhline(base, color=c, linestyle="--", linewidth=1, label=f"target-unigram NLL ({r.label})")
        if key == "valid/nll" and len(bases) == 1:
            ax.axhline(bases.pop(), color="gray", linestyle="--", linewidth=1, label="target-unigram NLL (every run)")
        if not any(r.histories.get(key) for r in runs):
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="gray")
        ax.set_title(f"{CURVE_TITLES[key]} by update")
        ax.set_xlabel(STEP_LABEL)
        ax.set_ylabel(ylabels[key])
        ax.grid(alpha=0.3)


def _chrf_panel(ax, runs: list[RunData], colors, chosen: list[Evaluation | None], groups: list[str]) -> list[dict]:
    """The chrF bars per group of each run's chosen test evaluation, each marked (a black tick across the bar)
    at the chrF of copying the source on that evaluation's lines. Returns per run what was drawn."""
    from scaletrain.tracking.plots import SCORE_LABELS, missing_bar

    bw = 0.8 / max(len(runs), 1)
    vals = [[_clean(e.metrics.get(f"test/chrf/{g}")) if e else None for g in groups] for e in chosen]
    marks = [[_clean(e.copy_chrf.get(g)) if e and v is not None else None for g, v in zip(groups, row)]
             for e, row in zip(chosen, vals)]
    top = max([v for rows in (vals, marks) for row in rows for v in row if v is not None] + [0.0]) * 1.3 or 1.0
    marked = False
    for i, (c, row, mrow) in enumerate(zip(colors, vals, marks)):
        xs = [g + (i - (len(runs) - 1) / 2) * bw for g in range(len(groups))]
        ax.bar([x for x, v in zip(xs, row) if v is not None], [v for v in row if v is not None], bw, color=c,
               label=runs[i].label)
        for x, v, m in zip(xs, row, mrow):
            if v is None:
                missing_bar(ax, x, bw, top, NOT_EVALUATED, color=c)
            elif v == 0:
                ax.text(x, 0, "0", ha="center", va="bottom", fontsize=7, color=c)
            if m is not None:
                ax.plot([x - bw / 2, x + bw / 2], [m, m], color="black", linewidth=2, solid_capstyle="butt",
                        label="_copy" if marked else COPY_MARK)
                marked = True
    ax.set_ylim(0, top)
    ax.set_xticks(range(len(groups)), groups, rotation=45, ha="right", fontsize="small")
    ax.set_xlabel("language group (test split)")
    ax.set_ylabel(SCORE_LABELS["chrf"])
    ax.set_title("test chrF per group")
    ax.grid(axis="y", alpha=0.3)
    return [{"run_id": r.run_id, "label": r.label, "evaluation": e.name if e else None, "chrf": dict(zip(groups, row)),
             "copy_source_chrf": dict(zip(groups, mrow))} for r, e, row, mrow in zip(runs, chosen, vals, marks)]


def plot_data_path(png: str | os.PathLike) -> Path:
    """Where :func:`plot_comparison` writes the numbers and structure of the plot ``png``: ``<name>.plot.json``
    (``<name>.json`` is the table's in ``compare-models``' folder)."""
    return Path(png).with_suffix(".plot.json")


def plot_comparison(runs: list[RunData], path: str | os.PathLike, *, width: float = 12.0, height: float = 4.0,
                    dpi: int = 100, evaluation: str | None = None) -> Path:
    """One PNG of ``width`` x ``height`` inches at ``dpi``: train loss and validation NLL against the update,
    each run one colour, its target-unigram NLL dashed; a third panel with the chrF per group of each run's
    shown test evaluation (as in :func:`compare`, ``evaluation`` a glob on its name) when any run has one,
    a run without one hatched "not evaluated", each bar marked at the chrF of copying the source on the same
    lines. One legend below the panels names each run and the evaluation its bars come from. The PNG's text
    chunks hold the figure's structure (:func:`scaletrain.tracking.plots.figure_structure`); beside it,
    :func:`plot_data_path` holds that structure and, under ``bars``, the chrF and copy-the-source chrF drawn
    per run and group."""
    from scaletrain.fileio import atomic_write_text
    from scaletrain.tracking.plots import pyplot, save_figure, token_unit

    plt = pyplot()
    chosen = [r.evaluation("test", evaluation) for r in runs]
    groups = _bar_groups(chosen)  # chrF rather than BLEU: it separates short or early runs whose BLEU is ~0
    units = {token_unit(r.params.get("data.tokenizer")) for r in runs if r.params}  # a failed run logged none
    fig, axes = plt.subplots(1, 2 + bool(groups), figsize=(width, height), dpi=dpi, squeeze=False)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    _curve_panels(axes[0][:2], runs, colors, units.pop() if len(units) == 1 else "token")
    bars = _chrf_panel(axes[0][2], runs, colors, chosen, groups) if groups else []
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, linewidth=3) for c in colors]
    labels = [r.label + (f"   (bars: {e.name})" if e else f"   (test: {NOT_EVALUATED})") if groups else r.label
              for r, e in zip(runs, chosen)]
    handles.append(Line2D([], [], color="gray", linestyle="--"))
    labels.append("dashed: target-unigram NLL of the validation split (a model that ignores the source)")
    if any(v is not None for b in bars for v in b["copy_source_chrf"].values()):
        handles.append(Line2D([], [], color="black", linewidth=2))
        labels.append(f"black tick on a bar: {COPY_MARK} as that bar")
    rows = len(labels)
    fig.legend(handles, labels, loc="lower center", fontsize="small", ncol=1, frameon=False)
    fig.tight_layout(rect=(0, min(0.6, (0.22 * rows + 0.1) / height), 1, 1))
    out = Path(path)
    structure = save_figure(fig, out, dpi)  # no bbox_inches="tight": the size is exactly width x height
    plt.close(fig)
    data = {"groups": groups, "bars": bars, "figure": structure}
    atomic_write_text(plot_data_path(out), json.dumps(data, indent=1, allow_nan=False) + "\n")
    return out
