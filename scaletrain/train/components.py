"""Components of the training loop; each decides its own timing and owns its state (torchtitan).

* :class:`StepLogger` - train loss/nll, LR, grad norm, throughput (target tokens/s, source+target tokens/s,
  bytes/s for the byte tokenizer), MFU (:mod:`scaletrain.train.mfu`), fp16 loss scale, MoE auxiliary
  loss, data-loader wait per step, peak memory (CUDA max allocated, or the process's peak RSS), ETA,
  routing statistics and (``engine.compile``) recompiles and CUDA graphs (:mod:`scaletrain.train.compile_stats`)
  every ``train.log_every`` updates (one log line on rank 0, metrics to the tracker). Between log lines
  it only adds on the device: no host synchronisation.
* :class:`ProgressDisplay` - rank 0 at a terminal: one live line (step / max_steps, loss, tokens/s, ETA
  within the wall-clock budget); the log lines print above it.
* :class:`Evaluator` - validation loss every ``train.valid_every`` updates and BLEU/chrF on the fixed
  validation subset every ``train.bleu_every`` updates.
* :class:`EarlyStopper` - best checkpoint on ``train.best_metric`` and early stopping after
  ``train.patience`` evaluations without improvement.

Each says when it is due (``due(step)``; checkpoints: :meth:`scaletrain.checkpoint.CheckpointManager.due`), so
the trainer reads a step's device values exactly on the steps some component reads them, without restating
their rules; every counter is in :class:`scaletrain.train.state.TrainState`.
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from scaletrain.data.loader import ShardLoader
from scaletrain.engine.model_prep import compile_on
from scaletrain.oom import OomPolicy
from scaletrain.train.compile_stats import compile_metrics
from scaletrain.train.mfu import MfuEstimator
from scaletrain.train.state import TimeBudget, TrainClock, TrainState
from scaletrain.train.unit import StepOutput, TranslationUnit, validation

log = logging.getLogger("scaletrain")


def fmt_secs(s: float) -> str:
    s = int(s)
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


class ProgressDisplay:
    """A tqdm line on rank 0 when stdout is a terminal and ``tracking.progress`` is on; else nothing.

    Cheap: ``step()`` is a counter increment (tqdm redraws at most every 0.5 s); loss, tokens/s and the ETA
    (the step-based estimate capped by the wall-clock budget left) come from the step logger's report
    every ``log_every`` updates. While it is shown, log lines go through ``tqdm.write`` (above the line)."""

    def __init__(self, enabled: bool, max_steps: int, start_step: int, budget_minutes: float = 0.0):
        self.bar = None
        self._stack = contextlib.ExitStack()
        if not enabled:
            return
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        desc = "train" + (f" (budget {fmt_secs(budget_minutes * 60)})" if budget_minutes else "")
        self.bar = tqdm(total=max_steps, initial=start_step, desc=desc, unit="step", file=sys.stdout,
                        mininterval=0.5, dynamic_ncols=True, leave=True,
                        bar_format="{desc}: {n_fmt}/{total_fmt} steps |{bar}| [{elapsed}{postfix}]")
        self._stack.enter_context(logging_redirect_tqdm())

    @classmethod
    def for_run(cls, cfg, engine, state) -> "ProgressDisplay":
        on = bool(cfg.tracking.progress) and engine.is_main and sys.stdout.isatty()
        return cls(on, cfg.train.max_steps, state.step, cfg.train.max_minutes)

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    @contextlib.contextmanager
    def task(self, total: int, desc: str):
        """A second, transient line for a long task inside training (in-training BLEU decoding): yields
        ``advance(n)``; nothing is shown when the training line is not."""
        if self.bar is None:
            yield lambda n: None
            return
        from tqdm import tqdm

        with tqdm(total=total, desc=desc, unit="line", file=sys.stdout, leave=False, position=1,
                  mininterval=0.5, dynamic_ncols=True) as sub:
            yield sub.update

    def report(self, loss: float, tokens_per_s: float, eta_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.3f}, {tokens_per_s:,.0f} tok/s, eta {fmt_secs(eta_s)}",
                                     refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._stack.close()


class StepLogger:
    """Accumulates each update's sums and reports every ``log_every`` updates (and at ``max_steps``)."""

    def __init__(self, log_every: int, max_steps: int, engine, unit: TranslationUnit, state: TrainState,
                 clock: TrainClock, budget: TimeBudget, tracker, byte_level: bool = False, mfu=None,
                 compiled: bool = False):
        self.log_every, self.max_steps = log_every, max_steps
        self.engine, self.unit, self.state = engine, unit, state
        self.compiled = compiled  # engine.compile on: compile/* metrics (recompiles, CUDA graphs)
        self.mfu = mfu  # MfuEstimator or None
        self.progress = ProgressDisplay(False, max_steps, 0)  # the trainer sets the real one in fit()
        self.byte_level = byte_level  # tokens are bytes: bytes/s = (source + target tokens)/s
        self.clock, self.budget, self.tracker = clock, budget, tracker
        self.loss_history: list[tuple[int, float]] = []  # (step, train loss) at each log line of this session
        self.last_routing: dict[str, float] = {}
        self.last_metrics: dict[str, float] = {}  # the last report's metrics (every rank)
        self.start()

    @classmethod
    def for_run(cls, cfg, engine, unit: TranslationUnit, state: TrainState, clock: TrainClock, budget: TimeBudget,
                tracker, vocab) -> "StepLogger":
        """Every ``train.log_every`` updates; bytes/s with the byte tokenizer; MFU (:mod:`scaletrain.train.mfu`);
        compile/* metrics where ``engine.compile`` is on."""
        return cls(cfg.train.log_every, cfg.train.max_steps, engine, unit, state, clock, budget, tracker,
                   byte_level=cfg.data.tokenizer == "byte", mfu=MfuEstimator.for_run(cfg, vocab.size, engine),
                   compiled=compile_on(cfg))

    def start(self) -> None:
        self._sums = None  # this rank's [loss, nll, target tokens] of the interval, summed on the device
        self._outs: list[StepOutput] = []  # the interval's updates (skip counts, read at the report)
        self._tok = self._src = self._steps = self._examples = 0
        self._wait = 0.0
        self._t_log = time.time()
        self._steps_at_start = self.state.step

    def due(self, step: int) -> bool:
        """A report after ``step``: every ``log_every`` updates and at ``max_steps``."""
        return step % self.log_every == 0 or step == self.max_steps

    def after_step(self, out: StepOutput, data_wait: float = 0.0) -> None:
        """``data_wait``: seconds this step waited for its batches (the data loader). No host read here: the
        loss sums are added on the device (float64, step order) and read at the report."""
        self._wait += data_wait
        self._steps += 1
        self._src += out.global_src_tokens
        sums = out.sums if torch.is_tensor(out.sums) else torch.tensor(out.sums, dtype=torch.float64)
        self._sums = sums if self._sums is None else self._sums + sums.to(self._sums.device)
        self._examples += out.examples
        self._tok += out.global_tokens
        self._outs.append(out)
        self.progress.step()
        if self.due(self.state.step):
            self._report(out)

    def _eta(self) -> float:
        per_step = self.clock.session_seconds() / max(self.state.step - self._steps_at_start, 1)
        return min((self.max_steps - self.state.step) * per_step, self.budget.left())

    def _report(self, out: StepOutput) -> None:
        eng, st, info = self.engine, self.state, out.info
        aux_sum, aux_n = self.unit.aux_loss(reset=True)
        loss, nll, ntok = self._sums.tolist() if self._sums is not None else (0.0, 0.0, 0.0)
        skipped = sum(int(o.info.skipped and not o.info.nonfinite and not o.oom) for o in self._outs)
        l, nl, nt, ex, aux_sum, aux_n = eng.parallel.all_reduce_sum([loss, nll, ntok, self._examples, aux_sum, aux_n])
        elapsed = max(time.time() - self._t_log, 1e-9)
        tps = self._tok / elapsed
        metrics = {
            "train/loss": l / max(nt, 1), "train/nll": nl / max(nt, 1), "train/lr": info.lr,
            "train/grad_norm": info.grad_norm, "train/tokens_per_s": tps,
            "train/src_tgt_tokens_per_s": (self._tok + self._src) / elapsed,
            "train/tokens_seen": st.tokens_seen, "train/skipped_steps": float(st.skipped_steps),
            "train/nonfinite_steps": float(st.nonfinite_steps), "train/oom_steps": float(st.oom_steps),
            "train/data_wait_s": self._wait / max(self._steps, 1),  # per step, this rank
            "train/data_wait_frac": self._wait / elapsed,
            **peak_memory(eng.device),
        }
        if self.byte_level:
            metrics["train/bytes_per_s"] = metrics["train/src_tgt_tokens_per_s"]
        if self.compiled:
            metrics.update(compile_metrics())
        if ex > 0:  # mean sentence-pair lengths of the interval (non-pad tokens), all ranks
            metrics["train/mean_src_len"], metrics["train/mean_tgt_len"] = self._src / ex, self._tok / ex
            if self.mfu is not None:
                metrics.update(self.mfu.metrics(tps, self._src / ex, self._tok / ex))
        scale = eng.loss_scale() if eng.is_main else None
        if scale is not None:
            metrics["train/loss_scale"] = scale
        if aux_n:
            metrics["train/moe_aux_loss"] = aux_sum / aux_n
        self.loss_history.append((st.step, metrics["train/loss"]))
        self.last_metrics = metrics
        if eng.is_main:
            skipped = (f" | skipped {skipped} (fp16 overflow; {st.skipped_steps} in all)" if skipped else "")
            mfu = f" | mfu {100 * metrics['train/mfu']:.1f}%" if "train/mfu" in metrics else ""
            log.info("step %6d | loss %.4f | nll %.4f | lr %.3e | gnorm %.3f | %8.0f tgt tok/s%s | eta %s%s",
                     st.step, metrics["train/loss"], metrics["train/nll"], info.lr, info.grad_norm, tps, mfu,
                     fmt_secs(self._eta()), skipped)
            self.progress.report(metrics["train/loss"], tps, self._eta())
            self.tracker.log_metrics(metrics, step=st.step)
        routing = self.unit.routing()  # MoCE: expert shares, mean radius
        self.last_routing = routing
        if eng.is_main and routing:
            self.tracker.log_metrics(routing, step=st.step)
        self._sums, self._outs = None, []
        self._tok = self._src = self._steps = self._examples = 0
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
    """Validation loss every ``valid_every`` updates (at most ``valid_max_batches`` batches of the ``data``
    section's valid split) and BLEU/chrF every ``bleu_every`` (``bleu``: a ``BleuValidator``), on every rank;
    rank 0 reports. ``build_model()``: a decoding copy of the model (every expert in this process)."""

    def __init__(self, engine, unit: TranslationUnit, vocab, state: TrainState, tracker, build_model: Callable, *,
                 data, valid_every: int, valid_max_batches: int, bleu_every: int = 0, bleu=None,
                 oom: OomPolicy | None = None):
        self.engine, self.unit, self.vocab, self.state = engine, unit, vocab, state
        self.tracker, self.build_model, self.data = tracker, build_model, data
        self.valid_every, self.valid_max_batches, self.bleu_every = valid_every, valid_max_batches, bleu_every
        self.progress: ProgressDisplay | None = None  # the trainer's display, for in-training BLEU's own line
        self.bleu = bleu
        self.oom = oom or OomPolicy("stop", data.max_tokens, engine.world_size)

    @classmethod
    def for_run(cls, cfg, engine, unit: TranslationUnit, vocab, state: TrainState, tracker,
                build_model: Callable) -> "Evaluator":
        """The BLEU set (``eval.valid_lines`` per direction) is read where ``train.bleu_every`` is set."""
        bleu = None
        if cfg.train.bleu_every:
            from scaletrain.eval.in_training import BleuValidator

            bleu = BleuValidator.for_run(cfg, vocab, cfg.eval.valid_lines)
        tc = cfg.train
        return cls(engine, unit, vocab, state, tracker, build_model, data=cfg.data, valid_every=tc.valid_every,
                   valid_max_batches=tc.valid_max_batches, bleu_every=tc.bleu_every, bleu=bleu,
                   oom=OomPolicy(tc.on_oom, cfg.data.max_tokens, engine.world_size))

    def _every(self, n: int, step: int) -> bool:
        return bool(n) and step % n == 0

    def due(self, step: int) -> bool:
        """Validation or BLEU after ``step``."""
        return self._every(self.valid_every, step) or self._every(self.bleu_every, step)

    def after_step(self) -> dict[str, float]:
        step = self.state.step
        metrics: dict[str, float] = {}
        if self._every(self.valid_every, step):
            metrics["valid/nll"] = self.validation_loss()
        if self._every(self.bleu_every, step):
            metrics.update(self.bleu_scores())
        return metrics

    def validation_loss(self) -> float:
        d, eng = self.data, self.engine
        stream = ShardLoader.for_run(d, "valid", parallel=eng.parallel, vocab=self.vocab)
        oom = self.oom  # a batch out of memory: stop naming it, or leave it out
        res = validation(eng, self.unit, stream, self.valid_max_batches, oom=oom,
                         where=f"validation at step {self.state.step}")
        v = res.nll
        self.state.valid_history.append((self.state.step, v))
        if eng.is_main:
            log.info("step %6d | valid nll %.4f (%.3f bits/byte)", self.state.step, v, v / math.log(2))
            metrics = {"valid/nll": v}
            if oom.mode == "skip":
                metrics["valid/oom_batches"] = float(res.oom_batches)
            if res.oom_batches:
                log.warning("step %d: %d validation batch(es) ran out of memory and were left out (train.on_oom=skip); "
                            "%s (data.max_tokens=%d)", self.state.step, res.oom_batches,
                            f"valid nll is over the {res.batches} that ran" if res.batches else
                            "none ran: valid nll is NaN, never a best", self.data.max_tokens)
            self.tracker.log_metrics(metrics, step=self.state.step)
        return v

    def bleu_scores(self) -> dict[str, float]:
        eng, dp = self.engine, self.engine.parallel  # the lines are split over the ranks (all data parallel)
        model = eng.inference_module(self.build_model)  # collective where parameters are partitioned
        shown = self.progress or ProgressDisplay(False, 0, 0)
        with shown.task(len(self.bleu.share(dp.rank, dp.world_size)), "valid BLEU (rank 0's lines)") as advance:
            res = self.bleu.run(model, rank=dp.rank, world_size=dp.world_size, group=None,
                                progress=advance)  # collective (all_gather_object over every rank)
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

    def __init__(self, best, engine, state: TrainState):
        """``best``: a :class:`scaletrain.eval.in_training.BestCheckpoint`, or None (no best metric)."""
        self.engine, self.state, self.best = engine, state, best
        self.patience = best.patience if best is not None else 0

    @classmethod
    def for_run(cls, cfg, ckpt_root: Path, engine, state: TrainState) -> "EarlyStopper":
        best = None
        if cfg.train.best_metric:
            from scaletrain.eval.in_training import BestCheckpoint

            best = BestCheckpoint.for_run(cfg, ckpt_root)
        return cls(best, engine, state)

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
            self.engine.parallel.barrier()
