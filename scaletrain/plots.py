"""Plots of one run, written to ``<out_dir>/plots/`` and logged as artifacts. matplotlib, Agg backend.

* :func:`plot_learning_curves` (end of training) reads the run's tracking journal
  (``<out_dir>/tracking/journal.jsonl``, which holds every logged value of every session of the job,
  with its step and wall-clock timestamp) and draws train loss and validation nll against step and
  against wall-clock time.
* :func:`plot_expert_usage` (end of training, MoCE and MoE): each expert's share of the routing
  choices per source language (and for MoCE the mean receptive radius per language), per routed layer
  (the MoCE paper's Fig. 4), from the last routing statistics the run logged
  (``routing/L<layer>/<lang>/share_k<k>``, ``.../mean_radius``; MoE encoder layers:
  ``moe_usage/<layer>/<lang>/share_e<i>``; since the last validation, summed over ranks).
* :func:`plot_eval_scores` (``scaletrain evaluate``): BLEU and chrF per group (all, xx->en, en->xx, the
  recipe's ``eval.groups``) with the copy-the-source baseline beside each bar.

Beside each PNG, a JSON file of the same name holds the numbers drawn. (Side-by-side plots of several
runs: :func:`scaletrain.compare.plot_comparison`.)
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from scaletrain.tracking import JOURNAL, read_journal

__all__ = ["plot_learning_curves", "plot_expert_usage", "plot_eval_scores", "routing_usage", "eval_scores",
           "CURVE_KEYS"]

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
    """``<run_dir>/plots/learning_curves.png`` (or ``path``; + ``.json``), 1000 x 700 pixels at the default
    dpi: train loss (top) and validation nll (bottom) against step (left) and wall-clock minutes (right).
    None when the journal has no curve values."""
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
    _save(fig, out, {k: [{"step": s, "minutes": m, "value": v} for s, m, v in pts] for k, pts in series.items()},
          dpi)
    plt.close(fig)
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, data: dict, dpi: int) -> Path:
    """The PNG and, beside it, ``<name>.json`` with the numbers drawn (both written atomically)."""
    from scaletrain.fileio import atomic_write_text, temp_path

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    fig.savefig(tmp, dpi=dpi, format="png")
    os.replace(tmp, path)
    atomic_write_text(path.with_suffix(".json"), json.dumps(data, indent=1) + "\n")
    return path


_ROUTING = re.compile(r"^(?:routing/L(?P<layer>[^/]+)/(?P<lang>[^/]+)/(?:share_k(?P<k>\d+)|mean_radius)"
                      r"|moe_usage/(?P<moe>[^/]+)/(?P<mlang>[^/]+)/share_e(?P<e>\d+))$")


def routing_usage(journal: str | os.PathLike) -> dict | None:
    """The last routing statistics in a tracking journal: ``{"step": s, "layers": {name: layer}}``, a
    MoCE layer ``"L<i>": {"kernels": [k...], "langs": [lang..., "all"], "share": [[share per kernel] per
    lang], "mean_radius": [per lang]}`` (k0 = identity), an MoE layer ``"moe <layer>": {"experts": [e...],
    "langs", "share"}`` (:mod:`scaletrain.train.moe_usage`); None when the run logged none."""
    last = None
    for r in read_journal(journal):
        if r.get("t") == "m" and any(_ROUTING.match(k) for k in r["v"]):
            last = r
    if last is None:
        return None
    raw: dict[str, dict] = {}
    for key, v in last["v"].items():
        m = _ROUTING.match(key)
        if not m:
            continue
        moe = m["moe"] is not None
        layer = raw.setdefault(f"moe {m['moe']}" if moe else f"L{m['layer']}",
                               {"share": {}, "radius": {}, "unit": "experts" if moe else "kernels"})
        lang, k = (m["mlang"], m["e"]) if moe else (m["lang"], m["k"])
        if k is None:
            layer["radius"][lang] = v
        else:
            layer["share"].setdefault(lang, {})[int(k)] = v
    layers = {}
    for name, d in sorted(raw.items()):
        langs = sorted(d["share"], key=lambda x: (x == "all", x))
        ks = sorted({k for per in d["share"].values() for k in per})
        layers[name] = {d["unit"]: ks, "langs": langs,
                        "share": [[d["share"][lang].get(k, 0.0) for k in ks] for lang in langs]}
        if d["radius"]:
            layers[name]["mean_radius"] = [d["radius"].get(lang) for lang in langs]
    return {"step": last["s"], "layers": layers}


def plot_expert_usage(run_dir: str | os.PathLike, path: str | os.PathLike | None = None, *, title: str = "",
                      dpi: int = 100) -> Path | None:
    """``<run_dir>/plots/expert_usage.png`` (and ``.json``): per routed layer, stacked bars of each expert's
    share per source language (left) and the mean radius per language (right). None without routing
    statistics in the journal."""
    journal = Path(run_dir) / "tracking" / JOURNAL
    usage = routing_usage(journal) if journal.is_file() else None
    if not usage or not usage["layers"]:
        return None
    plt = _pyplot()
    layers = usage["layers"]
    n_langs = max(len(d["langs"]) for d in layers.values())
    fig, axes = plt.subplots(len(layers), 2, figsize=(10, 1.0 + (0.3 * n_langs + 0.5) * len(layers)), dpi=dpi,
                             squeeze=False, gridspec_kw={"width_ratios": [3, 1]})
    cmap = plt.get_cmap("viridis")
    for row, (name, d) in enumerate(layers.items()):
        ax, axr = axes[row]
        moce = "kernels" in d
        ks = d["kernels"] if moce else d["experts"]
        left = [0.0] * len(d["langs"])
        for e, k in enumerate(ks):
            widths = [d["share"][i][e] for i in range(len(d["langs"]))]
            label = ("identity (k0)" if k == 0 else f"k{k}") if moce else f"expert {k}"
            ax.barh(d["langs"], widths, left=left, color=cmap(e / max(len(ks) - 1, 1)), label=label)
            left = [a + b for a, b in zip(left, widths)]
        ax.set_xlim(0, 1)
        ax.set_title(f"{name}: expert share per source language (step {usage['step']})")
        ax.invert_yaxis()
        ax.legend(fontsize="x-small", ncol=min(len(ks), 8), loc="lower left", bbox_to_anchor=(0, 1.12),
                  frameon=False)
        if "mean_radius" in d:
            axr.barh(d["langs"], [r or 0.0 for r in d["mean_radius"]], color="gray")
            axr.set_title("mean radius")
            axr.invert_yaxis()
            axr.set_yticklabels([])
        else:
            axr.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path) if path is not None else Path(run_dir) / "plots" / "expert_usage.png"
    _save(fig, out, usage, dpi)
    plt.close(fig)
    return out


def eval_scores(eval_json: dict) -> dict:
    """The per-group numbers :func:`plot_eval_scores` draws, from an evaluation JSON
    (``scaletrain evaluate --json`` / ``eval_<split>.json``)."""
    model = eval_json["model"]["averages"]
    base = {a["name"]: a for a in eval_json.get("copy_baseline", {}).get("averages", [])}
    return {"split": eval_json.get("split"), "step": eval_json.get("step"), "checkpoint": eval_json.get("checkpoint"),
            "groups": [a["name"] for a in model], "bleu": [a["bleu"] for a in model],
            "chrf": [a["chrf"] for a in model],
            "copy_baseline": {"bleu": [base.get(a["name"], {}).get("bleu") for a in model],
                              "chrf": [base.get(a["name"], {}).get("chrf") for a in model]}}


def plot_eval_scores(eval_json: dict, path: str | os.PathLike, *, dpi: int = 100) -> Path:
    """BLEU (left) and chrF (right) per group, the copy baseline as a lighter bar beside each; ``path``
    and ``path.json`` (:func:`eval_scores`)."""
    data = eval_scores(eval_json)
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(max(6.0, 1.2 * len(data["groups"]) + 3), 4), dpi=dpi)
    x = list(range(len(data["groups"])))
    for ax, metric in zip(axes, ("bleu", "chrf")):
        ax.bar([i - 0.2 for i in x], [v if v is not None else 0.0 for v in data[metric]], width=0.4, label="model")
        ax.bar([i + 0.2 for i in x], [v if v is not None else 0.0 for v in data["copy_baseline"][metric]],
               width=0.4, color="lightgray", label="copy source")
        ax.set_xticks(x, data["groups"], rotation=30, ha="right")
        ax.set_title(f"{data['split']} {'BLEU' if metric == 'bleu' else 'chrF'} (step {data['step']})")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    out = _save(fig, Path(path), data, dpi)
    plt.close(fig)
    return out
