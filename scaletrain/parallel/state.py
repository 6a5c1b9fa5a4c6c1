"""Expert shards <-> the full state dict: consolidation for export / inference and resharding for a
resume with another ep_size. The full state dict of an ep_size=P model is exactly the state dict of
the same model at ep_size=1 (each layer's experts stacked in global order along dim 0).

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

Checkpoints under ep_size > 1: the engines' own files (DeepSpeed's mp_rank_00, Accelerate's
model.safetensors / optimizer.bin) come from rank 0 and hold its experts only. Each EP rank (the first
of its EDP group) also writes ``expert_shard_epRRR_of_PPP.pt``: its expert parameters and their
optimizer state. Resume reloads a rank's shard over what the engine loaded, or reshards for another
ep_size (``expert_checkpoint_load``); ``merge_expert_shards`` stacks the shards into the ep_size=1 state
dict for export, evaluate and translate.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.errors import ScaletrainError
from scaletrain.fileio import replace_synced, temp_path
from scaletrain.parallel.context import ParallelContext, balanced_owners
from scaletrain.safeload import safe_torch_load


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


def _shape_at_rank0(name: str, p: nn.Parameter, shards: dict, ep_size: int) -> tuple[int, ...]:
    """The shape expert parameter ``name`` has on EP rank 0 of a model at ``ep_size``."""
    if getattr(p, "ep_owner", None) is not None:
        return tuple(p.full_shape) if _owner_at(p, ep_size) == 0 else (0,)
    return (shards[name][1] // ep_size,) + tuple(p.shape[1:])


def _local_part(name: str, p: nn.Parameter, t: torch.Tensor, shards: dict) -> torch.Tensor:
    """This rank's part of ``t``, the full tensor (every expert) of expert parameter ``name``."""
    if getattr(p, "ep_owner", None) is not None:
        return t if p.numel() else t.new_empty(0)
    first = shards[name][0]
    return t[first:first + p.shape[0]]


