"""MoE expert usage per source language (the MoCE paper's Fig. 4, for the sparse MoE layers).

The MoE layers count routed pairs per expert but not per language; this meter adds that from the
outside with two hooks per encoder MoE layer (``scaletrain.models.moe.MoEFeedForward``): a forward
pre-hook keeps the pad mask (the layer's router sees every row b * T + t, pads included, and pads
are not routed) and a forward hook on its router takes the router's top-k choice for each real row
and adds it to a ``[languages, experts]`` count on the device, by the sentence's source language
(:meth:`set_batch`); no host sync. Only training forwards
are counted (not validation, not activation-checkpoint recomputation); the counts are the router's
choices before any capacity drop. :meth:`metrics` all-reduces the counts over ranks (a collective
at the step logger's report) and returns ``moe_usage/<layer>/<lang>/share_e<i>`` (each expert's share
of the language's routing choices; ``all`` = every language).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn


def _encoder_moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    inner = getattr(model, "module", model)
    return [(name, m) for name, m in inner.named_modules()
            if name.startswith("encoder_layers.") and isinstance(getattr(m, "router", None), nn.Module)
            and hasattr(m, "num_experts") and hasattr(m, "top_k")]


class MoeLanguageUsage:
    """Counts the router choices of each encoder MoE layer per source language (see the module docstring)."""

    def __init__(self, model: nn.Module, n_langs: int):
        self.layers = _encoder_moe_layers(model)
        self.n_langs = n_langs
        self._langs: Optional[torch.Tensor] = None  # [B] source language of the current batch
        self._rows: dict[str, Optional[torch.Tensor]] = {}
        self.counts: dict[str, torch.Tensor] = {}
        for name, mod in self.layers:
            self.counts[name] = torch.zeros(n_langs, mod.num_experts, dtype=torch.float64)
            mod.register_forward_pre_hook(self._pre(name))
            mod.router.register_forward_hook(self._post(name, mod))

    @classmethod
    def for_model(cls, model: nn.Module, n_langs: int) -> "MoeLanguageUsage | None":
        return cls(model, n_langs) if _encoder_moe_layers(model) else None

    def set_batch(self, src_lang: torch.Tensor) -> None:
        self._langs = src_lang

    def _counting(self, mod: nn.Module) -> bool:
        return (self._langs is not None and mod.training and torch.is_grad_enabled()
                and torch._C._current_graph_task_id() == -1)  # not a recomputation in backward

    def _pre(self, name: str):
        def hook(mod, args):
            if not self._counting(mod) or not args:
                self._rows[name] = None
                return
            x = args[0]
            pad = args[1] if len(args) > 1 else None
            # the layer routes every row [B * T] (pads too, with weight 0): remember which rows count
            real = ~pad if pad is not None else torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
            self._rows[name] = real
        return hook

    def _post(self, name: str, mod: nn.Module):
        def hook(router, args, logits):
            real = self._rows.pop(name, None)
            if real is None:
                return
            with torch.no_grad():  # no host sync: row b * T + t belongs to sentence b; counts by scatter_add
                B, T = real.shape
                langs = self._langs.to(real.device)[:, None].expand(B, T).reshape(-1)
                idx = logits.topk(mod.top_k, dim=-1).indices  # the same choice as MoEFeedForward.route
                flat = (langs[:, None] * mod.num_experts + idx).reshape(-1)
                ones = real.reshape(-1, 1).expand_as(idx).reshape(-1).to(torch.float64)
                if self.counts[name].device != flat.device:
                    self.counts[name] = self.counts[name].to(flat.device)
                self.counts[name].view(-1).scatter_add_(0, flat, ones)
        return hook

    def metrics(self, langs: list[str], reduce: Callable[[list[float]], list[float]],
                reset: bool = True) -> dict[str, float]:
        """Shares since the last reset, summed over ranks by ``reduce`` (collective)."""
        flat = [float(v) for name, _ in self.layers for v in self.counts[name].reshape(-1).tolist()]
        flat = reduce(flat) if flat else flat
        out: dict[str, float] = {}
        pos = 0
        for name, mod in self.layers:
            E = mod.num_experts
            c = torch.tensor(flat[pos:pos + self.n_langs * E], dtype=torch.float64).view(self.n_langs, E)
            pos += self.n_langs * E
            layer = name.replace(".ffn", "").replace("_layers", "")
            rows = [(langs[i] if i < len(langs) else str(i), c[i]) for i in range(self.n_langs)] + [("all", c.sum(0))]
            for lang, row in rows:
                tot = float(row.sum())
                if tot > 0:
                    out.update({f"moe_usage/{layer}/{lang}/share_e{e}": float(row[e]) / tot for e in range(E)})
            if reset:
                self.counts[name].zero_()
        return out
