"""Plots of one run, written to ``<out_dir>/plots/`` and logged as artifacts. matplotlib, Agg backend.

* :func:`plot_learning_curves` (end of training) reads the run's tracking journal
  (``<out_dir>/tracking/journal.jsonl``, which holds every logged value of every session of the job,
  with its step and wall-clock timestamp) and draws train loss and validation NLL against the update and
  against training time (minutes since each session started, summed over the sessions of the job), with
  the target-unigram NLL of the validation split (``baseline/unigram_valid_nll``, what a model that ignores
  the source scores) as a dashed reference line.
* :func:`plot_expert_usage` (end of training, MoCE and MoE): each expert's share of the routing
  choices per source language (and for MoCE the mean receptive radius per language), per routed layer
  (the MoCE paper's Fig. 4), from the last routing statistics the run logged
  (``routing/L<layer>/<lang>/share_k<k>``, ``.../mean_radius``; MoE encoder layers:
  ``moe_usage/<layer>/<lang>/share_e<i>``; since the last validation, summed over ranks).
* :func:`plot_eval_scores` (``scaletrain evaluate``): BLEU and chrF per group (all, xx->en, en->xx, the
  recipe's ``eval.groups``) with the copy-the-source baseline beside each bar, titled with what was
  evaluated (split, lines, beam, lenpen, length limit, step).

Every plot says what it shows without its file name: a title, axes labelled with their units, legends
outside the data where they could hide it. Beside each PNG, a JSON file of the same name holds the numbers
drawn and, under ``figure``, the figure's structure (:func:`figure_structure`: titles, axis labels, the
labels of the lines, bars and texts); the PNG carries the same in its ``Title``/``Description`` text
chunks. (Side-by-side plots of several runs: :func:`scaletrain.tracking.compare.plot_comparison`.)
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from scaletrain.tracking.journal import JOURNAL, read_journal

__all__ = ["plot_learning_curves", "plot_expert_usage", "plot_eval_scores", "routing_usage", "eval_scores",
           "figure_structure", "save_figure", "pyplot", "missing_bar", "curve_labels", "token_unit", "CURVE_KEYS",
           "CURVE_TITLES", "SCORE_LABELS", "STEP_LABEL", "BASELINE_KEY"]

CURVE_KEYS = ("train/loss", "valid/nll")
BASELINE_KEY = "baseline/unigram_valid_nll"  # logged by the trainer (train/baseline.py)
TIME_LABEL = "training time (min)"
STEP_LABEL = "update"


def token_unit(tokenizer: str | None) -> str:
    """What one target token is under ``data.tokenizer``: a byte, a subword piece (spm), else a token."""
    return {"byte": "byte", "spm": "subword"}.get(str(tokenizer or ""), "token")


def curve_labels(unit: str) -> dict[str, str]:
    """The y-axis label of each learning curve, with its unit."""
    return {"train/loss": f"training loss (label-smoothed CE,\nnats / target {unit})",
            "valid/nll": f"validation NLL (nats / target {unit})"}


CURVE_TITLES = {"train/loss": "training loss", "valid/nll": "validation NLL"}


def _series(journal: Path) -> tuple[dict[str, list[tuple[int, float, float]]], float | None, str]:
    """(key -> [(step, training minutes, value)] in logging order, the target-unigram NLL, the token unit).
    Training minutes count from each session's start and add up over the sessions of the job, so the time
    a job waited between a preemption and its resume is not drawn."""
    out: dict[str, list[tuple[int, float, float]]] = {k: [] for k in CURVE_KEYS}
    baseline, tokenizer = None, None
    base_min, session_t0, last_min = 0.0, None, 0.0
    for r in read_journal(journal):
        t = r.get("t")
        if t in ("start", "resume") and "ts" in r:
            base_min, session_t0 = last_min, r["ts"]
        elif t == "params":
            tokenizer = r["v"].get("data.tokenizer", tokenizer)
        if t != "m":
            continue
        if session_t0 is None:
            session_t0 = r["ts"]
        last_min = base_min + (r["ts"] - session_t0) / 60000.0
        baseline = r["v"].get(BASELINE_KEY, baseline)
        for k in CURVE_KEYS:
            if k in r["v"]:
                out[k].append((int(r["s"]), last_min, float(r["v"][k])))
    return out, baseline, token_unit(tokenizer)


def _reference(ax, baseline: float | None) -> None:
    if baseline is not None:
        ax.axhline(baseline, color="gray", linestyle="--", linewidth=1,
                   label=f"target-unigram NLL, validation split ({baseline:.2f})")


def plot_learning_curves(run_dir: str | os.PathLike, path: str | os.PathLike | None = None, *,
                         title: str = "", dpi: int = 100) -> Path | None:
    """``<run_dir>/plots/learning_curves.png`` (or ``path``; + ``.json``), 1000 x 700 pixels at the default
    dpi: train loss (top) and validation NLL (bottom) against the update (left) and training time (right),
    with the target-unigram NLL as a dashed line. None when the journal has no curve values."""
    journal = Path(run_dir) / "tracking" / JOURNAL
    if not journal.is_file():
        return None
    series, baseline, unit = _series(journal)
    if not any(series.values()):
        return None
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), dpi=dpi)
    ylabels = curve_labels(unit)
    for row, key in enumerate(CURVE_KEYS):
        pts = series[key]
        for col, (xi, xlabel) in enumerate(((0, STEP_LABEL), (1, TIME_LABEL))):
            ax = axes[row][col]
            if pts:
                ax.plot([p[xi] for p in pts], [p[2] for p in pts], marker="." if len(pts) < 50 else None,
                        label=CURVE_TITLES[key])
            else:
                ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="gray")
            _reference(ax, baseline)
            ax.set_title(f"{CURVE_TITLES[key]} by {'update' if col == 0 else 'training time'}")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabels[key])
            ax.grid(alpha=0.3)
    if baseline is not None:  # below the panels, where it hides no point
        ref = [ln for ln in axes[0][0].get_lines() if ln.get_label().startswith("target-unigram")]
        fig.legend(ref, [f"target-unigram NLL of the validation split ({baseline:.2f} nats): what a model that "
                         "ignores the source scores"], loc="lower center", fontsize="small", frameon=False)
    fig.suptitle(f"learning curves: {title}" if title else "learning curves")
    fig.tight_layout(rect=(0, 0.03 if baseline is not None else 0, 1, 1))
    out = Path(path) if path is not None else Path(run_dir) / "plots" / "learning_curves.png"
    data = {k: [{"step": s, "minutes": m, "value": v} for s, m, v in pts] for k, pts in series.items()}
    data[BASELINE_KEY] = baseline
    _save(fig, out, data, dpi)
    plt.close(fig)
    return out


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display; imported on first use)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def figure_structure(fig) -> dict:
    """What a reader sees of a figure, without pixels: its title, and per panel the title, axis labels, the
    labels of its lines and bars, its texts and legend entries; the figure's own legends."""
    def labels(items) -> list[str]:
        return [x.get_label() for x in items if not str(x.get_label()).startswith("_")]

    axes = []
    for ax in fig.axes:
        if not ax.axison:
            continue
        legend = ax.get_legend()
        axes.append({"title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
                     "lines": labels(ax.get_lines()), "bars": labels(ax.containers),
                     "texts": [t.get_text() for t in ax.texts],
                     "legend": [t.get_text() for t in legend.get_texts()] if legend else []})
    title = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) is not None else ""
    return {"title": title, "axes": axes, "legend": [t.get_text() for lg in fig.legends for t in lg.get_texts()]}


