"""Routing statistics as flat metrics (for the training loop / MLflow): MoCE expert shares and radius
per source language, MoE feed-forward drops and load; summed over the ranks when given a reduction."""
from __future__ import annotations

from typing import Callable, Optional

from torch import nn

Reduce = Callable[[list[float]], list[float]]


def has_routing(model: nn.Module) -> bool:
    """``model`` (or the module it wraps) has a part that keeps routing statistics (MoCE's routed attention, a
    ``routing_stats`` of its own; MoE layers, ``moe_stats``). A dense model has none: :func:`routing_metrics`
    would be ``{}``."""
    inner = getattr(model, "module", model)
    return any(m is not inner and (callable(getattr(m, "routing_stats", None)) or callable(getattr(m, "moe_stats", None)))
               for m in inner.modules())


def routing_metrics(model: nn.Module, langs: list[str] | None = None, reset: bool = True,
                    reduce: Optional[Reduce] = None) -> dict[str, float]:
    """Flat ``{name: value}`` metrics from ``model.routing_stats()`` (MoCE) and the MoE feed-forward
    layers' counts (:func:`moe_metrics`); ``{}`` for other models.

    Copies the device-side counters to the host (one sync): call it every N steps, not every step.
    Per routed layer (``L`` = the encoder layer index) and source language (``langs[i]``, or the
    manifest index), over the real tokens routed since the last reset:

    - ``routing/L<L>/<lang>/share_k<kernel>``: fraction of the (q|k|v, head, token) routing choices
      that picked the expert with that kernel size (k0 = identity); sums to 1 over the experts
      (each slot makes ``top_k`` choices, the share divides by them);
    - ``routing/L<L>/<lang>/mean_radius``: routing-weighted receptive radius (k-1)/2, the MoCE paper's
      delta (Fig. 4);
    - ``routing/L<L>/all/...``: the same over all languages, weighted by tokens.

    ``reduce``: a sum over ranks of a list of numbers (``ParallelContext.all_reduce_sum``). The counts of every
    rank (MoCE: selections, radius sums and routed slots per language; MoE: pairs, drops, load) are
    summed in one call before any share is formed, so the metrics describe all ranks' tokens; a
    collective then, so every rank must call this at the same point. ``model`` may be wrapped
    (DeepSpeed/DDP ``.module``).
    """
    inner = getattr(model, "module", model)
    moe = _moe_counts(inner, reset)
    moce = _moce_counts(inner, reset)
    flat = [v for _, counts in moe for v in counts] + [v for layer in moce for v in layer["counts"]]
    if reduce is not None and flat:
        flat = reduce(flat)
    n_moe = sum(len(c) for _, c in moe)
    out = _moe_from_counts(moe, flat[:n_moe])
    pos = n_moe
    for layer in moce:
        n = len(layer["counts"])
        out.update(_moce_from_counts(layer, flat[pos:pos + n], langs))
        pos += n
    return out


def _moce_counts(inner: nn.Module, reset: bool) -> list[dict]:
    """Per routed layer: its name, kernels, top_k and the flat sums [selected (L x E), radius (L),
    tokens (L)] over L source languages; the same length on every rank (zeros where nothing was
    routed), so that ranks can sum them."""
    fn = getattr(inner, "routing_stats", None)
    if not callable(fn):
        return []
    modules = dict(inner.named_modules())
    out = []
    for name, st in fn(reset=reset).items():
        kernels = list(st["kernels"])
        tokens = [float(t) for t in st.get("tokens") or []]
        n_langs = len(tokens) or int(getattr(modules.get(name), "n_langs", 0))
        if not n_langs:
            continue
        sel, radius = st.get("selection") or [], st.get("mean_radius") or []
        # the statistics come as means over the routed slots: back to sums (exact up to fp32 rounding)
        selected = [sel[i][e] * tokens[i] if tokens else 0.0 for i in range(n_langs) for e in range(len(kernels))]
        rad = [radius[i] * tokens[i] if tokens else 0.0 for i in range(n_langs)]
        out.append({"name": name, "kernels": kernels, "top_k": float(st.get("top_k") or 1), "n_langs": n_langs,
                    "counts": selected + rad + (tokens or [0.0] * n_langs)})
    return out


def _moce_from_counts(layer: dict, flat: list[float], langs: list[str] | None) -> dict[str, float]:
    kernels, n_langs = layer["kernels"], layer["n_langs"]
    E = len(kernels)
    selected, radius, tokens = flat[:n_langs * E], flat[n_langs * E:n_langs * (E + 1)], flat[n_langs * (E + 1):]
    layer_idx = next((p for p in layer["name"].split(".") if p.isdigit()), layer["name"])
    prefix = f"routing/L{layer_idx}"
    k_per_slot = layer["top_k"]  # each slot picks top_k experts
    out: dict[str, float] = {}
    for i, n in enumerate(tokens):
        if n <= 0:
            continue
        lang = langs[i] if langs is not None and i < len(langs) else str(i)
        for e, k in enumerate(kernels):
            out[f"{prefix}/{lang}/share_k{k}"] = selected[i * E + e] / n / k_per_slot
        out[f"{prefix}/{lang}/mean_radius"] = radius[i] / n
    tot = sum(t for t in tokens if t > 0)
    if tot > 0:
        for e, k in enumerate(kernels):
            out[f"{prefix}/all/share_k{k}"] = sum(selected[i * E + e] for i in range(n_langs)) / tot / k_per_slot
        out[f"{prefix}/all/mean_radius"] = sum(radius) / tot
    return out


def _moe_counts(model: nn.Module, reset: bool) -> list[tuple[str, list[float]]]:
    return [(name, [float(v) for v in (st["pairs"], st["dropped"], *st["load"])])
            for name, st in ((name, mod.moe_stats(reset=reset)) for name, mod in model.named_modules()
                             if callable(getattr(mod, "moe_stats", None)))]


def _moe_from_counts(layers: list[tuple[str, list[float]]], flat: list[float]) -> dict[str, float]:
    out: dict[str, float] = {}
    pos = 0
    for name, counts in layers:
        n = len(counts)
        pairs, dropped, load = flat[pos], flat[pos + 1], flat[pos + 2:pos + n]
        pos += n
        if not pairs:
            continue
        layer = name.replace(".ffn", "").replace("_layers", "")
        kept = sum(load)
        out[f"moe/{layer}/dropped"] = dropped / pairs
        out[f"moe/{layer}/max_load"] = max(load) * len(load) / kept if kept else 0.0
    return out


def moe_metrics(model: nn.Module, reset: bool = True, reduce: Optional[Reduce] = None) -> dict[str, float]:
    """Per MoE feed-forward layer (scaletrain.models.moe), the counts since the last reset:
    ``moe/<layer>/dropped`` (fraction of the routed (token, slot) pairs dropped by the capacity limit;
    0 when dropless) and ``moe/<layer>/max_load`` (the busiest expert's share of the kept pairs times
    the number of experts: 1 = perfectly balanced, E = everything on one expert).

    ``reduce``: a sum over ranks of a list of numbers (``ParallelContext.all_reduce_sum``), to report all
    ranks' counts; a collective then, so every rank must call this at the same point."""
    layers = _moe_counts(getattr(model, "module", model), reset)
    flat = [v for _, counts in layers for v in counts]
    if reduce is not None and flat:
        flat = reduce(flat)
    return _moe_from_counts(layers, flat)
