"""Components of the training loop; each decides its own timing and owns its state (torchtitan).

* :class:`StepLogger` - train loss/nll, LR, grad norm, throughput (target tokens/s, source+target tokens/s,
  bytes/s for the byte tokenizer), data-loader wait per step, peak memory (CUDA max allocated, or the
  process's peak RSS), ETA and routing statistics every ``train.log_every`` updates (one log line on rank
  0, metrics to the tracker).
* :class:`Evaluator` - validation loss every ``train.valid_every`` updates and BLEU/chrF on the fixed
  validation subset every ``train.bleu_every`` updates.
* :class:`EarlyStopper` - best checkpoint on ``train.best_metric`` and early stopping after
  ``train.patience`` evaluations without improvement.

Checkpoint timing is :meth:`scaletrain.checkpoint.CheckpointManager.maybe_save`; every counter is in
:class:`scaletrain.train.state.TrainState`.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from scaletrain.data.stream import ShardStream
from scaletrain.train.state import TimeBudget, TrainClock, TrainState
from scaletrain.train.unit import StepOutput, TranslationUnit, validation_loss

log = logging.getLogger("scaletrain")


def fmt_secs(s: float) -> str:
    s = int(s)
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


class StepLogger:
    """Accumulates each update's sums and reports every ``log_every`` updates (and at ``max_steps``)."""

    def __init__(self, tc, engine, unit: TranslationUnit, state: TrainState, clock: TrainClock, budget: TimeBudget,
                 tracker, byte_level: bool = False):
        self.tc, self.engine, self.unit, self.state = tc, engine, unit, state
        self.byte_level = byte_level  # tokens are bytes: bytes/s = (source + target tokens)/s
        self.clock, self.budget, self.tracker = clock, budget, tracker
        self.loss_history: list[tuple[int, float]] = []  # (step, train loss) at each log line of this session
        self.last_routing: dict[str, float] = {}
        self.start()

    def start(self) -> None:
        self._loss = self._nll = 0.0
        self._ntok = self._tok = self._skipped = self._src = self._steps = 0
        self._wait = 0.0
        self._t_log = time.time()
        self._steps_at_start = self.state.step

    def after_step(self, out: StepOutput, data_wait: float = 0.0) -> None:
        """``data_wait``: seconds this step waited for its batches (the data loader)."""
        self._wait += data_wait
        self._steps += 1
        self._src += out.global_src_tokens
        self._loss += out.loss_sum
        self._nll += out.nll_sum
        self._ntok += out.ntok
        self._tok += out.global_tokens
        self._skipped += int(out.info.skipped and not out.info.nonfinite)
        st = self.state
        if st.step % self.tc.log_every == 0 or st.step == self.tc.max_steps:
            self._report(out)

    def _eta(self) -> float:
        per_step = self.clock.session_seconds() / max(self.state.step - self._steps_at_start, 1)
        return min((self.tc.max_steps - self.state.step) * per_step, self.budget.left())

    def _report(self, out: StepOutput) -> None:
        eng, st, info = self.engine, self.state, out.info
        l, nl, nt = eng.all_reduce_sum([self._loss, self._nll, self._ntok])
        elapsed = max(time.time() - self._t_log, 1e-9)
        tps = self._tok / elapsed
        metrics = {
            "train/loss": l / max(nt, 1), "train/nll": nl / max(nt, 1), "train/lr": info.lr,
            "train/grad_norm": info.grad_norm, "train/tokens_per_s": tps,
            "train/src_tgt_tokens_per_s": (self._tok + self._src) / elapsed,
            "train/tokens_seen": st.tokens_seen, "train/skipped_steps": float(st.skipped_steps),
            "train/nonfinite_steps": float(st.nonfinite_steps),
            "train/data_wait_s": self._wait / max(self._steps, 1),  # per step, this rank
            "train/data_wait_frac": self._wait / elapsed,
            **peak_memory(eng.device),
        }
        if self.byte_level:
            metrics["train/bytes_per_s"] = metrics["train/src_tgt_tokens_per_s"]
        self.loss_history.append((st.step, metrics["train/loss"]))
        if eng.is_main:
            skipped = (f" | skipped {self._skipped} (fp16 overflow; {st.skipped_steps} in all)"
                       if self._skipped else "")
            log.info("step %6d | loss %.4f | nll %.4f | lr %.3e | gnorm %.3f | %8.0f tgt tok/s | eta %s%s",
                     st.step, metrics["train/loss"], metrics["train/nll"], info.lr, info.grad_norm, tps,
                     fmt_secs(self._eta()), skipped)
            self.tracker.log_metrics(metrics, step=st.step)
        routing = self.unit.routing()  # MoCE: expert shares, mean radius
        self.last_routing = routing
        if eng.is_main and routing:
            self.tracker.log_metrics(routing, step=st.step)
        self._loss = self._nll = 0.0
        self._ntok = self._tok = self._skipped = self._src = self._steps = 0
        self._wait = 0.0
        self._t_log = time.time()


