"""A checkpoint resumed at another layout: another world size, ZeRO stage or engine.

A checkpoint records the layout it was written with (``engine.json``: backend, ZeRO stage, world size,
``moe.ep_size``, precision). At the same layout the engine's own files are loaded as they are (bit-identical
resume). At another one, :func:`read_whole` makes the checkpoint's state whole, by parameter name:

* the model: ``model.safetensors``, or DeepSpeed's files consolidated (``deepspeed_files.consolidated_weights``:
  ZeRO shards through DeepSpeed's ``zero_to_fp32``);
* fp32 master weights and AdamW's moments and step count: from torch's optimizer state dict where the
  optimizer held whole parameters (Accelerate DDP's ``optimizer.bin``, DeepSpeed ZeRO-0's
  ``mp_rank_00_model_states.pt``), or from every rank's ZeRO partition file (ZeRO-1/2: each parameter's
  fragments located by DeepSpeed's own ``param_slice_mappings``; ZeRO-3: each parameter's equal slices,
  in ``param_shapes`` order, as ``zero_to_fp32`` lays them out);

and ``Engine.load_whole`` hands it to the new layout: torch's optimizer state on whole parameters, or
DeepSpeed's public tensor-fragment API (``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state``)
that cuts each whole tensor to the rank's ZeRO-1/2/3 partition.

Why not DeepSpeed's universal checkpoint (``ds_to_universal.py`` + ``load_universal``): its non-universal
load refuses any change of the data-parallel size with optimizer state ("Automatic adjustment of ZeRO's
optimizer state partitioning with a new world size is not currently supported"); the universal path needs an
offline conversion and ``universal_checkpoint_info`` that only Megatron writes, and Accelerate's DDP has no
such path at all. The whole state here is what every layout can take, for either engine, and it is small
for the models scaletrain trains (three fp32 copies of the parameters in host memory during the load).

What is not carried across layouts: per-rank RNG streams (re-derived from ``train.seed``, the step and the
new rank: ``manager.py``) and fp16's dynamic loss scale under DeepSpeed (it restarts at its initial scale).
Expert parallelism: where the optimizer holds whole parameters with the same engine on both sides
(ZeRO-0, Accelerate DDP) a change of world size and ``moe.ep_size`` loads through the engine's files and the
expert shard files (``experts.py``); any other change goes through the whole state too: every EP rank's
experts joined (their shard files, or DeepSpeed ZeRO-1/2's expert partitions, one set per expert-data-parallel
group), then cut to the new rank's experts (``scaletrain.parallel.state``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from scaletrain.checkpoint.deepspeed_files import consolidated_weights, model_states_file
from scaletrain.checkpoint.experts import joined_shards, merge_expert_shards
from scaletrain.checkpoint.layout import MODEL_FILE, OPTIMIZER_FILE, say_layout_change
from scaletrain.engine.deepspeed_internals import (whole_shape, zero3_flat_groups, zero3_param_shapes,
                                                   zero12_partition)
from scaletrain.engine import WholeState
from scaletrain.engine.engine import MOMENTS
from scaletrain.parallel.state import expert_layout, join_parts
from scaletrain.errors import ScaletrainError
from scaletrain.safeload import safe_torch_load



def _zero_files(ckpt: Path) -> list[Path]:
    files = sorted(ckpt.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"),
                   key=lambda f: int(f.name.split("zero_pp_rank_")[1].split("_")[0]))
    return files


def read_whole(ckpt: Path, saved: dict, names: list[str], shapes: dict[str, torch.Size], experts: dict | None = None):
    """``(model, WholeState)`` of checkpoint ``ckpt`` (written at layout ``saved``): the whole fp32 module
    state dict and the optimizer's state by parameter name. ``names``: the trainable parameters in the
    optimizer's order (the same function builds it at every layout); ``shapes``: their whole shapes;
    ``experts``: the expert parameters' layout at the checkpoint's ``moe.ep_size``
    (``scaletrain.parallel.state.expert_layout``): each EP rank's part, joined here into the whole tensor."""
    ckpt, experts = Path(ckpt), experts or {}
    model = merge_expert_shards(ckpt, _model_weights(ckpt))  # every EP rank's experts (their shard files)
    missing = [n for n in names if n not in model]
    if missing:
        raise ScaletrainError(f"{ckpt}: its model lacks {missing[:5]} of this run's parameters; resume with the "
                              "model the checkpoint was trained with")
    stage = int(saved.get("zero_stage") or 0)
    if stage == 0:
        masters, moments, step = {}, *_torch_optimizer_state(ckpt, names)
        if int(saved.get("ep_size") or 1) > 1:  # the experts' moments: every EP rank's shard file
            for name, (_, state) in joined_shards(ckpt, int(saved["ep_size"])).items():
                moments[name] = {k: v.float() for k, v in state.items() if k in MOMENTS}
    elif stage in (1, 2):
        masters, moments, step = _zero12_state(ckpt, names, shapes, experts)
    else:
        masters, moments, step = _zero3_state(ckpt, names, shapes)
    return model, WholeState(masters, moments, step)


