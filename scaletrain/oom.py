"""Out of memory anywhere, as one line: what ran out, where, on what batch, and the setting to change.

Every place that allocates by the batch (a training micro-batch, the optimizer step, validation, in-training
BLEU decoding, ``evaluate``, ``translate``, ``export``, writing a checkpoint) runs inside :func:`oom_guard`,
which turns ``torch.OutOfMemoryError`` (CUDA's caching allocator), CUDA's and the CPU allocator's
``RuntimeError`` variants (``CUDA error: out of memory``, ``CUBLAS_STATUS_ALLOC_FAILED``, ``DefaultCPUAllocator:
can't allocate memory``) and Python's ``MemoryError`` into an :class:`OutOfMemory`: the stage, the batch's
shape and tokens, the key or flag that sizes it, and the memory numbers at that moment (CUDA: allocated and
reserved by torch, the device's total; CPU: the process's resident memory and the machine's RAM), as
Lightning and the HF Trainer print them. ``scaletrain.cli`` prints it as one line and exits
:data:`OOM_EXIT`; an out-of-memory error that escapes every guard is printed the same way there.

:class:`OutOfMemory` keeps its parts, so an outer layer that knows more adds it: the trainer says which
checkpoint is intact (``after``), ``translate`` how many lines it already wrote. A layer-1 primitive: torch
is only looked at where it is already loaded (an error from torch means it is), so ``scaletrain.cli``
imports this for free.

Written here rather than taken from a library: PyTorch has only the exception types; Lightning's and
Accelerate's helpers (``garbage_collection_cuda``, ``find_executable_batch_size``) retry with smaller
batches, which changes what a run computes, and say nothing of the stage or the setting to change.

Training's policy (``train.on_oom``, :class:`OomPolicy`), for the micro-batches, the optimizer step and
validation.

A training batch whose forward or backward runs out of memory (:func:`is_oom`):

* ``stop`` (default): one line naming the batch's shape, its tokens and ``data.max_tokens`` (what to lower)
  and the memory numbers, raised as :class:`OutOfMemory` (the CLI exits
  :data:`OOM_EXIT`). Nothing is written: the last checkpoint stays the newest (a resume
  redoes the steps since), no partial state is saved.
* ``skip`` (fairseq's ``--skip-oom`` behaviour): the memory is freed, the update is withheld (parameters,
  optimizer state and LR schedule unchanged; the engine's accumulation counters realigned), the step is
  counted in ``TrainState.oom_steps`` (metric ``train/oom_steps``) with a warning naming the batch, and
  training goes on with the next batches. A single process only, as in fairseq: with more ranks the
  others are already inside the step's collectives (gradient all-reduce, ZeRO gathers) that the failed
  rank can no longer join, so ``skip`` is refused at start for a world of more than one.

A validation batch follows the same policy (:meth:`OomPolicy.validation_batch`): ``stop`` names it, ``skip``
leaves it out, and the validation loss is the one over the batches that ran, with their count
(``valid/oom_batches``). The optimizer step (:meth:`OomPolicy.updating`) always stops: an update that ran out
of memory part-way may have changed some parameters and not others, so there is nothing safe to skip to.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable

from scaletrain.errors import ScaletrainError

# sysexits.h EX_OSERR ("the system could not provide a resource"): distinct from 2 (fix the input or the config)
# and 75 (preempted: re-run as is), so a sweep or scheduler can tell "needs a smaller batch or a bigger device".
OOM_EXIT = 71
MODES = ("stop", "skip")  # train.on_oom

_RUNTIME_MARKERS = ("out of memory", "can't allocate memory", "not enough memory", "alloc_failed",
                    "failed to allocate")

__all__ = ["MODES", "OOM_EXIT", "OomPolicy", "OutOfMemory", "as_oom", "batch_shape", "free_cached_memory", "is_oom",
           "memory_summary", "oom_guard"]


class OutOfMemory(ScaletrainError):
    """Out of memory at a named stage. ``str()`` is the one line, composed from the parts, which an outer
    layer may complete (``after``: what stays intact and what to do next)."""

    exit_code = OOM_EXIT

    def __init__(self, stage: str, what: str = "", fix: str = "", memory: str = "", after: str = ""):
        self.stage, self.what, self.fix, self.memory, self.after = stage, what, fix, memory, after
        super().__init__(stage)

    def __str__(self) -> str:
        line = f"out of memory in {self.stage}"
        line += f", {self.what}" if self.what else ""
        line += f": {self.fix}" if self.fix else ""
        line += f"; {self.after}" if self.after else ""
        line += f" [{self.memory}]" if self.memory else ""
        return " ".join(line.split())  # one line, whatever the parts held


def is_oom(e: BaseException) -> bool:
    """``e`` is an allocation failure: torch's ``OutOfMemoryError``, a ``RuntimeError`` from CUDA, cuBLAS/cuDNN
    or the CPU allocator saying so, or ``MemoryError``."""
    if isinstance(e, (OutOfMemory, MemoryError)):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e).lower() for m in _RUNTIME_MARKERS)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _cuda_summary(device) -> str:
    import torch

    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(idx)
    return (f"cuda:{idx}: {_gib(torch.cuda.memory_allocated(idx))} allocated by torch, "
            f"{_gib(torch.cuda.memory_reserved(idx))} reserved, {_gib(free)} free of {_gib(total)}")


def _host_summary() -> str:
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return ""  # not Linux: say nothing rather than a guess
    return f"host: this process holds {_gib(rss)} of {_gib(total)} RAM"


def memory_summary(device=None) -> str:
    """The memory numbers now: on a CUDA device (``device``, else the current one where CUDA is in use)
    torch's allocated and reserved bytes and the device's free and total; otherwise this process's resident
    memory and the machine's RAM; "" where neither can be read."""
    torch = sys.modules.get("torch")
    kind = getattr(device, "type", None) or (str(device).split(":")[0] if device is not None else None)
    cuda = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda and kind in ("cuda", None):
        try:
            return _cuda_summary(device if kind == "cuda" else None)
        except Exception:  # noqa: BLE001 - the numbers are a help; the line must come out without them
            pass
    return _host_summary()


