"""NaN/inf policy (``train.nonfinite``, ``train.max_nonfinite``).

A non-finite update is never applied: a NaN/inf loss on any rank makes that rank's gradient, and so
the all-reduced gradient every rank holds, non-finite; the engines check the reduced gradient's norm
(identical on every rank, no extra collective) and skip the optimizer step and the LR schedule on every
rank together (``StepInfo.nonfinite``). The check runs on the device (``scaletrain/engine/optim.py``:
the fused AdamW withholds the update where the norm's flag is 1; ZeRO-3, fp32 ZeRO-1/2 and fp16 by
DeepSpeed's own check); the flag is read with the step's other values on the next log, validation or save
step, and a skipped update's LR step is undone then. fp16 keeps its loss scaler: an overflow there lowers
the scale (``skipped_steps``), and the minimum scale stops the job.

This guard then, on every rank, when those values are read (``Trainer._settle``, in step order): counts
the skipped update (``TrainState.nonfinite_steps``, metric ``train/nonfinite_steps``), writes ``OUT/nonfinite/step-N-rankR.json`` with the step's examples (the
data-stream position before the step, and per micro-batch and row the languages, the text and its
sha256: the stream is deterministic, so position + row names the example; the text finds it in the
shards) and stops with one line under ``train.nonfinite=stop``, or after ``train.max_nonfinite``
non-finite updates in a row under ``skip``.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from scaletrain.errors import ScaletrainError
from scaletrain.fileio import atomic_write_text
from scaletrain.train.state import TrainState
from scaletrain.train.unit import StepOutput

log = logging.getLogger("scaletrain")
DUMP_DIR = "nonfinite"  # OUT/nonfinite/step-N-rankR.json


class NonfiniteGuard:
    """``mode``: skip | stop (``train.nonfinite``); ``max_run``: skipped updates in a row before stopping
    (``train.max_nonfinite``); the examples of a non-finite step are written under ``out_dir/nonfinite``."""

    def __init__(self, mode: str, max_run: int, out_dir, engine, state: TrainState, vocab):
        self.mode, self.max_run = mode, max_run
        self.dir = Path(out_dir) / DUMP_DIR
        self.engine, self.state, self.vocab = engine, state, vocab

    def after_step(self, out: StepOutput, micro: list, position: dict | None, step: int | None = None) -> None:
        """After update ``step`` (default ``state.step``), in step order; the trainer calls it when it reads the
        updates' device values (log, validation and save steps: ``Trainer._settle``), so a stop comes at the
        first such step after the non-finite one, before any later checkpoint. Raises
        :class:`ScaletrainError` (every rank at the same step: ``info.nonfinite`` is rank-agreed) when the
        policy says stop."""
        st, nonfinite = self.state, out.info.nonfinite
        step = st.step if step is None else step
        if not nonfinite and out.loss_finite:
            st.nonfinite_run = 0
            return
        path = self.dump(out, micro, position, step)
        if not nonfinite:  # only this rank's loss; the reduced gradient stayed finite, the update went through
            st.nonfinite_run = 0
            log.warning("rank %d: non-finite loss at step %d but a finite gradient; the update was applied "
                        "(examples in %s)", self.engine.rank, step, path)
            return
        st.nonfinite_steps += 1
        st.nonfinite_run += 1
        where = f"the step's examples are in {self.dir}"
        if self.mode == "stop":
            raise ScaletrainError(
                f"non-finite loss or gradient at step {step} (train.nonfinite=stop): the update was not applied; "
                f"{where}; check those examples or lower optim.lr, then re-run to resume from the last checkpoint "
                "(or set train.nonfinite=skip)")
        if st.nonfinite_run >= self.max_run:
            raise ScaletrainError(
                f"{st.nonfinite_run} non-finite updates in a row, the last at step {step} "
                f"(train.max_nonfinite={self.max_run}): none was applied; {where}; lower optim.lr or check those "
                "examples, then re-run to resume from the last checkpoint")
        if self.engine.is_main:
            log.warning("step %d: non-finite loss or gradient, update skipped on every rank (%d in a row, %d in "
                        "all; stop at %d in a row); %s", step, st.nonfinite_run, st.nonfinite_steps, self.max_run,
                        where)

    def dump(self, out: StepOutput, micro: list, position: dict | None, step: int | None = None) -> Path:
        """This rank's examples of update ``step`` (default ``state.step``) as JSON (atomic); returns the file."""
        step = self.state.step if step is None else step
        rank = self.engine.rank
        batches = []
        for i, b in enumerate(micro):
            batches.append({"micro_batch": i, "examples": [self._example(b, j) for j in range(b.size)]})
        record = {
            "step": step, "rank": rank, "loss_sum": out.loss_sum, "nll_sum": out.nll_sum,
            "loss_finite": out.loss_finite, "grad_norm": out.info.grad_norm, "update_skipped": out.info.nonfinite,
            "stream_position_before_step": position, "batches": batches,
        }
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step-{step:07d}-rank{rank:05d}.json"
        atomic_write_text(path, json.dumps(record, indent=1, ensure_ascii=False, default=str))
        return path

    def _example(self, b, j: int) -> dict:
        langs = self.vocab.langs
        src = self.vocab.decode(b.src[j].tolist())
        tgt = self.vocab.decode(b.tgt_out[j].tolist())
        return {"row": j, "src_lang": langs[int(b.src_lang[j])], "tgt_lang": langs[int(b.tgt_lang[j])],
                "source": src, "target": tgt,
                "sha256": hashlib.sha256(f"{src}\t{tgt}".encode("utf-8", "surrogatepass")).hexdigest()}