def _model_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The whole fp32 module state dict (``model.safetensors``, or DeepSpeed's files consolidated); the
    checkpoint's files were checked against its ``index.json`` when it was chosen for the resume."""
    if (ckpt / MODEL_FILE).is_file():
        from safetensors.torch import load_file

        return {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(ckpt / MODEL_FILE)).items()}
    sd = consolidated_weights(ckpt)
    if sd is None:
        raise ScaletrainError(f"{ckpt}: no model weights in it ({MODEL_FILE} or DeepSpeed's files); use an earlier "
                              "checkpoint")
    return sd


def _torch_optimizer_state(ckpt: Path, names: list[str]):
    """torch's optimizer state dict on whole parameters (``optimizer.bin``, or DeepSpeed ZeRO-0's model states):
    its parameters are numbered in the optimizer's order, which ``names`` gives."""
    if (ckpt / OPTIMIZER_FILE).is_file():
        f = ckpt / OPTIMIZER_FILE
        sd = safe_torch_load(f)
    else:
        f = model_states_file(ckpt)
        if f is None:
            raise ScaletrainError(f"{ckpt}: neither {OPTIMIZER_FILE} nor DeepSpeed's model states; not a checkpoint "
                                  "this scaletrain writes")
        sd = safe_torch_load(f).get("optimizer")
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ScaletrainError(f"{f}: no torch optimizer state in it (a ZeRO-0 16-bit checkpoint of DeepSpeed's "
                              "unfused optimizer?); resume it at the layout it was written with")
    order = [i for g in sd["param_groups"] for i in g["params"]]
    if len(order) != len(names):
        raise ScaletrainError(f"{f}: its optimizer holds {len(order)} parameters, this run's model {len(names)}; "
                              "resume with the model the checkpoint was trained with")
    moments, step = {}, None
    for idx, name in zip(order, names):
        st = sd["state"].get(idx, {})
        moments[name] = {k: st[k].detach().float().cpu() for k in MOMENTS if k in st}
        if "step" in st:
            step = int(st["step"])
    return moments, step


def _load_partitions(ckpt: Path, stage: int) -> list[dict]:
    files = _zero_files(ckpt)
    if not files:
        raise ScaletrainError(f"{ckpt}: a ZeRO-{stage} checkpoint without its zero_pp_rank_*_optim_states.pt files; "
                              "use an earlier checkpoint")
    parts = [safe_torch_load(f)["optimizer_state_dict"] for f in files]
    count = parts[0].get("partition_count")
    count = max(count) if isinstance(count, list) else count
    if count != len(parts):
        raise ScaletrainError(f"{ckpt}: {len(parts)} ZeRO partition files for a world of {count}; the checkpoint is "
                              "incomplete: use an earlier one")
    return parts


def _base_state(part: dict, key: str) -> dict:
    base = part.get(key)
    if not isinstance(base, dict) or "state" not in base:  # DeepSpeed's elastic layout (a list per group)
        raise ScaletrainError("a ZeRO checkpoint in DeepSpeed's elastic layout (zero_optimization.elastic_checkpoint)"
                              "; resume it at the layout it was written with")
    return base["state"]