def save_figure(fig, path: str | os.PathLike, dpi: int) -> dict:
    """Write the PNG atomically, its title and :func:`figure_structure` in its text chunks; returns the
    structure."""
    from scaletrain.fileio import temp_path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    structure = figure_structure(fig)
    tmp = temp_path(path)
    fig.savefig(tmp, dpi=dpi, format="png", metadata={
        "Title": structure["title"], "Description": json.dumps(structure, ensure_ascii=False)})
    os.replace(tmp, path)
    return structure


def _save(fig, path: Path, data: dict, dpi: int) -> Path:
    """The PNG and, beside it, ``<name>.json`` with the numbers drawn and the figure's structure (both
    written atomically)."""
    from scaletrain.fileio import atomic_write_text

    data = {**data, "figure": save_figure(fig, path, dpi)}
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
    plt = pyplot()
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
        ax.set_xlabel("share of the routing choices since the last validation")
        ax.set_ylabel("source language")
        ax.invert_yaxis()
        ax.legend(fontsize="x-small", ncol=min(len(ks), 8), loc="lower left", bbox_to_anchor=(0, 1.12),
                  frameon=False)
        if "mean_radius" in d:
            axr.barh(d["langs"], [r or 0.0 for r in d["mean_radius"]], color="gray")
            axr.set_title("mean radius")
            axr.set_xlabel("receptive radius (tokens)")
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
    (``RUN/eval/<name>/eval.json``, ``scaletrain evaluate --json``, or an older ``eval_<split>.json``), with
    the evaluation's name and a one-line description of what was evaluated."""
    model = eval_json["model"]["averages"]
    base = {a["name"]: a for a in eval_json.get("copy_baseline", {}).get("averages", [])}
    ev = eval_json.get("evaluation") or {}
    description = ev.get("description") or (
        f"{eval_json.get('split')}, {eval_json.get('lines')} lines, beam {eval_json.get('beam')}, "
        f"lenpen {eval_json.get('lenpen')}, step {eval_json.get('step')}")
    return {"name": eval_json.get("name") or "", "description": description,
            "split": eval_json.get("split"), "step": eval_json.get("step"), "checkpoint": eval_json.get("checkpoint"),
            "groups": [a["name"] for a in model], "bleu": [a["bleu"] for a in model],
            "chrf": [a["chrf"] for a in model],
            "copy_baseline": {"bleu": [base.get(a["name"], {}).get("bleu") for a in model],
                              "chrf": [base.get(a["name"], {}).get("chrf") for a in model]}}