def _join(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
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
    return placeholders(owned, {n: _shape_at_rank0(n, p, {}, ep_size) for n, p in owned.items()})


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


def consolidate_state_dict(model: nn.Module, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """The full state dict (every expert of every layer) on every rank of the EP group; collective
    over the EP group when ep_size > 1 (every rank, same order)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if ctx.ep_size == 1:
        return sd
    for key, p in sorted(_expert_params(model).items()):
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
        out[key] = _local_part(key, p, full[key], shards)
    for key, (first, total) in shards.items():
        if key not in full:
            raise ScaletrainError(f"checkpoint has no expert tensor {key}")
        t = full[key]
        if t.shape[0] != total:
            raise ScaletrainError(f"{key}: the checkpoint has {t.shape[0]} experts, the model {total} (moe.num_experts)")
        out[key] = t[first:first + local[key].shape[0]]
    return out


# ---------------------------------------------------------------------------------------
# expert shards in checkpoints
# ---------------------------------------------------------------------------------------
SHARD_GLOB = "expert_shard_ep*.pt"


def shard_file(ckpt_dir: Path, ep_rank: int, ep_size: int) -> Path:
    return Path(ckpt_dir) / f"expert_shard_ep{ep_rank:03d}_of_{ep_size:03d}.pt"


def save_expert_shard(ckpt_dir: Path, model: nn.Module, optimizer, ctx: ParallelContext) -> None:
    """Under ep_size > 1, the first rank of each EDP group writes its experts (parameters and their
    optimizer state: Adam's moments and step) to ``expert_shard_epRRR_of_PPP.pt``; the engine's own
    files hold rank 0's experts only. Written under a temporary name, then renamed."""
    if ctx.ep_size == 1 or ctx.edp_rank != 0:
        return
    named = {n: p for n, p in model.named_parameters() if getattr(p, "expert", False)}
    state = getattr(optimizer, "state", {}) if optimizer is not None else {}
    optim = {n: {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in state[p].items()}
             for n, p in named.items() if p in state}
    path = shard_file(ckpt_dir, ctx.ep_rank, ctx.ep_size)
    tmp = temp_path(path)
    torch.save({"ep_size": ctx.ep_size, "ep_rank": ctx.ep_rank,
                "params": {n: p.detach().cpu().clone() for n, p in named.items()}, "optim": optim}, tmp)
    replace_synced(tmp, path)


def saved_ep_size(ckpt_dir: Path) -> int:
    """The moe.ep_size a checkpoint was written with (1 when it has no expert shard files)."""
    files = sorted(Path(ckpt_dir).glob(SHARD_GLOB))
    return int(files[0].stem.rsplit("_", 1)[1]) if files else 1


def check_ep_size(ckpt_dir: Path, ep_size: int, has_experts: bool, why: str = "") -> None:
    """One-line error when a resume's moe.ep_size differs from the checkpoint's and the engine cannot
    reshard (``why``: the engine's reason)."""
    saved = saved_ep_size(ckpt_dir)
    if has_experts and saved != ep_size:
        raise ScaletrainError(
            f"{ckpt_dir} was written with moe.ep_size={saved} but this run has moe.ep_size={ep_size}{why}; resume "
            f"with moe.ep_size={saved}, or export it (scaletrain export consolidates the experts) and start a new run")


def _expert_params(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if getattr(p, "expert", False)}


@contextlib.contextmanager
def expert_checkpoint_load(ckpt_dir: Path, model: nn.Module, optimizer, ctx: ParallelContext,
                           reshard: bool = True):
    """Around an engine's checkpoint load (collective-free). The engine's files hold rank 0's experts
    (and, for the optimizer, their state) at the layout the checkpoint was written with: while the
    engine loads, every expert parameter has the shape it had on rank 0 then (``placeholders``);
    afterwards this rank's experts and their optimizer state come from the expert shard files.

    Another moe.ep_size than the checkpoint's (same world size): the full tensors (the engine's own
    at saved ep_size 1, else every shard file joined, optimizer moments too) are cut to this rank's
    experts (``reshard``; False: one-line error naming both sizes)."""
    ckpt_dir = Path(ckpt_dir)
    saved, named, shards = saved_ep_size(ckpt_dir), _expert_params(model), expert_shards(model)
    if not named or (saved == ctx.ep_size == 1):
        yield
        return
    if saved != ctx.ep_size and not reshard:
        check_ep_size(ckpt_dir, ctx.ep_size, True, " (DeepSpeed ZeRO-1/2 cannot reshard experts)")
    with placeholders(named, {n: _shape_at_rank0(n, p, shards, saved) for n, p in named.items()}):
        yield
        loaded = {n: (p.data, dict(optimizer.state.get(p, {})) if optimizer is not None else {})
                  for n, p in named.items()}
    if saved == ctx.ep_size:
        _load_own_shard(ckpt_dir, named, optimizer, ctx)
        return
    full = loaded if saved == 1 else _joined_shards(ckpt_dir, saved)
    with torch.no_grad():
        for n, p in named.items():
            t, state = full[n]
            p.copy_(_local_part(n, p, t, shards))
            if optimizer is not None and state:
                optimizer.state[p] = {k: _local_part(n, p, v, shards).clone().to(p.device)
                                      if torch.is_tensor(v) and v.dim() else v for k, v in state.items()}


def _joined_shards(ckpt_dir: Path, saved: int) -> dict[str, tuple[torch.Tensor, dict]]:
    """name -> (the full tensor: every expert of the layer, its optimizer state) from all shard files."""
    files = [shard_file(ckpt_dir, r, saved) for r in range(saved)]
    if not all(f.is_file() for f in files):
        raise ScaletrainError(f"{ckpt_dir}: expert shard files missing for moe.ep_size={saved}; use an earlier checkpoint")
    sh = [safe_torch_load(f) for f in files]
    out = {}
    for n in sh[0]["params"]:
        parts = [s["params"][n] for s in sh]
        optim = {}
        if all(n in s["optim"] for s in sh):
            for k, v in sh[0]["optim"][n].items():
                optim[k] = _join(n, [s["optim"][n][k] for s in sh]) if torch.is_tensor(v) and v.dim() else v
        out[n] = (_join(n, parts), optim)
    return out


@torch.no_grad()
def _load_own_shard(ckpt_dir: Path, named: dict, optimizer, ctx: ParallelContext) -> None:
    """This rank's experts and their optimizer state from its shard file (same ep_size as saved)."""
    path = shard_file(ckpt_dir, ctx.ep_rank, ctx.ep_size)
    if not path.is_file():
        raise ScaletrainError(f"{path} missing: the checkpoint lacks this rank's experts; use an earlier checkpoint")
    sh = safe_torch_load(path)
    if set(sh["params"]) != set(named):
        raise ScaletrainError(f"{path}: expert tensors do not match the model (moe.* settings changed?)")
    for n, p in named.items():
        p.copy_(sh["params"][n])
        if optimizer is not None and n in sh["optim"]:
            optimizer.state[p] = {k: (v.to(p.device) if torch.is_tensor(v) and v.dim() else v)
                                  for k, v in sh["optim"][n].items()}


def merge_expert_shards(ckpt_dir: Path, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` (an engine's model weights, which hold rank 0's experts) with every expert tensor
    replaced by all EP ranks' shards joined (stacked in global expert order; owned: the owner's): the
    ep_size=1 state dict.
    Unchanged for a checkpoint without shard files."""
    files = sorted(Path(ckpt_dir).glob(SHARD_GLOB))
    if not files:
        return sd
    ep = saved_ep_size(ckpt_dir)
    if len(files) != ep:
        raise ScaletrainError(f"{ckpt_dir}: {len(files)} expert shard files for moe.ep_size={ep}; the checkpoint "
                              "is incomplete, use an earlier one")
    shards = [safe_torch_load(f)["params"] for f in files]
    out = dict(sd)
    for key in shards[0]:
        out[key] = _join(key, [s[key] for s in shards]).to(sd[key].dtype if key in sd else torch.float32)
    return out
