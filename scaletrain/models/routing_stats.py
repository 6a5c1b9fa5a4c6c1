"""MoCE routing statistics as flat metrics (for the training loop / MLflow)."""
from __future__ import annotations

from typing import Callable, Optional

from torch import nn


def routing_metrics(model: nn.Module, langs: list[str] | None = None, reset: bool = True,
                    reduce: Optional[Callable[[list[float]], list[float]]] = None) -> dict[str, float]:
    """Flat ``{name: value}`` metrics from ``model.routing_stats()`` (MoCE); ``{}`` for other models.

    Copies the device-side counters to the host (one sync): call it every N steps, not every step.
    Per routed layer (``L`` = the encoder layer index) and source language (``langs[i]``, or the
    manifest index), over the real tokens routed since the last reset:

    - ``routing/L<L>/<lang>/share_k<kernel>``: fraction of the (q|k|v, head, token) routing choices
      that picked the expert with that kernel size (k0 = identity); sums to 1 over the experts
      (each slot makes ``top_k`` choices, the share divides by them);
    - ``routing/L<L>/<lang>/mean_radius``: routing-weighted receptive radius (k-1)/2, the MoCE paper's
      delta (Fig. 4);
    - ``routing/L<L>/all/...``: the same over all languages, weighted by tokens.
    ``model`` may be wrapped (DeepSpeed/DDP ``.module``).
    """
    inner = getattr(model, "module", model)
    out: dict[str, float] = moe_metrics(inner, reset, reduce)  # MoE counts: all ranks' when reduce is given
    fn = getattr(inner, "routing_stats", None)
    if not callable(fn):
        return out
    for name, st in fn(reset=reset).items():
        sel, radius, tokens = st.get("selection") or [], st.get("mean_radius") or [], st.get("tokens") or []
        if not sel:
            continue
        kernels = list(st["kernels"])
        k_per_slot = float(st.get("top_k") or 1)  # each slot picks top_k experts: rows of selection sum to top_k
        parts = name.split(".")
        layer = next((p for p in parts if p.isdigit()), name)
        prefix = f"routing/L{layer}"
        tot_tok = sum(tokens)
        agg = [0.0] * len(kernels)
        agg_r = 0.0
        for i, n in enumerate(tokens):
            if n <= 0:
                continue
            lang = langs[i] if langs is not None and i < len(langs) else str(i)
            for e, k in enumerate(kernels):
                share = sel[i][e] / k_per_slot
                out[f"{prefix}/{lang}/share_k{k}"] = share
                agg[e] += share * n
            out[f"{prefix}/{lang}/mean_radius"] = radius[i]
            agg_r += radius[i] * n
        if tot_tok > 0:
            for e, k in enumerate(kernels):
                out[f"{prefix}/all/share_k{k}"] = agg[e] / tot_tok
            out[f"{prefix}/all/mean_radius"] = agg_r / tot_tok
    return out


def moe_metrics(model: nn.Module, reset: bool = True,
                reduce: Optional[Callable[[list[float]], list[float]]] = None) -> dict[str, float]:
    """Per MoE feed-forward layer (scaletrain.models.moe), the counts since the last reset:
    ``moe/<layer>/dropped`` (fraction of the routed (token, slot) pairs dropped by the capacity limit;
    0 when dropless) and ``moe/<layer>/max_load`` (the busiest expert's share of the kept pairs times
    the number of experts: 1 = perfectly balanced, E = everything on one expert).

    ``reduce``: a sum over ranks of a list of numbers (``Engine.all_reduce_sum``), to report all
    ranks' counts; a collective then, so every rank must call this at the same point."""
    layers = [(name, mod.moe_stats(reset=reset)) for name, mod in model.named_modules()
              if callable(getattr(mod, "moe_stats", None))]
    flat = [float(v) for _, st in layers for v in (st["pairs"], st["dropped"], *st["load"])]
    if reduce is not None and flat:
        flat = reduce(flat)
    out: dict[str, float] = {}
    pos = 0
    for name, st in layers:
        n = 2 + len(st["load"])
        pairs, dropped, load = flat[pos], flat[pos + 1], flat[pos + 2:pos + n]
        pos += n
        if not pairs:
            continue
        layer = name.replace(".ffn", "").replace("_layers", "")
        kept = sum(load)
        out[f"moe/{layer}/dropped"] = dropped / pairs
        out[f"moe/{layer}/max_load"] = max(load) * len(load) / kept if kept else 0.0
    return out
