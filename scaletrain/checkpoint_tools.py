"""Export and average saved checkpoints (the library side of ``scaletrain export`` and ``average``).

:func:`export_checkpoint` consolidates any engine's checkpoint (ZeRO-3 shards included) into one
safetensors file that loads with ``safetensors`` + ``build_model`` alone; the resolved config and
languages ride in its metadata. :func:`average_checkpoints` writes a checkpoint directory
(model.safetensors, config.yaml, langs.json, trainer_state.json) that ``evaluate`` and ``translate``
accept.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import torch
import yaml

from scaletrain.checkpoint import TAG_RE, atomic_write_text, copy_vocab_files, load_model_weights, resolve_checkpoint
from scaletrain.errors import ScaletrainError
from scaletrain.fileio import default_mode

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 prints progress
        return load_model_weights(ckpt)


def _save_safetensors(sd: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    # contiguous, unshared copies: safetensors refuses tensors that share storage
    save_file({k: v.detach().contiguous().clone() for k, v in sd.items()}, str(tmp), metadata=metadata)
    default_mode(tmp)  # safetensors creates it 0600
    os.replace(tmp, path)


def export_checkpoint(ckpt: str | Path, out: str | Path, dtype: str = "fp32") -> Path:
    """Write the consolidated weights of ``ckpt`` to ``out`` (safetensors); returns the path.

    Config, languages and step ride in the metadata; a SentencePiece model is copied beside ``out``
    as ``<out stem>.<file>``. ``translate`` / ``evaluate --checkpoint out`` load the file directly
    (``scaletrain.checkpoint.load_exported``), for every architecture."""
    if dtype not in DTYPES:
        raise ScaletrainError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    ck = resolve_checkpoint(ckpt)
    sd = _weights(ck)
    dt = DTYPES[dtype]
    sd = {k: v.to(dt) if v.is_floating_point() else v for k, v in sd.items()}
    state = json.loads((ck / "trainer_state.json").read_text())
    meta = {
        "format": "pt", "scaletrain_config": (ck / "config.yaml").read_text(),
        "langs": (ck / "langs.json").read_text(), "step": str(state.get("step", "")), "dtype": dtype,
        "source": str(ck),
    }
    out = Path(out)
    vocab_meta = ck / "vocab.json"
    if vocab_meta.is_file():  # a SentencePiece model travels beside the file, recorded in its metadata
        info = json.loads(vocab_meta.read_text())
        name = f"{out.stem}.{info['file']}"
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ck / info["file"], out.parent / (name + ".tmp"))
        os.replace(out.parent / (name + ".tmp"), out.parent / name)
        meta["vocab"] = json.dumps({"kind": info["kind"], "file": name, "sha256": info["sha256"]})
    _save_safetensors(sd, out, meta)
    return out


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
        sd = _weights(p)
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
    _save_safetensors(avg, partial / "model.safetensors", {"format": "pt", "averaged_from": json.dumps([str(p) for p in paths])})
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