def missing_bar(ax, x: float, width: float, top: float, text: str, color="gray", label: str | None = None) -> None:
    """A hatched, unfilled bar the height of the panel with ``text`` written up it: a value that does not
    exist, drawn so it cannot be read as a zero."""
    ax.bar([x], [top], width, fill=False, hatch="///", edgecolor=color, linewidth=0.6, label=label or "_missing")
    ax.text(x, top / 2, text, rotation=90, ha="center", va="center", fontsize=7, color="black",
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})


def _value_labels(ax, xs, values, fmt: str = "{:.1f}") -> None:
    for x, v in zip(xs, values):
        if v is not None:
            ax.text(x, v, fmt.format(v), rotation=90, ha="center", va="bottom", fontsize=7)


SCORE_LABELS = {"bleu": "BLEU (sacreBLEU, 0-100)", "chrf": "chrF (sacreBLEU, 0-100)"}


def plot_eval_scores(eval_json: dict, path: str | os.PathLike, *, dpi: int = 100) -> Path:
    """BLEU (top) and chrF (bottom) per group, each model bar labelled with its value, the copy-the-source
    baseline as a lighter bar beside it, a group without a score hatched; titled with the evaluation's name
    and what it evaluated; ``path`` and ``path.json`` (:func:`eval_scores`)."""
    data = eval_scores(eval_json)
    plt = pyplot()
    n = len(data["groups"])
    fig, axes = plt.subplots(2, 1, figsize=(max(7.0, 0.55 * n + 2.5), 8), dpi=dpi, sharex=True)
    x = list(range(n))
    for ax, metric in zip(axes, ("bleu", "chrf")):
        vals, base = data[metric], data["copy_baseline"][metric]
        top = max([v for v in vals + base if v is not None] + [1.0]) * 1.25
        ax.bar([i - 0.2 for i in x], [v if v is not None else 0.0 for v in vals], width=0.4,
               color="tab:blue", label="model")
        ax.bar([i + 0.2 for i in x], [v if v is not None else 0.0 for v in base], width=0.4, color="lightgray",
               label="copy the source (baseline)")
        for i, v in enumerate(vals):
            if v is None:
                missing_bar(ax, i - 0.2, 0.4, top, "no score")
        _value_labels(ax, [i - 0.2 for i in x], vals)
        ax.set_ylim(0, top)
        ax.set_ylabel(SCORE_LABELS[metric])
        ax.set_title(f"{'BLEU' if metric == 'bleu' else 'chrF'} per language group")
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_xticks(x, data["groups"], rotation=30, ha="right")
    axes[1].set_xlabel("language group (mean over its directions)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=2, fontsize="small", bbox_to_anchor=(0.5, 0.915),
               frameon=False)
    title = [f"evaluation {data['name']}" if data["name"] else "", data["description"],
             f"checkpoint {data['checkpoint']}" if data["checkpoint"] else ""]
    fig.suptitle("\n".join(t for t in title if t), fontsize="medium")
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    out = _save(fig, Path(path), data, dpi)
    plt.close(fig)
    return out
