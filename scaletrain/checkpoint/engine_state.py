"""What a checkpoint holds of the engine, and how it is read back: the one place that decides those files.

The engine hands its state over and takes it back (``Engine.state_dict``/``load_state_dict``, its
``schedule``, ``layout``); this module writes it into the checkpoint directory (``step-N.partial``, made and
renamed by ``manager.py``) and reads it back at resume:

* ``engine.json`` (rank 0): the layout the checkpoint was written with (backend, ZeRO stage, world size,
  ``moe.ep_size``, precision) and the LR schedule's position (the updates applied, ``optim.UpdateSchedule``).
* the model and optimizer: where the library keeps no files of its own (Accelerate's DDP), rank 0 writes
  ``model.safetensors`` (its module's state dict; tensors that are empty on rank 0, the owned MoCE experts of
  other ranks, are left out: their values are in the expert shards), ``optimizer.bin`` (torch's optimizer
  state dict) and, with fp16, ``scaler.pt`` (the GradScaler's): the names Accelerate's ``save_state`` used,
  so its checkpoints resume too. DeepSpeed partitions the optimizer (ZeRO) and keeps its own layout: its files
  are written by DeepSpeed (``Engine.save_native``) and read back through ``deepspeed_files.load_native``.
* expert shards under ``moe.ep_size > 1`` (``experts.py``): each EP rank's experts and their optimizer state.

A checkpoint written before ``engine.json`` existed keeps its schedule position where the library put it
(``scheduler.bin``, ``scheduler.pt``, DeepSpeed's ``lr_scheduler`` entry): :func:`saved_schedule` reads it.
Every file is read weights-only (``scaletrain.safeload``).

A resume at another layout (world size, ZeRO stage, engine, ``moe.ep_size``, precision): ``engine.json`` says
the layout a checkpoint was written with (``layout.py``, which also names the files above and logs what changed). Where the optimizer held whole parameters
on both sides with the same library (ZeRO-0, Accelerate DDP) the files above load as they are at any world
size, expert shards resharded for another ``moe.ep_size`` (``experts.py``); any other change goes through
the whole state of ``reshard.py`` (ZeRO-1/2/3 partitions joined, handed to the new layout).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from scaletrain.checkpoint.deepspeed_files import load_native, model_states_file
from scaletrain.checkpoint.experts import expert_checkpoint_load, save_expert_shard
from scaletrain.checkpoint.layout import (ENGINE_FILE, LAYOUT_KEYS, MODEL_FILE, OPTIMIZER_FILE, SCALER_FILE,
                                          native_path_holds, saved_layout, say_layout_change)
from scaletrain.checkpoint.reshard import resume_at_layout
from scaletrain.errors import ScaletrainError
from scaletrain.fileio import atomic_write_text, default_mode
from scaletrain.parallel.state import owned_params
from scaletrain.safeload import safe_torch_load



def save_safetensors(sd: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write ``sd`` to ``path`` under a temporary name and rename it (mode as ``open()`` gives): a
    checkpoint's ``model.safetensors``, an averaged one's, an exported file."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:  # a failure (out of memory, a full disk) removes the temporary file and leaves ``path`` as it was
        # contiguous, unshared copies: safetensors refuses tensors that share storage
        save_file({k: v.detach().contiguous().clone() for k, v in sd.items()}, str(tmp), metadata=metadata)
        default_mode(tmp)  # safetensors creates it 0600
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_engine_state(engine, ckpt: Path) -> None:
    """Write ``engine``'s state into the checkpoint directory ``ckpt`` (collective: every rank calls it)."""
    ckpt = Path(ckpt)
    ckpt.mkdir(parents=True, exist_ok=True)  # every rank writes into it (expert shards, DeepSpeed's partitions)
    if engine.native_checkpoint:
        engine.save_native(ckpt)  # DeepSpeed: module from rank 0, each rank's ZeRO optimizer partition
    elif engine.is_main:
        state = engine.state_dict()
        model = {k: v for k, v in state.pop("model").items() if v.numel() > 0}  # empty: other ranks' experts
        save_safetensors(model, ckpt / MODEL_FILE, {"format": "pt"})
        torch.save(state.pop("optimizer"), ckpt / OPTIMIZER_FILE)
        if state.get("scaler") is not None:
            torch.save(state["scaler"], ckpt / SCALER_FILE)
    if engine.parallel.ep_size > 1:
        save_expert_shard(ckpt, engine.module, engine.optimizer, engine.parallel)
    if engine.is_main:
        record = {"format": 1, **engine.layout(), "schedule": engine.schedule.state_dict()}
        atomic_write_text(ckpt / ENGINE_FILE, json.dumps(record, indent=1))


