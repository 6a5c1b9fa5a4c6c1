"""Side-by-side comparison of training runs (``scaletrain compare``).

Runs are named by MLflow run id, by a training run directory (its ``tracking/run.json`` names the run and
the store) or by experiment (``--experiment NAME``, optionally filtered with an MLflow filter string).
:func:`compare` returns one column per run and one row per field:

* ``config: KEY`` rows for every logged parameter whose value differs between the runs (found
  automatically; keys that differ by construction, such as the output directory, are left out),
* the run's status, wall time (training-loop seconds) and steps,
* ``final`` and ``best`` of the learning-curve metrics (train loss, validation nll, in-training BLEU/chrF),
* every evaluation score logged by ``scaletrain evaluate`` (``<split>/bleu/<group>``, ``<split>/chrf/<group>``),
* throughput (mean target tokens/s, mean bytes/s, mean MFU and model TFLOP/s) and peak memory.

:func:`plot_comparison` draws the runs' learning curves overlaid (and the evaluation scores per group as
bars when any run has them) into one PNG (matplotlib, Agg backend). Everything works on the default local
SQLite store, no server needed.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from scaletrain.errors import ScaletrainError
from scaletrain.tracking import RUN_FILE, _client, resolve_tracking_uri

__all__ = ["RunData", "Comparison", "load_runs", "compare", "plot_comparison", "FORMATS"]

FORMATS = ("table", "md", "csv", "json")
CURVES = ("train/loss", "valid/nll")  # (step, value) learning curves
BEST_MODE = {"train/loss": min, "valid/nll": min}  # other curve metrics (BLEU, chrF): max
IGNORED_PARAMS = ("train.out_dir", "tracking.run_name")  # differ between any two runs by construction
EVAL_PREFIXES = ("test/bleu/", "test/chrf/", "valid/bleu/", "valid/chrf/")


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

    @property
    def label(self) -> str:
        arch = self.tags.get("arch", "")
        name = self.run_name if not arch or arch in self.run_name else f"{self.run_name}/{arch}"  # e.g. small/moce
        return f"{name} ({self.run_id[:8]})" if name else self.run_id[:8]


# an evaluation key per direction ("test/bleu/de-en", "zh_Hans-en"); groups are "all", "latin", "utf8-2byte", ...
_DIRECTION = re.compile(r"^[A-Za-z]{2,3}(_[A-Za-z]+)?-[A-Za-z]{2,3}(_[A-Za-z]+)?$")


def is_direction_key(key: str) -> bool:
    return key.startswith(EVAL_PREFIXES) and bool(_DIRECTION.match(key.rsplit("/", 1)[-1]))


def _curve_keys(metrics: Iterable[str]) -> list[str]:
    keys = [k for k in metrics if k in CURVES or k.startswith(("valid/bleu_avg/", "valid/chrf_avg/"))]
    return sorted(keys, key=lambda k: (k not in CURVES, CURVES.index(k) if k in CURVES else 0, k))


MEAN_ROWS = (("train/tokens_per_s", "tokens/s (mean)"), ("train/bytes_per_s", "bytes/s (mean)"),
             ("train/mfu", "MFU (mean)"), ("train/model_tflops", "model TFLOP/s (mean)"))


def _fetch(client, run_id: str) -> RunData:
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        raise ScaletrainError(f"compare: run {run_id!r} not found ({e.message.splitlines()[0]})") from None
    data = RunData(run.info.run_id, run.info.run_name or "", run.info.status, dict(run.data.params),
                   dict(run.data.tags), dict(run.data.metrics), start_time=run.info.start_time,
                   end_time=run.info.end_time)
    for k in [*_curve_keys(data.metrics), *(k for k, _ in MEAN_ROWS)]:
        if k in data.metrics:
            hist = client.get_metric_history(run_id, k)
            data.histories[k] = sorted((m.step, m.value) for m in hist)
    return data


def load_runs(runs: Iterable[str] = (), *, experiment: str | None = None, filter_string: str = "",
              uri: str | None = None, project_dir: str | os.PathLike = ".", max_runs: int = 50) -> list[RunData]:
    """``runs``: run ids or run directories (their ``tracking/run.json``); plus the runs of ``experiment``
    (newest first, at most ``max_runs``, MLflow ``filter_string``)."""
    default_uri = resolve_tracking_uri(uri, project_dir)
    clients: dict[str, Any] = {}

    def client(u: str):
        if u not in clients:
            clients[u] = _client(u)
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
            out.append(_fetch(client(uri or info["uri"]), info["run_id"]))
        else:
            out.append(_fetch(client(default_uri), str(r)))
    if experiment:
        c = client(default_uri)
        exp = c.get_experiment_by_name(experiment)
        if exp is None:
            raise ScaletrainError(f"compare: no experiment named {experiment!r} in {default_uri}")
        found = c.search_runs([exp.experiment_id], filter_string=filter_string, max_results=max_runs,
                              order_by=["attributes.start_time DESC"])
        seen = {d.run_id for d in out}
        out.extend(_fetch(c, x.info.run_id) for x in found if x.info.run_id not in seen)
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


def compare(runs: list[RunData], directions: bool = False) -> Comparison:
    """The side-by-side table of ``runs`` (see the module docstring); evaluation scores per group, and per
    direction too with ``directions``."""
    keys = sorted({k for r in runs for k in r.params})
    differing = [k for k in keys if k not in IGNORED_PARAMS and len({r.params.get(k) for r in runs}) > 1]
    rows: list[tuple[str, list[Any]]] = [("config: " + k, [r.params.get(k) for r in runs]) for k in differing]
    rows.append(("status", [r.status for r in runs]))
    rows.append(("steps", [_int(r.metrics.get("train/steps")) for r in runs]))
    rows.append(("wall time (s)", [_clean(r.metrics.get("train/seconds")) for r in runs]))
    curve_keys = _curve_keys({k for r in runs for k in r.metrics})
    for k in curve_keys:
        best = BEST_MODE.get(k, max)
        rows.append((f"{k} final", [_clean(r.metrics.get(k)) for r in runs]))
        rows.append((f"{k} best", [_clean(best(v for _, v in r.histories[k])) if r.histories.get(k) else None
                                   for r in runs]))
    for k in sorted({k for r in runs for k in r.metrics if k.startswith(EVAL_PREFIXES)}):
        if directions or not is_direction_key(k):
            rows.append((k, [_clean(r.metrics.get(k)) for r in runs]))
    for k, name in MEAN_ROWS:
        if any(r.histories.get(k) for r in runs):
            rows.append((name, [_clean(sum(v for _, v in r.histories[k]) / len(r.histories[k]))
                                if r.histories.get(k) else None for r in runs]))
    for k, name in (("sys/cuda_max_allocated_mb", "peak CUDA memory (MB)"), ("sys/max_rss_mb", "peak RSS (MB)")):
        if any(k in r.metrics for r in runs):
            rows.append((name, [_clean(r.metrics.get(k)) for r in runs]))
    return Comparison(runs, rows, differing)


def _int(v):
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else int(v)


def plot_comparison(runs: list[RunData], path: str | os.PathLike, *, width: float = 12.0, height: float = 4.0,
                    dpi: int = 100) -> Path:
    """One PNG of ``width`` x ``height`` inches at ``dpi``: train loss and validation nll against step, each
    run one colour; a third panel with the evaluation chrF per group (bars) when any run has scores."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    # chrF rather than BLEU: it separates short or early runs whose BLEU is still ~0
    groups = sorted({k[len("test/chrf/"):] for r in runs for k in r.metrics
                     if k.startswith("test/chrf/") and not is_direction_key(k)})
    panels = [k for k in CURVES if any(r.histories.get(k) for r in runs)] or list(CURVES[:1])
    n = len(panels) + (1 if groups else 0)
    fig, axes = plt.subplots(1, n, figsize=(width, height), dpi=dpi, squeeze=False)
    for ax, key in zip(axes[0], panels):
        for r in runs:
            h = r.histories.get(key)
            if h:
                ax.plot([s for s, _ in h], [v for _, v in h], marker="." if len(h) < 30 else None, label=r.label)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if groups:
        ax = axes[0][-1]
        bw = 0.8 / max(len(runs), 1)
        for i, r in enumerate(runs):
            ax.bar([g + i * bw for g in range(len(groups))],
                   [r.metrics.get(f"test/chrf/{g}", 0.0) for g in groups], bw, label=r.label)
        ax.set_xticks([g + 0.4 - bw / 2 for g in range(len(groups))], groups, rotation=45, ha="right",
                      fontsize="small")
        ax.set_title("test chrF per group")
        ax.legend(fontsize="small")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)  # no bbox_inches="tight": the size is exactly width x height
    plt.close(fig)
    return out
