"""The layout record of a checkpoint and the names of the engine's files in it.

``engine.json`` (written by ``engine_state.py`` on rank 0) records the layout a checkpoint was written with
(``Engine.layout()``: backend, ZeRO stage, world size, ``moe.ep_size``, precision) and the LR schedule's
position. At resume the record is compared with this run's layout: the same layout, or one where only the
world size, ``moe.ep_size`` or precision change while the optimizer held whole parameters on both sides, loads
the engine's own files (``engine_state.py``); any other change goes through the whole state (``reshard.py``).
Either way rank 0 says once in the log what changed. The file names live here, beside the record, so that
both readers name the same files.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from scaletrain.errors import ScaletrainError

log = logging.getLogger("scaletrain")
ENGINE_FILE = "engine.json"  # layout and LR schedule position (rank 0)
LAYOUT_KEYS = ("backend", "zero_stage", "world_size", "ep_size", "precision")  # Engine.layout()
MODEL_FILE, OPTIMIZER_FILE, SCALER_FILE = "model.safetensors", "optimizer.bin", "scaler.pt"


def saved_layout(ckpt: Path) -> dict | None:
    """The ``engine.json`` record of ``ckpt`` (layout and schedule), None for a checkpoint without one."""
    f = Path(ckpt) / ENGINE_FILE
    if not f.is_file():
        return None
    try:
        record = json.loads(f.read_text())
        if not isinstance(record, dict) or not isinstance(record.get("schedule"), dict):
            raise ValueError("no schedule")
    except ValueError as e:
        raise ScaletrainError(f"{f}: unreadable engine record ({e}); use an earlier checkpoint") from None
    return record


def layout_changes(saved: dict, now: dict) -> list[str]:
    """The layout keys that differ between a checkpoint's ``engine.json`` record and this run's layout, as
    ``key a -> b`` (precision included)."""
    return [f"{k} {saved.get(k)} -> {now.get(k)}" for k in LAYOUT_KEYS if saved.get(k) != now.get(k)]


def say_layout_change(engine, ckpt: Path, saved: dict, how: str) -> None:
    """One log line on rank 0 naming every layout key that differs between ``saved`` and the engine's layout,
    and ``how`` the checkpoint loads (nothing when the layout is the same)."""
    changes = layout_changes(saved, engine.layout())
    if changes and engine.is_main:
        log.info("resume of %s at another layout: %s; %s", Path(ckpt).name, ", ".join(changes), how)


def native_path_holds(saved: dict, now: dict) -> bool:
    """The engine's own files load at layout ``now``: the same layout, or one where only the world size,
    ``moe.ep_size`` or precision differ while the optimizer held whole parameters on both sides (the same
    library at ZeRO-0 or Accelerate DDP: torch's optimizer state, expert shards resharded by ``experts.py``)."""
    if saved == {k: now.get(k) for k in saved}:
        return True
    return (saved.get("backend") == now.get("backend") and int(saved.get("zero_stage") or 0) == 0
            and int(now.get("zero_stage") or 0) == 0)
