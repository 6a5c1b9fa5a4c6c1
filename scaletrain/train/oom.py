"""Out of device memory in a training step (``train.on_oom``).

A batch whose forward or backward raises ``torch.OutOfMemoryError``:

* ``stop`` (default): one line naming the batch's shape, its tokens and ``data.max_tokens`` (what to lower),
  raised as :class:`ScaletrainError`. Nothing is written: the last checkpoint stays the newest (a resume
  redoes the steps since), no partial state is saved.
* ``skip`` (fairseq's ``--skip-oom`` behaviour): the memory is freed, the update is withheld (parameters,
  optimizer state and LR schedule unchanged; the engine's accumulation counters realigned), the step is
  counted in ``TrainState.oom_steps`` (metric ``train/oom_steps``) with a warning naming the batch, and
  training goes on with the next batches. A single process only, as in fairseq: with more ranks the
  others are already inside the step's collectives (gradient all-reduce, ZeRO gathers) that the failed
  rank can no longer join, so ``skip`` is refused at start for a world of more than one.
"""
from __future__ import annotations

import gc
import logging

import torch

from scaletrain.errors import ScaletrainError

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

    def recover(self, engine, micro: list, failed: int) -> str:
        """After micro-batch ``failed`` of ``micro`` ran out of memory (the exception already released):
        raise under ``stop``; else free the memory, make the engine's next ``step()`` withhold the update,
        and return the batch's shape for the log."""
        shape = batch_shape(micro[failed])
        if self.mode == "stop":
            raise ScaletrainError(
                f"out of device memory in micro-batch {failed + 1}/{len(micro)} of the step, a batch of {shape} "
                f"(data.max_tokens={self.max_tokens}): lower data.max_tokens (or engine.activation_checkpointing="
                "true), "
                "or set train.on_oom=skip to skip such batches; the last checkpoint is intact: re-run to resume")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        engine.abandon_step(failed)
        return shape
