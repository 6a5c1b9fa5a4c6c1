"""Expert shards <-> the full state dict, in memory: consolidation for inference and export, and the cut
of a full state dict to the experts a rank holds (resharding for another ep_size). The full state dict of
an ep_size=P model is exactly the state dict of the same model at ep_size=1 (each layer's experts stacked
in global order along dim 0). The files (expert shards in checkpoints) are ``scaletrain.checkpoint.experts``.

Two kinds of expert tensors, both marked ``p.expert = True``:

* stacked (MoE-FFN, ``scaletrain.models.moe.Experts``): the module says which slice of the layer's
  experts it holds (``first_expert``, ``num_experts``; the local count is dim 0 of the parameter).
  Every EP rank holds the same number, so the gather is one ``all_gather`` per tensor over the EP group.
* owned (MoCE's conv experts, ``scaletrain.models.moce_ep``): one tensor per expert, whole on its
  owner (``p.ep_owner``) and empty on the other ranks of the EP group; ``p.full_shape`` and
  ``p.owner_rule`` (expert costs, index) give its shape and its owner at any ep_size. The gather is
  a broadcast from the owner. The shapes differ between the ranks of an EP group, so engines that
  assume equal shapes everywhere (DeepSpeed's start-up broadcast of rank 0's parameters, loading
  rank 0's module file on every rank) run inside ``rank0_layout``.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.errors import ScaletrainError
from scaletrain.parallel.context import ParallelContext, balanced_owners


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


def owned_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """The owned expert tensors (MoCE's conv experts under expert parallelism), by name."""
    return {n: p for n, p in model.named_parameters() if getattr(p, "ep_owner", None) is not None}


def _owner_at(p: nn.Parameter, ep_size: int) -> int:
    sizes, j = p.owner_rule
    return balanced_owners(sizes, ep_size)[j]


def shape_at_rank0(name: str, p: nn.Parameter, shards: dict, ep_size: int) -> tuple[int, ...]:
    """The shape expert parameter ``name`` has on EP rank 0 of a model at ``ep_size``."""
    if getattr(p, "ep_owner", None) is not None:
        return tuple(p.full_shape) if _owner_at(p, ep_size) == 0 else (0,)
    return (shards[name][1] // ep_size,) + tuple(p.shape[1:])


def local_part(name: str, p: nn.Parameter, t: torch.Tensor, shards: dict) -> torch.Tensor:
    """This rank's part of ``t``, the full tensor (every expert) of expert parameter ``name``."""
    if getattr(p, "ep_owner", None) is not None:
        return t if p.numel() else t.new_empty(0)
    first = shards[name][0]
    return t[first:first + p.shape[0]]


def join_parts(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every EP rank's part: owned (empty on all ranks but one) -> the owner's;
    stacked -> concatenated in expert order."""
    if any(t.numel() == 0 for t in parts):
        whole = [t for t in parts if t.numel()]
        if len(whole) != 1:
            raise ScaletrainError(f"expert tensor {name}: {len(whole)} ranks hold it whole, expected one owner")
        return whole[0]
    return torch.cat(parts)


@contextlib.contextmanager
def placeholders(params: dict[str, nn.Parameter], shapes: dict[str, tuple[int, ...]]):
    """Each parameter temporarily holds zeros of ``shapes[name]`` (the same tensor object, so an optimizer
    keeps its handle); on exit it gets its own values back, on the device and in the dtype the engine
    gave the placeholder."""
    mine = {n: p.data for n, p in params.items()}
    for n, p in params.items():
        p.data = torch.zeros(shapes[n], dtype=p.dtype, device=p.device)
    try:
        yield
    finally:
        for n, p in params.items():
            p.data = mine[n].to(device=p.device, dtype=p.dtype)


def rank0_layout(model: nn.Module, ep_size: int):
    """Context: every owned expert tensor shaped as on EP rank 0 (whole where rank 0 owns the expert,
    else empty), so that every rank's parameters have the same shapes while an engine broadcasts rank
    0's parameters or loads rank 0's module file; each rank's own tensors come back on exit (their
    values: this rank's own, re-read from its expert shard by ``expert_checkpoint_load``). Not for
    DeepSpeed's ZeRO-1/2 MoE path, which flattens the parameters it is given
    (``scaletrain.engine.experts.expert_setup``)."""
    owned = owned_params(model)
    return placeholders(owned, {n: shape_at_rank0(n, p, {}, ep_size) for n, p in owned.items()})


def gather_expert(p: nn.Parameter, t: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The full tensor (every expert of the layer) of ``t``, this rank's value of expert parameter ``p``
    (its data or its gradient): stacked -> all EP ranks' slices concatenated; owned -> broadcast from
    the owner. Collective over the EP group (ep_size > 1)."""
    t = t.detach().contiguous()
    if getattr(p, "ep_owner", None) is not None:
        out = t.clone() if ctx.ep_rank == p.ep_owner else t.new_empty(p.full_shape)
        dist.broadcast(out, dist.get_global_rank(ctx.ep_group, p.ep_owner), group=ctx.ep_group)
        return out
    parts = [torch.empty_like(t) for _ in range(ctx.ep_size)]
    dist.all_gather(parts, t, group=ctx.ep_group)
    return torch.cat(parts, 0)


def expert_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """The expert parameters (``p.expert = True``) of ``model``, by name."""
    return {n: p for n, p in model.named_parameters() if getattr(p, "expert", False)}


def consolidate_state_dict(model: nn.Module, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """The full state dict (every expert of every layer) on every rank of the EP group; collective
    over the EP group when ep_size > 1 (every rank, same order)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if ctx.ep_size == 1:
        return sd
    for key, p in sorted(expert_params(model).items()):
        sd[key] = gather_expert(p, sd[key], ctx)
    return sd


def shard_state_dict(full: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``full`` (an ep_size=1 or consolidated state dict) cut to the experts ``model`` holds, ready for
    ``model.load_state_dict``; one-line error when a layer's expert count differs."""
    out = dict(full)
    local = model.state_dict()
    shards = expert_shards(model)
    for key, p in owned_params(model).items():
        if key not in full:
            raise ScaletrainError(f"checkpoint has no expert tensor {key}")
        if tuple(full[key].shape) != tuple(p.full_shape):
            raise ScaletrainError(f"{key}: shape {tuple(full[key].shape)} in the checkpoint, the model's expert "
                                  f"is {tuple(p.full_shape)} (model.conv.kernels or model dimensions changed?)")
        out[key] = local_part(key, p, full[key], shards)
    for key, (first, total) in shards.items():
        if key not in full:
            raise ScaletrainError(f"checkpoint has no expert tensor {key}")
        t = full[key]
        if t.shape[0] != total:
            raise ScaletrainError(f"{key}: the checkpoint has {t.shape[0]} experts, the model {total} (moe.num_experts)")
        out[key] = t[first:first + local[key].shape[0]]
    return out


def expert_layout(model: nn.Module, ep_size: int) -> dict[str, tuple[tuple[int, ...], list[tuple[int, ...]]]]:
    """Expert parameter name -> (its full shape, its shape on each EP rank of a model at ``ep_size``): what a
    checkpoint written at another ``moe.ep_size`` held where (``scaletrain.checkpoint.reshard``)."""
    shards, out = expert_shards(model), {}
    for name, p in expert_params(model).items():
        if getattr(p, "ep_owner", None) is not None:
            full = tuple(p.full_shape)
            owner = _owner_at(p, ep_size)
            out[name] = (full, [full if e == owner else (0,) for e in range(ep_size)])
        else:
            total, rest = shards[name][1], tuple(p.shape[1:])
            out[name] = ((total, *rest), [(total // ep_size, *rest)] * ep_size)
    return out
