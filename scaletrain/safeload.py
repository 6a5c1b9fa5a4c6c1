"""Checkpoint files are read with ``torch.load(..., weights_only=True)``: loading never runs code.

A pickle can name any importable callable and have the unpickler call it (``__reduce__``); PyTorch's
weights-only unpickler accepts only tensors, plain containers and numbers, and the globals allowlisted
for one load. Every ``.pt`` / ``.bin`` / ``.pkl`` a checkpoint holds is read here:

* our own files (``rank*.pt``: stream state and RNG states as tensors and plain types; the engine state
  ``scaletrain.checkpoint.engine_state`` writes: ``optimizer.bin``, ``scaler.pt``; the ``scheduler.bin`` /
  ``scheduler.pt`` of older checkpoints) with :func:`safe_torch_load`;
* the files DeepSpeed writes (``mp_rank_00_model_states.pt``, ``zero_pp_rank_*``) are read by DeepSpeed's
  own loaders, which call ``torch.load(..., weights_only=False)``; they run inside
  :func:`weights_only_loads`, which routes every ``torch.load`` of the process to :func:`safe_torch_load`
  for the duration. The only classes allowed beyond PyTorch's defaults are the plain-data types those
  files were found to contain (registered by ``scaletrain.checkpoint.deepspeed_files``: DeepSpeed's
  loss-scaler record, the ZeRO stage enum, a fragment address) and, for the RNG file of Accelerate's
  ``save_state`` (older checkpoints), the numpy array types Accelerate itself allowlists.

A file that holds anything else is refused with one line naming the file and the global it asked
for; a truncated or corrupt file is named too.
"""
from __future__ import annotations

import contextlib
import io
import pickle
import re
import threading
import zipfile
from pathlib import Path

import torch

from scaletrain.errors import ScaletrainError

_orig_torch_load = torch.load
_lock = threading.RLock()


_providers: list = []  # callables returning classes a checkpoint file may hold (registered by the engines)


def register_safe_types(provider) -> None:
    """Allow the classes ``provider()`` returns in every weights-only load (called lazily, once per load).

    ``scaletrain.checkpoint.deepspeed_files`` registers the plain-data DeepSpeed classes found in DeepSpeed's
    checkpoint files (the one module outside ``scaletrain/engine/`` that imports DeepSpeed)."""
    if provider not in _providers:
        _providers.append(provider)


def _registered_types() -> list:
    out = []
    for provider in _providers:
        out += list(provider())
    return out


def _accelerate_rng_types() -> list:
    """The numpy array types Accelerate allowlists for its own RNG file (``random_states_*.pkl``)."""
    try:
        from accelerate.utils.other import TORCH_SAFE_GLOBALS

        return list(TORCH_SAFE_GLOBALS)
    except ImportError:
        return []


def _name(f) -> str:
    if isinstance(f, (str, Path)):
        return str(f)
    return str(getattr(f, "name", "<stream>"))


def safe_torch_load(f, map_location="cpu", extra_globals: list | None = None, **_ignored):
    """``torch.load(f, weights_only=True)`` with DeepSpeed's (and Accelerate's) plain-data types allowed.

    Raises ScaletrainError naming ``f`` when it holds anything else, or is truncated/corrupt.
    """
    name = _name(f)
    allowed = _registered_types() + list(extra_globals or [])
    if Path(name).name.startswith("random_states_"):
        allowed += _accelerate_rng_types()
    try:
        with torch.serialization.safe_globals(allowed):
            return _orig_torch_load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        msg = str(e)
        m = re.search(r"(?:GLOBAL|global:?)\s+([A-Za-z_][\w.]*)", msg)
        what = m.group(1) if m else "not allowed"
        raise ScaletrainError(
            f"{name}: refused to load: it holds a pickled object ({what}) other than tensors and plain data, "
            "which could run code; do not use this checkpoint (only files written by scaletrain, DeepSpeed or "
            "Accelerate are read)"
        ) from None
    except FileNotFoundError:
        raise ScaletrainError(f"{name}: file missing from the checkpoint") from None
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile, OSError, io.UnsupportedOperation) as e:
        first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise ScaletrainError(
            f"{name}: unreadable checkpoint file, truncated or corrupt ({first}); use an earlier checkpoint"
        ) from None


@contextlib.contextmanager
def weights_only_loads():
    """Within this context every ``torch.load`` in the process (DeepSpeed's ``load_checkpoint``,
    ``zero_to_fp32``, Accelerate's ``load_state``) is :func:`safe_torch_load`, whatever it asks for."""

    def load(f, map_location=None, *args, **kwargs):
        return safe_torch_load(f, map_location=map_location if map_location is not None else "cpu")

    with _lock:
        saved = torch.load
        torch.load = load
        try:
            yield
        finally:
            torch.load = saved