def peak_memory(device) -> dict[str, float]:
    """``sys/cuda_max_allocated_mb`` on a CUDA device, else ``sys/max_rss_mb`` (this process's peak RSS)."""
    import torch

    if getattr(device, "type", "cpu") == "cuda" and torch.cuda.is_available():
        return {"sys/cuda_max_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20}
    try:
        import resource

        return {"sys/max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux
    except Exception:  # pragma: no cover - no resource module
        return {}


class Evaluator:
    """Validation loss (``valid_every``) and BLEU/chrF (``bleu_every``) on every rank; rank 0 reports."""

    def __init__(self, cfg, engine, unit: TranslationUnit, vocab, state: TrainState, tracker,
                 build_model: Callable):
        self.cfg, self.engine, self.unit, self.vocab, self.state = cfg, engine, unit, vocab, state
        self.tracker, self.build_model = tracker, build_model
        tc = cfg.train
        self.bleu = None
        if tc.bleu_every:
            from scaletrain.eval.in_training import BleuValidator

            self.bleu = BleuValidator.from_config(cfg, vocab, cfg.eval.valid_lines)

    def after_step(self) -> dict[str, float]:
        tc, step = self.cfg.train, self.state.step
        metrics: dict[str, float] = {}
        if tc.valid_every and step % tc.valid_every == 0:
            metrics["valid/nll"] = self.validation_loss()
        if tc.bleu_every and step % tc.bleu_every == 0:
            metrics.update(self.bleu_scores())
        return metrics

    def validation_loss(self) -> float:
        d, eng = self.cfg.data, self.engine
        stream = ShardStream(d.shards, "valid", rank=eng.rank, world_size=eng.world_size, seed=0,
                             max_tokens=d.max_tokens, max_bytes=d.max_bytes, epochs=1, vocab=self.vocab)
        v = validation_loss(eng, self.unit, stream, self.cfg.train.valid_max_batches)
        self.state.valid_history.append((self.state.step, v))
        if eng.is_main:
            log.info("step %6d | valid nll %.4f (%.3f bits/byte)", self.state.step, v, v / math.log(2))
            self.tracker.log_metrics({"valid/nll": v}, step=self.state.step)
        return v

    def bleu_scores(self) -> dict[str, float]:
        eng = self.engine
        model = eng.inference_module(self.build_model)  # collective where parameters are partitioned
        res = self.bleu.run(model, rank=eng.rank, world_size=eng.world_size)  # collective (all_gather_object)
        del model
        self.unit.routing(reset=True)
        eng.train(True)
        if eng.is_main:
            a = res.report.average("all")
            log.info("step %6d | valid BLEU %.2f chrF %.2f on %d lines (%.1fs)", self.state.step, a.bleu, a.chrf,
                     res.lines, res.seconds)
            self.tracker.log_metrics(res.metrics, step=self.state.step)
        return res.metrics


@dataclass(frozen=True)
class StopDecision:
    save: bool  # a new best: write a checkpoint now (and keep it as best)
    stop: bool  # early stop


class EarlyStopper:
    """Best checkpoint on ``train.best_metric`` and early stopping; its state lives in ``state.best``."""

    def __init__(self, tc, ckpt_root: Path, engine, state: TrainState):
        self.engine, self.state, self.patience = engine, state, tc.patience
        self.best = None
        if tc.best_metric:
            from scaletrain.eval.in_training import BestCheckpoint

            self.best = BestCheckpoint(ckpt_root, tc.best_metric, tc.best_mode, tc.patience, tc.best_min_delta)

    def restore(self) -> None:
        if self.best is not None and self.state.best:
            self.best.load_state_dict(self.state.best)

    def update(self, metrics: dict[str, float]) -> StopDecision:
        if self.best is None or self.best.metric not in metrics:
            return StopDecision(False, False)
        d = self.best.update(self.state.step, metrics)  # same metrics on every rank -> same decision
        self.state.best = self.best.state_dict()
        if d.stop and self.engine.is_main:
            log.info("early stop at step %d: %s best %.4f at step %d (patience %d)", self.state.step,
                     self.best.metric, d.best_value, d.best_step, self.patience)
        return StopDecision(d.improved, d.stop)

    def keep(self, saved: Path | None, decision: StopDecision) -> None:
        if decision.save and saved is not None:
            if self.engine.is_main:
                self.best.keep(saved)
            self.engine.barrier()
