"""``scaletrain export --format safetensors``: a checkpoint as one file that scaletrain loads back.

:func:`export_checkpoint` consolidates any engine's checkpoint (ZeRO-3 shards and expert shards
included, read by ``scaletrain.checkpoint.load_model_weights``) into one safetensors file that loads with
``safetensors`` + ``build_model`` alone; the resolved config, the languages, the step and (subword models)
the tokenizer record ride in its metadata. Its reader is
:func:`scaletrain.checkpoint.inference.load_exported`, which ``evaluate`` and ``translate`` reach through
``load_for_inference``: what is read back stays with the checkpoint package, the exports are here.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from scaletrain.checkpoint import VOCAB_FILE, load_model_weights, resolve_checkpoint, save_safetensors
from scaletrain.errors import ScaletrainError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # export --dtype


def export_checkpoint(ckpt: str | Path, out: str | Path, dtype: str = "fp32") -> Path:
    """Write the consolidated weights of ``ckpt`` to ``out`` (safetensors); returns the path.

    Config, languages and step ride in the metadata; a SentencePiece model is copied beside ``out``
    as ``<out stem>.<file>``. ``translate`` / ``evaluate --checkpoint out`` load the file directly
    (``scaletrain.checkpoint.load_exported``), for every architecture."""
    if dtype not in DTYPES:
        raise ScaletrainError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    ck = resolve_checkpoint(ckpt)
    sd = load_model_weights(ck, quiet=True)
    dt = DTYPES[dtype]
    sd = {k: v.to(dt) if v.is_floating_point() else v for k, v in sd.items()}
    state = json.loads((ck / "trainer_state.json").read_text())
    meta = {
        "format": "pt", "scaletrain_config": (ck / "config.yaml").read_text(),
        "langs": (ck / "langs.json").read_text(), "step": str(state.get("step", "")), "dtype": dtype,
        "source": str(ck),
    }
    out = Path(out)
    vocab_meta, vocab_tmp = ck / VOCAB_FILE, None
    if vocab_meta.is_file():  # a SentencePiece model travels beside the file, recorded in its metadata
        info = json.loads(vocab_meta.read_text())
        name = f"{out.stem}.{info['file']}"
        out.parent.mkdir(parents=True, exist_ok=True)
        vocab_tmp = out.parent / (name + ".tmp")
        shutil.copyfile(ck / info["file"], vocab_tmp)
        meta["vocab"] = json.dumps({"kind": info["kind"], "file": name, "sha256": info["sha256"]})
    try:  # the model beside an earlier export of the same name is replaced only once the new file is written
        save_safetensors(sd, out, meta)
        if vocab_tmp is not None:
            os.replace(vocab_tmp, vocab_tmp.with_suffix(""))
    finally:
        if vocab_tmp is not None:
            vocab_tmp.unlink(missing_ok=True)
    return out
