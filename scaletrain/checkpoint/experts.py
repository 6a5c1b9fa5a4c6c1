"""Expert shards in checkpoints: the files that hold what the engine's own files cannot.

Under ``moe.ep_size > 1`` the engine's own files (DeepSpeed's ``mp_rank_00``, or ``model.safetensors`` /
``optimizer.bin``) come from rank 0 and hold its experts only. Each EP rank (the first of its
expert-data-parallel group) also writes ``expert_shard_epRRR_of_PPP.pt``: its expert parameters and their
optimizer state (:func:`save_expert_shard`). Resume reloads a rank's shard over what the engine loaded, or
reshards for another ep_size (:func:`expert_checkpoint_load`); :func:`merge_expert_shards` stacks the shards
into the ep_size=1 state dict for export, evaluate and translate. The in-memory side (gathering, cutting a
full state dict to a rank's experts, placeholders of rank 0's shapes) is ``scaletrain.parallel.state``.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from scaletrain.errors import ScaletrainError
from scaletrain.fileio import replace_synced, temp_path
from scaletrain.parallel import ParallelContext
from scaletrain.parallel.state import (expert_params, expert_shards, join_parts, local_part, placeholders,
                                       shape_at_rank0)
from scaletrain.safeload import safe_torch_load

SHARD_GLOB = "expert_shard_ep*.pt"


def shard_file(ckpt_dir: Path, ep_rank: int, ep_size: int) -> Path:
    return Path(ckpt_dir) / f"expert_shard_ep{ep_rank:03d}_of_{ep_size:03d}.pt"


def save_expert_shard(ckpt_dir: Path, model: nn.Module, optimizer, ctx: ParallelContext) -> None:
    """Under ep_size > 1, the first rank of each EDP group writes its experts (parameters and their
    optimizer state: Adam's moments and step) to ``expert_shard_epRRR_of_PPP.pt``; the engine's own
    files hold rank 0's experts only. Written under a temporary name, then renamed."""
    if ctx.ep_size == 1 or ctx.edp_rank != 0:
        return
    named = expert_params(model)
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
    saved, named, shards = saved_ep_size(ckpt_dir), expert_params(model), expert_shards(model)
    if not named or (saved == ctx.ep_size == 1):
        yield
        return
    if saved != ctx.ep_size and not reshard:
        check_ep_size(ckpt_dir, ctx.ep_size, True, " (DeepSpeed ZeRO-1/2 cannot reshard experts)")
    with placeholders(named, {n: shape_at_rank0(n, p, shards, saved) for n, p in named.items()}):
        yield
        loaded = {n: (p.data, dict(optimizer.state.get(p, {})) if optimizer is not None else {})
                  for n, p in named.items()}
    if saved == ctx.ep_size:
        _load_own_shard(ckpt_dir, named, optimizer, ctx)
        return
    full = loaded if saved == 1 else joined_shards(ckpt_dir, saved)
    with torch.no_grad():
        for n, p in named.items():
            t, state = full[n]
            p.copy_(local_part(n, p, t, shards))
            if optimizer is not None and state:
                optimizer.state[p] = {k: local_part(n, p, v, shards).clone().to(p.device)
                                      if torch.is_tensor(v) and v.dim() else v for k, v in state.items()}


def joined_shards(ckpt_dir: Path, saved: int) -> dict[str, tuple[torch.Tensor, dict]]:
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
                optim[k] = join_parts(n, [s["optim"][n][k] for s in sh]) if torch.is_tensor(v) and v.dim() else v
        out[n] = (join_parts(n, parts), optim)
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
        out[key] = join_parts(key, [s[key] for s in shards]).to(sd[key].dtype if key in sd else torch.float32)
    return out
