"""Plots of one run, written at the end of training to ``<out_dir>/plots/`` and logged as artifacts.

:func:`plot_learning_curves` reads the run's tracking journal (``<out_dir>/tracking/journal.jsonl``,
which holds every logged value of every session of the job, with its step and wall-clock timestamp)
and draws train loss and validation nll against step and against wall-clock time. matplotlib, Agg
backend. (Side-by-side plots of several runs: :func:`scaletrain.compare.plot_comparison`.)
"""
from __future__ import annotations

import os
from pathlib import Path

from scaletrain.tracking import JOURNAL, read_journal

__all__ = ["plot_learning_curves", "CURVE_KEYS"]

CURVE_KEYS = ("train/loss", "valid/nll")


def _series(journal: Path) -> dict[str, list[tuple[int, float, float]]]:
    """key -> [(step, minutes since the first record, value)], in logging order."""
    recs = read_journal(journal)
    t0 = next((r["ts"] for r in recs if "ts" in r), 0)
    out: dict[str, list[tuple[int, float, float]]] = {k: [] for k in CURVE_KEYS}
    for r in recs:
        if r.get("t") != "m":
            continue
        for k in CURVE_KEYS:
            if k in r["v"]:
                out[k].append((int(r["s"]), (r["ts"] - t0) / 60000.0, float(r["v"][k])))
    return out


def plot_learning_curves(run_dir: str | os.PathLike, path: str | os.PathLike | None = None, *,
                         title: str = "", dpi: int = 100) -> Path | None:
    """``<run_dir>/plots/learning_curves.png`` (or ``path``), 1000 x 700 pixels at the default dpi: train
    loss (top) and validation nll (bottom) against step (left) and wall-clock minutes (right). None when
    the journal has no curve values."""
    journal = Path(run_dir) / "tracking" / JOURNAL
    if not journal.is_file():
        return None
    series = _series(journal)
    if not any(series.values()):
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), dpi=dpi)
    for row, key in enumerate(CURVE_KEYS):
        pts = series[key]
        for col, (xi, xlabel) in enumerate(((0, "step"), (1, "wall-clock minutes since the run started"))):
            ax = axes[row][col]
            if pts:
                ax.plot([p[xi] for p in pts], [p[2] for p in pts], marker="." if len(pts) < 50 else None)
            ax.set_title(key)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path) if path is not None else Path(run_dir) / "plots" / "learning_curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out