def free_cached_memory() -> None:
    """Release what an abandoned computation left: its tensors (garbage-collected) and CUDA's cached blocks."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def as_oom(e: BaseException, stage: str, fix: str = "", device=None) -> OutOfMemory:
    """``e`` (an allocation failure, :func:`is_oom`) as the line of ``stage``: an :class:`OutOfMemory` is
    returned as it is; any other names its type and its message's first sentence."""
    if isinstance(e, OutOfMemory):
        return e
    first = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:160]
    return OutOfMemory(stage, f"{type(e).__name__}: {first}" if first else type(e).__name__, fix, memory_summary(device))


@contextlib.contextmanager
def oom_guard(stage: str, what: str | Callable[[], str] = "", fix: str = "", after: str = "", device=None):
    """Run the block; an allocation failure in it (:func:`is_oom`) becomes :class:`OutOfMemory` with these
    parts and the memory numbers (``what`` may be a callable, evaluated only then). An
    :class:`OutOfMemory` from an inner guard passes through unchanged (the innermost knows most)."""
    try:
        yield
    except OutOfMemory:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised unless it is an allocation failure
        if not is_oom(e):
            raise
        desc = what() if callable(what) else what
        raise OutOfMemory(stage, desc, fix, memory_summary(device), after) from e


# ---- training: train.on_oom ---------------------------------------------------------------------------------
def batch_shape(b) -> str:
    """``B x S -> B x T`` of a translation batch, with its target tokens."""
    return (f"{tuple(b.src.shape)[0]}x{tuple(b.src.shape)[1]} source -> {tuple(b.tgt_in.shape)[0]}x"
            f"{tuple(b.tgt_in.shape)[1]} target ({b.n_src_tokens}+{b.n_tgt_tokens} tokens)")


class OomPolicy:
    def __init__(self, mode: str, max_tokens: int, world_size: int = 1):
        if mode not in MODES:
            raise ScaletrainError(f"train.on_oom must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "skip" and world_size > 1:
            raise ScaletrainError(
                f"train.on_oom=skip needs a single process (this job has {world_size} ranks: a rank out of memory "
                "cannot rejoin the step's collectives on the others); use train.on_oom=stop and lower data.max_tokens")
        self.mode, self.max_tokens = mode, max_tokens

    def recover(self, engine, micro: list, failed: int, memory: str = "") -> str:
        """After micro-batch ``failed`` of ``micro`` ran out of memory (the exception already released;
        ``memory``: :func:`~scaletrain.oom.memory_summary` taken when it was raised): raise under ``stop``;
        else free the memory, make the engine's next ``step()`` withhold the update, and return the batch's
        shape for the log."""
        shape = batch_shape(micro[failed])
        if self.mode == "stop":
            raise OutOfMemory(
                f"micro-batch {failed + 1}/{len(micro)} of the step (forward/backward)",
                f"a batch of {shape} (data.max_tokens={self.max_tokens})",
                "lower data.max_tokens (or engine.activation_checkpointing=true), or set train.on_oom=skip to skip "
                "such batches", memory or memory_summary(engine.device))
        free_cached_memory()
        engine.abandon_step(failed)
        return shape

    def updating(self, engine, micro: list):
        """Around the optimizer step after ``micro``: out of memory there (Adam's moments are allocated at
        the first update) stops whatever ``train.on_oom`` says."""
        return oom_guard(
            "the optimizer step (the update after the step's micro-batches)",
            lambda: (f"after {len(micro)} micro-batch(es) of {sum(b.n_tgt_tokens for b in micro)} target tokens on "
                     f"this rank (data.max_tokens={self.max_tokens})"),
            "the parameters, gradients and optimizer state do not fit beside what the step left: shard them "
            "(engine.ds_config=zero1.json, zero2.json, zero3.json), offload the optimizer state "
            "(zero3_offload_optimizer.json), or lower data.max_tokens; train.on_oom=skip cannot skip an update "
            "that may be half-applied", device=engine.device)

    def validation_batch(self, engine, batch, index: int, where: str, memory: str = "") -> None:
        """Validation batch ``index`` (0-based) ran out of memory (the exception already released; ``memory``
        as in :meth:`recover`): raise under ``stop``; under ``skip`` free the memory (the caller leaves the
        batch out and counts it)."""
        if self.mode == "stop":
            raise OutOfMemory(
                f"{where}, batch {index + 1}", f"a batch of {batch_shape(batch)} (data.max_tokens={self.max_tokens})",
                "lower data.max_tokens (validation batches are cut to it as training's are), or set "
                "train.on_oom=skip to leave such batches out of the validation loss", memory or memory_summary(engine.device))
        free_cached_memory()
