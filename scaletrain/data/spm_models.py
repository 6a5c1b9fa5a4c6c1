"""The manifest's record of a shard directory's SentencePiece models and their token-length files.

``manifest.tokenizers`` holds one entry per model stored beside the shards::

    {"type": "spm", "file": "spm<N>.model", "vocab_size": N, "sha256": ..., "params": {...},
     "lengths": {split: {"file": "spm<N>.<split>.lengths.npy", "sha256": ..., "n": ..., "dtype": ...}}}

Written by ``scaletrain.prepare.spm_train.add_spm_model``; read here: ``find_spm_model`` and
``load_shard_vocab`` (the vocabulary of a run on a shard directory; ``scaletrain.vocab.load_vocab`` itself
takes the model file and knows nothing of shard directories), ``load_token_lengths`` for the stream.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from scaletrain.data.shards import load_manifest
from scaletrain.errors import ScaletrainError
from scaletrain.fileio import sha256_file
from scaletrain.vocab import load_vocab

SPM_TYPE = "spm"


def spm_file_name(vocab_size: int) -> str:
    return f"spm{vocab_size}.model"


def lengths_file_name(vocab_size: int, split: str) -> str:
    return f"spm{vocab_size}.{split}.lengths.npy"


def spm_entries(manifest) -> list[dict]:
    return [t for t in (manifest.tokenizers or []) if t.get("type") == SPM_TYPE]


def find_spm_model(shard_dir: str | Path, vocab_size: int = 0) -> Path:
    """Path of the SentencePiece model recorded in ``shard_dir``'s manifest (checked by sha256).

    ``vocab_size`` picks one when the directory has several (0 = the only one)."""
    m = load_manifest(shard_dir)
    found = spm_entries(m)
    if not found:
        raise ScaletrainError(
            f"{shard_dir} has no SentencePiece model (data.tokenizer=spm): create one with "
            f"`scaletrain data spm {shard_dir} --vocab-size N`, or prepare the shards with --spm-vocab-size N"
        )
    if vocab_size:
        pick = [t for t in found if int(t["vocab_size"]) == vocab_size]
        if not pick:
            raise ScaletrainError(
                f"{shard_dir} has no SentencePiece model of size {vocab_size} (data.spm_vocab_size); it has: "
                f"{', '.join(str(t['vocab_size']) for t in found)}; or add one with "
                f"`scaletrain data spm {shard_dir} --vocab-size {vocab_size}`"
            )
        entry = pick[0]
    elif len(found) > 1:
        raise ScaletrainError(
            f"{shard_dir} has several SentencePiece models (sizes {', '.join(str(t['vocab_size']) for t in found)}): "
            "choose one with data.spm_vocab_size"
        )
    else:
        entry = found[0]
    path = Path(shard_dir) / entry["file"]
    if not path.is_file():
        raise ScaletrainError(f"{path}: listed in the manifest but missing; re-create it with "
                              f"`scaletrain data spm {shard_dir} --vocab-size {entry['vocab_size']}`")
    if sha256_file(path) != entry["sha256"]:
        raise ScaletrainError(f"{path}: sha256 differs from the manifest (corrupt or replaced); re-create it with "
                              f"`scaletrain data spm {shard_dir} --vocab-size {entry['vocab_size']} --overwrite`")
    return path


def load_shard_vocab(langs: Sequence[str], tokenizer: str, shard_dir, *, vocab_size: int = 0, num_threads: int = 1):
    """The vocabulary of a run on ``shard_dir`` (``data.tokenizer``, ``data.spm_vocab_size``):
    ``ByteVocab(langs)`` for ``"byte"`` (the directory is not read: it may be a URL); for ``"spm"`` a
    ``SubwordVocab`` with the model recorded in the directory's manifest (``find_spm_model``: ``vocab_size``
    picks one when there are several, 0 = the only one; its sha256 is checked)."""
    model_path = find_spm_model(shard_dir, vocab_size) if tokenizer == "spm" else None
    return load_vocab(langs, tokenizer, model_path, num_threads=num_threads)


def load_token_lengths(shard_dir: str | Path, manifest, vocab, split: str):
    """The [n, 2] token lengths of ``split`` for ``vocab``'s model (memory-mapped), or None when the
    manifest records no lengths file for that model and split. ``vocab`` is a
    ``SubwordVocab`` (only its ``sha256`` is read)."""
    for t in spm_entries(manifest):
        if t.get("sha256") != vocab.sha256:
            continue
        rec = (t.get("lengths") or {}).get(split)
        if not rec:
            return None
        path = Path(shard_dir) / rec["file"]
        try:
            arr = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise ScaletrainError(
                f"{path}: cannot read the token lengths ({e}); re-create them with "
                f"`scaletrain data spm {shard_dir} --vocab-size {t['vocab_size']} --overwrite`"
            ) from None
        n = manifest.split(split).n_examples
        if arr.shape != (n, 2):
            raise ScaletrainError(f"{path}: shape {arr.shape}, the split has {n} examples (expected ({n}, 2)); "
                                  f"re-create it with `scaletrain data spm {shard_dir} --vocab-size "
                                  f"{t['vocab_size']} --overwrite`")
        return arr
    return None