def load_engine_state(engine, ckpt: Path) -> None:
    """Put ``engine`` back in the state ``ckpt`` holds (every rank). Expert shards: this rank's, or every
    shard resharded for another ``moe.ep_size`` where the engine keeps whole parameters (not ZeRO-1/2)."""
    ckpt = Path(ckpt)
    record = saved_layout(ckpt)
    if record is not None:  # another layout: through the whole state (reshard.py), which says what changed
        saved = {k: record.get(k) for k in LAYOUT_KEYS}
        if not native_path_holds(saved, engine.layout()):
            resume_at_layout(engine, ckpt, saved)
            engine.schedule.load_state_dict(record["schedule"])
            return
        say_layout_change(engine, ckpt, saved, "the engine's own files, resharded where needed")
    _check_written_by(engine, ckpt)
    schedule = saved_schedule(ckpt)
    if schedule is None:
        raise ScaletrainError(f"{ckpt}: no LR schedule position ({ENGINE_FILE} missing); use an earlier checkpoint")
    reshard = not engine.native_checkpoint or engine.zero_stage == 0
    with expert_checkpoint_load(ckpt, engine.module, engine.optimizer, engine.parallel, reshard=reshard):
        if engine.native_checkpoint:
            load_native(engine, ckpt)
        else:
            engine.load_state_dict(_read_state(engine, ckpt), strict=_strict_model_keys(engine, ckpt))
    engine.schedule.load_state_dict(schedule)


def _check_written_by(engine, ckpt: Path) -> None:
    """One line where the checkpoint's files are another library's (resume with the engine that wrote it)."""
    if engine.native_checkpoint and model_states_file(ckpt) is None:
        raise ScaletrainError(f"{ckpt}: not a DeepSpeed checkpoint (no mp_rank_00_model_states.pt); it was written by "
                              "another engine (Accelerate DDP); resume it with the engine that wrote it")
    if not engine.native_checkpoint and not (ckpt / OPTIMIZER_FILE).is_file():
        raise ScaletrainError(f"{ckpt}: not an Accelerate DDP checkpoint (no {OPTIMIZER_FILE}); it was written by "
                              "another engine (DeepSpeed); resume it with the engine that wrote it")


def _read_state(engine, ckpt: Path) -> dict:
    from safetensors.torch import load_file

    try:
        model = load_file(str(ckpt / MODEL_FILE))  # on the host; load_state_dict copies onto the device
    except Exception as e:  # safetensors holds no code; a bad header or a short file lands here
        raise ScaletrainError(f"{ckpt / MODEL_FILE}: unreadable safetensors file, truncated or corrupt ({e}); "
                              "use an earlier checkpoint") from None
    state = {"model": model, "optimizer": safe_torch_load(ckpt / OPTIMIZER_FILE)}
    if (ckpt / SCALER_FILE).is_file():
        state["scaler"] = safe_torch_load(ckpt / SCALER_FILE)
    return state


def _strict_model_keys(engine, ckpt: Path) -> bool:
    """``model.safetensors`` leaves out the experts that are empty on rank 0 (owned MoCE experts of other
    ranks); those, and only those, may be missing there, so the load is not strict then. Their values come
    from the expert shard files."""
    owned = owned_params(engine.module)
    if not owned:
        return True
    from safetensors import safe_open

    with safe_open(str(ckpt / MODEL_FILE), framework="pt") as f:
        have = set(f.keys())
    missing = set(engine.module.state_dict()) - have - set(owned)
    if missing:
        raise ScaletrainError(f"{ckpt / MODEL_FILE} lacks {sorted(missing)[:5]}; use an earlier checkpoint")
    return False


def saved_schedule(ckpt: Path) -> dict | None:
    """The LR schedule's state in ``ckpt``: ``engine.json``'s, else (checkpoints written before it) the
    ``LambdaLR`` state Accelerate (``scheduler.bin``), the Accelerate DeepSpeed engine (``scheduler.pt``) or
    DeepSpeed (its model states' ``lr_scheduler``) saved; None where there is none."""
    record = saved_layout(ckpt)
    if record is not None:
        return record["schedule"]
    ckpt = Path(ckpt)
    for name in ("scheduler.bin", "scheduler.pt"):
        if (ckpt / name).is_file():
            return safe_torch_load(ckpt / name)
    states = model_states_file(ckpt)
    if states is not None:
        sched = safe_torch_load(states).get("lr_scheduler")
        return sched if isinstance(sched, dict) and "last_epoch" in sched else None
    return None
