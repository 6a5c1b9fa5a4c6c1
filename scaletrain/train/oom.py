"""Out of memory in training (``train.on_oom``): the micro-batches, the optimizer step, validation.

A training batch whose forward or backward runs out of memory (:func:`scaletrain.oom.is_oom`):

* ``stop`` (default): one line naming the batch's shape, its tokens and ``data.max_tokens`` (what to lower)
  and the memory numbers, raised as :class:`~scaletrain.oom.OutOfMemory` (the CLI exits
  :data:`~scaletrain.oom.OOM_EXIT`). Nothing is written: the last checkpoint stays the newest (a resume
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

import logging

from scaletrain.errors import ScaletrainError
from scaletrain.oom import OutOfMemory, free_cached_memory, memory_summary, oom_guard

log = logging.getLogger("scaletrain")
MODES = ("stop", "skip")


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
