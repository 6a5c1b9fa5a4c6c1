"""Loading a trained model for evaluate, translate, average and export, without building an engine.

:func:`load_for_inference` accepts a checkpoint directory, a run directory (its ``checkpoints/latest``)
or a ``.safetensors`` file written by ``scaletrain export`` (:func:`load_exported`), and returns the
model in eval mode with its config, vocabulary and trainer state. :func:`load_model_weights` gives the
full fp32 state dict of a checkpoint written by any engine: Accelerate's (and ``average``'s)
``model.safetensors``, DeepSpeed's files of any ZeRO stage (read by ``deepspeed_files.py``, which keeps
``deepspeed`` itself behind its functions), and under expert parallelism every EP rank's expert shard
joined (``experts.py``). Weight files are checked against the checkpoint's
``index.json`` first, and nothing is read with a loader that can run code.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from scaletrain.checkpoint.deepspeed_files import consolidated_weights
from scaletrain.checkpoint.experts import merge_expert_shards
from scaletrain.checkpoint.manager import VOCAB_FILE, latest_tag, verify_checkpoint
from scaletrain.config import from_dict
from scaletrain.errors import ScaletrainError
from scaletrain.models import build_model
from scaletrain.vocab import ByteVocab, SubwordVocab


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint dir, a run dir (uses checkpoints/latest) or a checkpoints dir."""
    p = Path(path)
    if (p / "trainer_state.json").is_file():
        return p
    for root in (p / "checkpoints", p):
        if (root / "latest").is_file():
            tag = latest_tag(root)
            return root / tag
    raise ScaletrainError(
        f"{p} is not a checkpoint: expected trainer_state.json in it, or a run directory with checkpoints/latest"
    )


def _is_weight_file(name: str) -> bool:
    return name.endswith(".safetensors") or name.startswith(("mp_rank_", "zero_pp_", "expert_shard_"))


def load_model_weights(ckpt: Path, quiet: bool = False) -> dict[str, torch.Tensor]:
    """The full fp32 model state dict of a checkpoint written by any engine, without building an engine.

    Accelerate DDP / exported / averaged: model.safetensors. DeepSpeed (any ZeRO stage, any precision):
    consolidated by :func:`scaletrain.checkpoint.deepspeed_files.consolidated_weights`; ``quiet`` drops what
    DeepSpeed's ``zero_to_fp32`` prints on stdout (``export`` and ``average``). With ``moe.ep_size > 1``
    every rank's experts are joined. The weight files are checked against the checkpoint's ``index.json``
    first.
    """
    ckpt = Path(ckpt)
    verify_checkpoint(ckpt, only=_is_weight_file)
    st = ckpt / "model.safetensors"
    if st.is_file():
        try:
            sd = load_file(str(st))
        except Exception as e:  # safetensors holds no code; a bad header or a short file lands here
            raise ScaletrainError(f"{st}: unreadable safetensors file, truncated or corrupt ({e}); "
                                  "use an earlier checkpoint") from None
        return merge_expert_shards(ckpt, sd)
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        sd = consolidated_weights(ckpt)
    if sd is not None:
        return merge_expert_shards(ckpt, sd)
    raise ScaletrainError(
        f"{ckpt}: no model weights found (model.safetensors, mp_rank_00_model_states.pt or ZeRO shards "
        "zero_pp_rank_*); is this a checkpoint directory (OUT/checkpoints/step-N)?"
    )


def load_checkpoint_vocab(ckpt: Path, langs: list[str]):
    """The vocabulary a checkpoint was trained with (ByteVocab unless ``vocab.json`` names a tokenizer)."""
    meta = Path(ckpt) / VOCAB_FILE
    if not meta.is_file():
        return ByteVocab(langs)
    try:
        info = json.loads(meta.read_text())
        kind, file, sha = info["kind"], info["file"], info["sha256"]
    except (ValueError, KeyError, TypeError) as e:
        raise ScaletrainError(f"{meta}: unreadable vocabulary record ({type(e).__name__}: {e})") from None
    if kind != "spm":
        raise ScaletrainError(f"{meta}: unknown vocabulary kind {kind!r} (this scaletrain knows byte and spm)")
    path = Path(ckpt) / file
    if not path.is_file():
        raise ScaletrainError(f"{ckpt}: the SentencePiece model {file} named in {VOCAB_FILE} is missing")
    vocab = SubwordVocab(langs, path)
    if vocab.sha256 != sha:
        raise ScaletrainError(f"{path}: sha256 {vocab.sha256[:12]}... differs from {VOCAB_FILE}'s {sha[:12]}...; "
                              "the checkpoint's tokenizer file was changed")
    return vocab


def _model_with_weights(cfg, vocab, sd: dict[str, torch.Tensor], where: Path, device):
    """The model of ``cfg`` (every expert, one process) holding ``sd``, in eval mode on ``device``."""
    model = build_model(cfg.model, vocab.size, pieces=vocab.pieces(), moe=cfg.moe)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not m.endswith("_float_tensor")]
    if missing or unexpected:
        raise ScaletrainError(f"{where}: weights do not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})")
    return model.to(device).eval()


def load_exported(path: str | Path, device: str | torch.device = "cpu"):
    """``load_for_inference`` for one file written by ``scaletrain export`` (``--format safetensors``,
    :func:`scaletrain.export.single_file.export_checkpoint`): the config, languages, step and
    (subword models) the tokenizer record ride in its metadata, the SentencePiece model lies beside it.
    Any architecture, with no training checkpoint."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types
        raise ScaletrainError(f"{path}: not a readable safetensors file ({e})") from None
    if "scaletrain_config" not in meta or "langs" not in meta:
        raise ScaletrainError(f"{path}: not written by `scaletrain export` (no scaletrain_config/langs metadata); "
                              "give a checkpoint or run directory instead")
    cfg = from_dict(yaml.safe_load(meta["scaletrain_config"]))
    langs = json.loads(meta["langs"])
    if meta.get("vocab"):
        info = json.loads(meta["vocab"])
        spm = path.parent / info["file"]
        if not spm.is_file():
            raise ScaletrainError(f"{path}: its SentencePiece model {info['file']} is not beside it")
        vocab = SubwordVocab(langs, spm)
        if vocab.sha256 != info["sha256"]:
            raise ScaletrainError(f"{spm}: sha256 {vocab.sha256[:12]}... differs from {path.name}'s record "
                                  f"{info['sha256'][:12]}...")
    else:
        vocab = ByteVocab(langs)
    sd = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
    model = _model_with_weights(cfg, vocab, sd, path, device)
    step = meta.get("step")
    trainer_state = {"step": int(step) if step and step.isdigit() else None}
    return model, cfg, vocab, trainer_state, path


def load_for_inference(path: str | Path, device: str | torch.device = "cpu"):
    """(model in eval mode, config, vocab, trainer_state, path) from a checkpoint or run directory, or
    from a ``.safetensors`` file written by ``scaletrain export`` (``load_exported``)."""
    if Path(path).is_file() and str(path).endswith(".safetensors"):
        return load_exported(path, device)
    ckpt = resolve_checkpoint(path)
    cfg = from_dict(yaml.safe_load((ckpt / "config.yaml").read_text()))
    langs = json.loads((ckpt / "langs.json").read_text())
    vocab = load_checkpoint_vocab(ckpt, langs)
    model = _model_with_weights(cfg, vocab, load_model_weights(ckpt), ckpt, device)
    trainer_state = json.loads((ckpt / "trainer_state.json").read_text())
    return model, cfg, vocab, trainer_state, ckpt
