"""Expert shards <-> the full state dict: consolidation for export / inference and resharding for a
resume with another ep_size. The full state dict of an ep_size=P model is exactly the state dict of
the same model at ep_size=1 (each layer's experts stacked in global order along dim 0).

Expert parameters are found by their mark (``p.expert = True``) on a module that says which slice of
the layer's experts it holds (attributes ``first_expert`` and ``num_experts``; the local count is dim 0
of the parameter), e.g. ``scaletrain.models.moe.Experts``. Every EP rank holds the same number of
experts, so the gather is one ``all_gather`` per expert tensor over the EP group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.errors import ScaletrainError
from scaletrain.parallel.context import ParallelContext


def expert_shards(model: nn.Module) -> dict[str, tuple[int, int]]:
    """State-dict key -> (first global expert held here, experts in the layer) for every expert tensor."""
    out = {}
    for mname, mod in model.named_modules():
        if not (hasattr(mod, "first_expert") and hasattr(mod, "num_experts")):
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if getattr(p, "expert", False):
                out[f"{mname}.{pname}" if mname else pname] = (int(mod.first_expert), int(mod.num_experts))
    return out


def consolidate_state_dict(model: nn.Module, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """The full state dict (every expert of every layer) on every rank of the EP group; collective
    over the EP group when ep_size > 1 (every rank, same order)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if ctx.ep_size == 1:
        return sd
    for key in sorted(expert_shards(model)):
        t = sd[key].contiguous()
        parts = [torch.empty_like(t) for _ in range(ctx.ep_size)]
        dist.all_gather(parts, t, group=ctx.ep_group)
        sd[key] = torch.cat(parts, 0)
    return sd


def shard_state_dict(full: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``full`` (an ep_size=1 or consolidated state dict) cut to the experts ``model`` holds, ready for
    ``model.load_state_dict``; one-line error when a layer's expert count differs."""
    out = dict(full)
    local = model.state_dict()
    for key, (first, total) in expert_shards(model).items():
        if key not in full:
            raise ScaletrainError(f"checkpoint has no expert tensor {key}")
        t = full[key]
        if t.shape[0] != total:
            raise ScaletrainError(f"{key}: the checkpoint has {t.shape[0]} experts, the model {total} (moe.num_experts)")
        out[key] = t[first:first + local[key].shape[0]]
    return out