def _zero12_state(ckpt: Path, names: list[str], shapes: dict, experts: dict):
    """ZeRO-1/2: rank r's flat partition of group g holds, for each parameter in ``param_slice_mappings[g]``,
    the fragment ``[start, start + numel)``; the whole parameter is its fragments in rank order. Under
    expert parallelism (DeepSpeed's MoE path) an expert group is partitioned over each expert-data-parallel
    group instead: rank r's fragments belong to EP rank ``r % ep_size``'s experts, whose tensors are then
    joined over the EP ranks (``parallel.state.join_parts``)."""
    parts = _load_partitions(ckpt, 2)
    ep = len(next(iter(experts.values()))[1]) if experts else 1
    pieces: dict[str, dict[str, list]] = {n: {"fp32": [], **{k: [] for k in MOMENTS}} for n in names}
    local = {n: [{"fp32": [], **{k: [] for k in MOMENTS}} for _ in range(ep)] for n in experts}
    step = None
    for r, part in enumerate(parts):
        base = _base_state(part, "base_optimizer_state")
        mappings, fp32 = zero12_partition(part)
        for g, mapping in enumerate(mappings):
            flat = {"fp32": fp32[g], **{k: base[g][k] for k in MOMENTS}}
            if "step" in base[g]:
                step = int(base[g]["step"])
            for name, frag in mapping.items():
                if name not in pieces:
                    raise ScaletrainError(f"{ckpt}: its ZeRO partitions hold {name!r}, which this run's model has not"
                                          "; resume with the model the checkpoint was trained with")
                into = local[name][r % ep] if name in local else pieces[name]
                for k, t in flat.items():
                    into[k].append(t.narrow(0, frag.start, frag.numel))
    for name, (_, per_rank) in experts.items():  # each EP rank's part whole, then every EP rank's joined
        for k in pieces[name]:
            ranks = []
            for e, shape in enumerate(per_rank):
                ts = local[name][e][k]
                n = torch.Size(shape).numel()
                t = torch.cat(ts)[:n] if ts else torch.empty(0)
                if t.numel() != n:
                    raise ScaletrainError(f"{ckpt}: the ZeRO partitions hold {t.numel()} of {n} elements of {name} on "
                                          f"EP rank {e}; resume with the model the checkpoint was trained with")
                ranks.append(t.reshape(shape))
            pieces[name][k] = [join_parts(name, ranks).flatten()]
    return _joined(ckpt, pieces, shapes) + (step,)


def _zero3_state(ckpt: Path, names: list[str], shapes: dict):
    """ZeRO-3: every parameter is cut into ``ceil(numel / world)`` elements per rank, laid one after another in
    each rank's flat groups in the order of the model states' ``param_shapes`` (as ``zero_to_fp32`` reads them)."""
    parts = _load_partitions(ckpt, 3)
    world = len(parts)
    ms = safe_torch_load(ckpt / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    order = [(n, torch.Size(s)) for group in zero3_param_shapes(ms) for n, s in group.items()]
    flats = []
    step = None
    for part in parts:
        base = _base_state(part, "optimizer_state_dict")
        groups = sorted(base)
        for g in groups:
            if "step" in base[g]:
                step = int(base[g]["step"])
        flats.append({"fp32": torch.cat([t.flatten() for t in zero3_flat_groups(part)]),
                      **{k: torch.cat([base[g][k].flatten() for g in groups]) for k in MOMENTS}})
    pieces: dict[str, dict[str, list]] = {}
    offset = 0
    for name, shape in order:
        n = shape.numel()
        per = -(-n // world)
        pieces[name] = {k: [f[k].narrow(0, offset, per) for f in flats] for k in flats[0]}
        offset += per
    extra = sorted(set(pieces) - set(names))
    if extra:
        raise ScaletrainError(f"{ckpt}: its ZeRO partitions hold {extra[:5]}, which this run's model has not; resume "
                              "with the model the checkpoint was trained with")
    return _joined(ckpt, {n: pieces.get(n, {}) for n in names}, shapes) + (step,)


def _joined(ckpt: Path, pieces: dict, shapes: dict):
    masters, moments = {}, {}
    for name, kinds in pieces.items():
        shape = shapes[name]
        whole = {}
        for k, ts in kinds.items():
            t = torch.cat(ts) if ts else torch.empty(0)
            if t.numel() < shape.numel():
                raise ScaletrainError(f"{ckpt}: the ZeRO partitions hold {t.numel()} of {shape.numel()} elements of "
                                      f"{name}; resume with the model the checkpoint was trained with")
            whole[k] = t[: shape.numel()].reshape(shape).float().clone()
        masters[name] = whole.pop("fp32")
        moments[name] = whole
    return masters, moments


def resume_at_layout(engine, ckpt: Path, saved: dict) -> None:
    """Load ``ckpt`` (written at layout ``saved``, another than ``engine``'s) through the whole state; rank 0
    says once in the log what changed."""
    scale = engine.loss_scale()
    say_layout_change(engine, ckpt, saved, "through the whole state" + (
        "" if scale is None else f"; the fp16 loss scale restarts at {scale:g} (not carried): the first updates may "
        "be skipped as overflows while it comes down"))
    trainable = engine.trainable()
    experts = expert_layout(engine.module, int(saved.get("ep_size") or 1))
    shapes = {n: torch.Size(experts[n][0]) if n in experts else whole_shape(p) for n, p in trainable.items()}
    model, whole = read_whole(ckpt, saved, list(trainable), shapes, experts)
    engine.load_whole(model, whole)

