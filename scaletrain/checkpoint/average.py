"""``scaletrain average``: the parameters of several checkpoints averaged into a new checkpoint.

:func:`average_checkpoints` writes a checkpoint directory (``model.safetensors``, ``config.yaml``,
``langs.json``, ``trainer_state.json`` naming its sources, the vocabulary files) that ``evaluate``,
``translate``, ``export`` and ``average`` itself accept; it is written under ``OUT.partial`` and renamed.
Sums are kept in float64; integer buffers must be equal in every checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import yaml

from scaletrain.checkpoint.inference import load_model_weights, resolve_checkpoint
from scaletrain.checkpoint.engine_state import save_safetensors
from scaletrain.checkpoint.manager import TAG_RE, copy_vocab_files
from scaletrain.errors import ScaletrainError
from scaletrain.fileio import atomic_write_text


def _model_section(ck: Path) -> dict:
    return (yaml.safe_load((ck / "config.yaml").read_text()) or {}).get("model", {})


def checkpoints_of_run(path: str | Path) -> list[Path]:
    """Complete checkpoints of a run dir (or its checkpoints/ dir), oldest first."""
    p = Path(path)
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    tags = sorted(
        (d for d in root.iterdir() if d.is_dir() and TAG_RE.match(d.name) and (d / "trainer_state.json").is_file()),
        key=lambda d: int(TAG_RE.match(d.name).group(1)),
    ) if root.is_dir() else []
    return tags


def average_checkpoints(ckpts: list[str | Path], out: str | Path, last: int = 0) -> Path:
    """Average the parameters of checkpoints into a new checkpoint directory ``out``.

    A single run directory with ``last=K`` averages its last K complete checkpoints.
    """
    paths: list[Path] = []
    for c in ckpts:
        p = Path(c)
        if last and not (p / "trainer_state.json").is_file():
            found = checkpoints_of_run(p)
            if not found:
                raise ScaletrainError(f"{p}: no complete checkpoints (step-N with trainer_state.json) under it")
            paths.extend(found)
        else:
            paths.append(resolve_checkpoint(p))
    if last:
        if len(paths) < last:
            raise ScaletrainError(f"--last {last}: only {len(paths)} checkpoint(s) found: {', '.join(map(str, paths))}")
        paths = paths[-last:]
    if not paths:
        raise ScaletrainError("average: give at least one checkpoint")
    ref_model, ref_langs = _model_section(paths[0]), json.loads((paths[0] / "langs.json").read_text())
    acc: dict[str, torch.Tensor] | None = None
    for p in paths:
        if _model_section(p) != ref_model:
            raise ScaletrainError(f"{p}: model config differs from {paths[0]}; only checkpoints of one model can be averaged")
        if json.loads((p / "langs.json").read_text()) != ref_langs:
            raise ScaletrainError(f"{p}: languages differ from {paths[0]} (langs.json)")
        sd = load_model_weights(p, quiet=True)
        if acc is None:
            acc = {k: v.double() if v.is_floating_point() else v.clone() for k, v in sd.items()}
            continue
        if sd.keys() != acc.keys():
            raise ScaletrainError(f"{p}: parameter names differ from {paths[0]}")
        for k, v in sd.items():
            if v.is_floating_point():
                acc[k] += v.double()
            elif not torch.equal(v, acc[k]):
                raise ScaletrainError(f"{p}: integer buffer {k} differs between checkpoints; cannot average")
    avg = {k: (v / len(paths)).float() if v.is_floating_point() else v for k, v in acc.items()}
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    last_ck = paths[-1]
    save_safetensors(avg, partial / "model.safetensors", {"format": "pt", "averaged_from": json.dumps([str(p) for p in paths])})
    state = json.loads((last_ck / "trainer_state.json").read_text())
    state["averaged_from"] = [str(p) for p in paths]
    atomic_write_text(partial / "trainer_state.json", json.dumps(state, indent=2))
    shutil.copyfile(last_ck / "config.yaml", partial / "config.yaml")
    shutil.copyfile(last_ck / "langs.json", partial / "langs.json")
    copy_vocab_files(last_ck, partial)
    if out.exists():
        shutil.rmtree(out)
    os.replace(partial, out)
    return out
