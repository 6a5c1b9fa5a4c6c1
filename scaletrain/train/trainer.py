"""The one training loop. Engine-agnostic: DeepSpeed or Accelerate behind `scaletrain.engine.Engine`.

:meth:`Trainer.fit` is a short orchestration over components (``scaletrain/train/components.py``):
the train step and the NMT unit (``unit.py``), the step logger, the evaluator, the early stopper and the
checkpoints (``CheckpointManager``, handed the checkpoint's contents when one is due). Every counter lives
in one :class:`TrainState` (``state.py``) that each checkpoint saves, so a resumed job continues its
counters, its validation history, its best checkpoint, its MLflow run and its wall-clock budget. What the job records for MLflow besides its per-step
metrics (the run, its tags and set-up artifacts, system metrics, checkpoints, plots, the end status) is the
:class:`~scaletrain.train.recorder.RunRecorder`'s.
"""
from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from scaletrain.checkpoint import CheckpointContents, CheckpointManager, latest_tag
from scaletrain.checkpoint.compat import check_resume, corpus_record
from scaletrain.checkpoint.warm_start import warm_start
from scaletrain.config import Config, dump_yaml
from scaletrain.data.loader import ShardLoader, auto_num_workers
from scaletrain.data.position import states_for_layout
from scaletrain.data.shards import load_manifest
from scaletrain.data.sources import run_source
from scaletrain.data.spm_models import load_shard_vocab
from scaletrain.engine import Engine, build_engine
from scaletrain.engine.env import Peers, elastic_join_note
from scaletrain.engine.heartbeat import start_heartbeat
from scaletrain.engine.shared_dir import check_shared_run_dir
from scaletrain.errors import ScaletrainError
from scaletrain.models import build_model, count_parameters
from scaletrain.models.memory import apply_max_tokens, reuse_max_tokens
from scaletrain.oom import OomPolicy, as_oom, is_oom
from scaletrain.train.baseline import unigram_nll
from scaletrain.train.global_batch import plan_for_run
from scaletrain.train.components import EarlyStopper, Evaluator, ProgressDisplay, StepLogger
from scaletrain.train.nonfinite import NonfiniteGuard
from scaletrain.train.sync_count import step_range
from scaletrain.train.state import SaveTimer, TimeBudget, TrainClock, TrainState
from scaletrain.train.preemption import PREEMPTED_FILE, Preemption
from scaletrain.train.recorder import RunRecorder
from scaletrain.train.prefetch import Prefetcher
from scaletrain.train.unit import StopVote, TranslationUnit, resolve_outputs, train_step

log = logging.getLogger("scaletrain")
MAX_PENDING = 64  # updates whose device values wait for a read at most (their host batches are kept for the dumps)


@dataclass
class TrainResult:
    steps: int
    tokens: int
    valid_nll: list[tuple[int, float]]  # (step, nats per target token)
    train_loss: list[tuple[int, float]]  # (step, label-smoothed loss per target token) at each log line
    unigram_nll: float
    train_seconds: float  # training-loop wall time of the whole job (all sessions)
    run_id: str | None
    out_dir: str
    final_checkpoint: str
    preempted: bool = False  # stopped by SIGTERM/SIGUSR1/SIGINT after writing final_checkpoint


def rederived_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of ``rank`` after a resume at another world size at ``step`` (deterministic)."""
    return (seed * 1_000_003 + step * 8_191 + rank) % 2**63


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """``engine``: an Engine to train with (default: built from ``cfg.engine``). ``stream``: optional batch
    source replacing the shard stream (an iterable of Batch with ``state_dict()``/``load_state_dict()``),
    e.g. a fixed replay in equivalence tests."""

    def __init__(self, cfg: Config, engine: Engine | None = None, stream=None):
        self.cfg = cfg
        seed_everything(cfg.train.seed)
        # the run's global batch at this world size: engine.grad_accum re-derived before the engine reads it
        world = engine.world_size if engine is not None else int(os.environ.get("WORLD_SIZE") or 1)
        rank = engine.rank if engine is not None else int(os.environ.get("RANK") or 0)
        self.batch_plan = plan_for_run(cfg, world, is_main=rank == 0)
        if engine is not None:
            engine.grad_accum = cfg.engine.grad_accum
        self.engine = eng = engine if engine is not None else build_engine(cfg)
        check_shared_run_dir(cfg.out_dir, eng.rank, eng.world_size)  # every host sees it, or one line, exit 2
        self.manifest = load_manifest(run_source(cfg.data))
        self.vocab = load_shard_vocab(self.manifest.languages, cfg.data.tokenizer, cfg.data.shards,
                                      vocab_size=cfg.data.spm_vocab_size)
        torch.manual_seed(cfg.train.seed)  # same init on every rank
        model = self.build_model()
        init_from = warm_start(cfg, model, self.vocab, is_main=eng.is_main)  # train.init_from: weights only
        self.param_counts = count_parameters(model, eng.parallel.ep_size)  # the whole model, every expert
        eng.setup(model)
        self._resolve_max_tokens()
        self.stream = stream if stream is not None else ShardLoader.for_run(
            cfg.data, "train", parallel=eng.parallel, grad_accum=cfg.engine.grad_accum, vocab=self.vocab,
            num_workers=self._num_workers())
        self.out_dir = cfg.out_dir
        # what every checkpoint carries unchanged, made once (a resume may settle the config: _fit makes it again)
        self.corpus = corpus_record(self.manifest.to_dict(), cfg.data.shards)
        self.config_yaml = dump_yaml(cfg)
        self.state = TrainState(init_from=init_from)
        self.clock = TrainClock(self.state)
        self._components(cfg, eng)
        self.prefetcher: Prefetcher | None = None  # made in fit()
        self._pending: list = []  # (step, StepOutput, host batches, stream position) not yet read (_settle)
        self.peers = Peers(eng.rank, eng.world_size)  # who is where: named in the line when a peer dies
        self.preempted = False
        # a lost host (killed, cut off) stops every rank within engine.peer_timeout_s, named (heartbeat.py)
        self.heartbeat = start_heartbeat(cfg, eng.rank, eng.world_size, self.peers.table, self._resume_note)
        if eng.is_main and (note := elastic_join_note()):  # torchrun by hand: growing back would hang
            log.warning(note)

    def _components(self, cfg: Config, eng: Engine) -> None:
        """The components around the step, each given the keys it uses (``X.for_run(cfg, ...)`` where building
        one computes something from the config: the step logger's MFU peak, the evaluator's BLEU set, the best
        checkpoint's tracker)."""
        tc, st = cfg.train, self.state
        self.budget = TimeBudget(tc.max_minutes, st)
        self.save_timer = SaveTimer(tc.save_every_minutes, st)
        self.ckpt = CheckpointManager(cfg.out_dir, eng, tc.keep_last, save_every=tc.save_every,
                                      on_save_error=tc.on_save_error)
        self.recorder = RunRecorder(cfg, eng, self.out_dir)
        self.tracker = self.recorder.tracker  # re-done steps after a crash are not logged twice (Tracker.replaying_until)
        self.unit = TranslationUnit(eng, cfg.optim.label_smoothing, self.vocab.pad, self.vocab.langs)
        self.logger = StepLogger.for_run(cfg, eng, self.unit, st, self.clock, self.budget, self.tracker, self.vocab)
        self.evaluator = Evaluator.for_run(cfg, eng, self.unit, self.vocab, st, self.tracker,
                                           lambda: self.build_model(expert_parallel=False))
        self.stopper = EarlyStopper.for_run(cfg, self.ckpt.root, eng, st)
        self.preemption = Preemption(tc.preempt_grace_seconds)
        self.nonfinite = NonfiniteGuard(tc.nonfinite, tc.max_nonfinite, cfg.out_dir, eng, st, self.vocab)
        self.oom = OomPolicy(tc.on_oom, cfg.data.max_tokens, eng.world_size)  # the resolved max_tokens

    def _resolve_max_tokens(self) -> None:
        """``data.max_tokens: auto`` -> a number, recorded in the config: this device's estimate, or, on a resume,
        the budget the checkpoint was written with (a resume on other GPUs keeps it: the data stream resumes
        exactly only with it; one line where it exceeds this device's estimate)."""
        cfg = self.cfg
        auto = cfg.data.max_tokens == "auto"
        apply_max_tokens(cfg, self.vocab.size, self.engine.device)
        saved = self._saved_max_tokens() if auto and cfg.train.resume else None
        said = reuse_max_tokens(cfg, saved) if saved is not None else None
        if said is not None and self.engine.is_main:
            line, fits = said
            (log.info if fits else log.warning)("%s", line)

    def _saved_max_tokens(self) -> int | None:
        """The token budget of the checkpoint a resume will read (``latest``; None: none, or one from before
        checkpoints recorded it)."""
        root = Path(self.cfg.out_dir) / "checkpoints"
        try:
            tag = latest_tag(root)
        except ScaletrainError:
            return None  # the resume (resume_tag) says what is wrong, or falls back
        if tag is None:
            return None
        state = json.loads((root / tag / "trainer_state.json").read_text())
        return int(state["max_tokens"]) if state.get("max_tokens") else None

    def _num_workers(self) -> int:
        nw = self.cfg.data.num_workers
        if nw != "auto":
            return int(nw)
        # ranks on this node: torchrun / accelerate set LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
        n, why = auto_num_workers(self.engine.device.type, self.cfg.data.shards, local, os.cpu_count() or 1,
                                  threads=torch.get_num_threads())
        if self.engine.is_main:
            log.info("data.num_workers auto -> %d: %s", n, why)
        return n

    def build_model(self, expert_parallel: bool = True) -> torch.nn.Module:
        """The model; ``expert_parallel=False``: every expert in this process (decoding copies)."""
        return build_model(self.cfg.model, self.vocab.size, pieces=self.vocab.pieces(), moe=self.cfg.moe,
                           parallel=self.engine.parallel if expert_parallel else None)

    # ------------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        try:
            return self._fit()
        except Exception as e:
            self._explain(e)
            raise
        finally:
            if self.heartbeat is not None:  # finished or failed: the peers stop watching this rank
                self.heartbeat.done()

    def _explain(self, e: Exception) -> None:
        """Raise the one-line error for ``e`` (out of memory, a lost peer); return where there is none."""
        if is_oom(e):  # one line (its stage's, else the step's) ending with the checkpoint a re-run resumes from
            line = as_oom(e, f"training step {self.state.step + 1}", "lower data.max_tokens", self.engine.device)
            line.after = line.after or self._resume_note()
            if line is e:
                raise
            raise line from e
        # a collective failed because a peer died or hung: one line naming it, exit code 76 (retry)
        err = self.peers.explain(e, self.heartbeat, self._resume_note())
        if err is not None:
            raise err from None

    def _resume_note(self) -> str:
        """What a failed job leaves: nothing written since the last checkpoint, which a re-run resumes from."""
        try:
            tag = self.ckpt.latest()
        except ScaletrainError:
            tag = None
        if tag is None:
            return "no checkpoint was written yet: re-run the same command to start again"
        return f"the last checkpoint, {self.ckpt.root / tag}, is intact and the newest: re-run the same command to resume"

    def _fit(self) -> TrainResult:
        st, eng = self.state, self.engine
        self._resume()  # first: a checkpoint this run may not resume is refused before anything is changed
        self.config_yaml = dump_yaml(self.cfg)  # the config as resumed, which every checkpoint of this job holds
        if eng.is_main:
            self.ckpt.remove_stale_partials()  # left by a crash or a failed save
            (Path(self.out_dir) / PREEMPTED_FILE).unlink(missing_ok=True)
        eng.parallel.barrier()
        st.run_id = self.recorder.start(st.run_id, lambda: st.step, manifest=self.manifest,
                                        vocab_size=self.vocab.size, param_counts=self.param_counts)
        baseline = self._baseline()
        if self.cfg.train.valid_every and st.step == 0:
            self.evaluator.validation_loss()  # the start of the validation curve
        self.prefetcher = Prefetcher(self.stream, iter(self.stream), self.cfg.engine.grad_accum, eng.device)
        self._pending = []
        if st.step < self.cfg.train.max_steps:
            self.prefetcher.fetch()  # the first step's batches (opening the stream: outside the step ranges)
        self.preemption.install()
        eng.train(True)
        self.clock.start()
        self.logger.start()
        self.logger.progress = ProgressDisplay.for_run(self.cfg, eng, st)  # closed by _finish / close
        self.evaluator.progress = self.logger.progress
        while st.step < self.cfg.train.max_steps:
            with step_range(st.step + 1):  # torch.profiler range: host reads per step (sync_count.py)
                if self._iteration():
                    break
        return self._finish(baseline)

    def _iteration(self) -> bool:
        """One update and the components after it; True when the loop must stop.

        No host synchronisation outside log/validation/save steps: the update's values (loss sums, norm,
        non-finite flag) stay on the device and are read in one go by :meth:`_settle` on those steps
        (and at least every ``MAX_PENDING`` updates); the next step's batches are read and moved while
        this one computes (``prefetch.py``)."""
        st, eng, tc = self.state, self.engine, self.cfg.train
        got = self.prefetcher.take()
        out = train_step(eng, self.unit, got.micro, stop_vote=self.budget.exceeded(),
                         preempt_vote=self.preemption.requested,
                         save_vote=eng.is_main and self.save_timer.due(), oom=self.oom)
        if isinstance(out, StopVote):  # budget spent or preempted (all ranks agree)
            self.preempted = out.preempted
            self.stream.load_state_dict(got.position)  # unread: the checkpoint resumes with these batches
            return True
        if st.step + 1 < tc.max_steps:
            self.prefetcher.fetch()  # the next step's batches, while the device works on this one
        st.step += 1
        st.tokens_seen += out.global_tokens
        st.examples_seen += out.examples
        if out.oom:
            st.oom_steps += 1
            log.warning("rank %d: step %d ran out of device memory on a batch of %s (data.max_tokens=%d); update "
                        "skipped (train.on_oom=skip, %d in all)", eng.rank, st.step, out.oom, self.cfg.data.max_tokens,
                        st.oom_steps)
        self.clock.tick()
        self._pending.append((st.step, out, got.host, got.position))
        if self._settle_due(out):
            self._settle()  # raises to stop on a non-finite update (every rank, same step)
        self.logger.after_step(out, got.wait)
        decision = self.stopper.update(self.evaluator.after_step())
        saved = self.save() if decision.save or out.save_due or self.ckpt.due(st.step) else None
        self.recorder.record_checkpoint(saved, st.step)
        self.stopper.keep(saved, decision)
        return decision.stop

    def _settle_due(self, out) -> bool:
        """A step whose components read this update's values (each says when it is due: log, validation, save),
        the last one, a save voted for, or ``MAX_PENDING`` updates unread."""
        step = self.state.step
        return (len(self._pending) >= MAX_PENDING or step >= self.cfg.train.max_steps or out.save_due
                or self.logger.due(step) or self.evaluator.due(step) or self.ckpt.due(step))

    def _settle(self) -> None:
        """Read the pending updates' device values in one go; count fp16-skipped updates and apply the NaN/inf
        policy to each, in step order (``nonfinite.py``)."""
        pending, self._pending = self._pending, []
        resolve_outputs([out for _, out, _, _ in pending])
        for step, out, host, position in pending:
            self.state.skipped_steps += int(out.info.skipped and not out.info.nonfinite and not out.oom)
            self.nonfinite.after_step(out, host, position, step=step)

    def _finish(self, baseline: float) -> TrainResult:
        st = self.state
        self._settle()
        self.logger.progress.close()
        skipped = getattr(self.stream, "skipped_blocks", 0)
        if skipped:
            log.warning("rank %d skipped %d corrupt shard block(s) (data.on_corrupt=skip; see the warnings above)",
                        self.engine.rank, skipped)
        if self.preempted:  # no validation: the grace period is for the checkpoint
            self.preemption.cancel_grace()
            if self.engine.is_main:
                log.info("preempted (%s) at step %d: writing a checkpoint; re-run the same command to resume",
                         self.preemption.signal_name or "signal on another rank", st.step)
        elif not st.valid_history or st.valid_history[-1][0] != st.step:
            self.evaluator.validation_loss()
        final = self.save()
        self.recorder.record_checkpoint(final, st.step)
        if self.preempted and self.engine.is_main:  # launch.sh reads it: the launchers exit 1 on a signal
            (Path(self.out_dir) / PREEMPTED_FILE).write_text(json.dumps(
                {"step": st.step, "checkpoint": str(final), "signal": self.preemption.signal_name}))
        self.recorder.finish(step=st.step, train_seconds=st.train_seconds, run_id=st.run_id,
                             preempted=self.preempted)
        return TrainResult(
            steps=st.step, tokens=st.tokens_seen, valid_nll=list(st.valid_history),
            train_loss=list(self.logger.loss_history), unigram_nll=baseline, train_seconds=st.train_seconds,
            run_id=st.run_id, out_dir=str(self.out_dir), final_checkpoint=str(final), preempted=self.preempted,
        )

    # ------------------------------------------------------------------------------
    def _checkpoint_contents(self) -> CheckpointContents:
        self.save_timer.saved()  # any checkpoint restarts the save_every_minutes interval (and records it)
        trainer_state = {**self.state.state_dict(), "world_size": self.engine.world_size, "recipe": self.cfg.name,
                         "max_tokens": int(self.cfg.data.max_tokens),  # what a resume of data.max_tokens: auto reuses
                         "global_batch_slots": self.batch_plan.slots, "grad_accum_asked": self.batch_plan.asked,
                         "corpus": self.corpus}
        return CheckpointContents(trainer_state=trainer_state, rank_state={"stream": self._stream_position()},
                                  config_yaml=self.config_yaml, langs=self.vocab.langs, vocab=self.vocab)

    def _stream_position(self):
        """Where a resume reads on: before the first batches no update has used (read-ahead ones included)."""
        prefetcher = getattr(self, "prefetcher", None)
        return prefetcher.resume_position() if prefetcher is not None else self.stream.state_dict()

    def save(self) -> Path | None:
        """A checkpoint of the current step (collective); None where it failed under train.on_save_error=continue."""
        return self.ckpt.save(self.state.step, self._checkpoint_contents())

    def _resume(self) -> None:
        if not self.cfg.train.resume:
            return
        tag = self.ckpt.resume_tag(self.cfg.train.on_corrupt_checkpoint)  # verified against its index.json
        if tag is None:
            return
        fits = check_resume(self.ckpt.root / tag, self.cfg, self.vocab,  # a refusal comes before any load or write
                            self.corpus, is_main=self.engine.is_main)
        loaded = self.ckpt.load(tag)
        self.state.load_state_dict(loaded.trainer_state)
        self.stopper.restore()
        eng = self.engine  # the same world: only this rank's state was read
        old_world = eng.world_size if loaded.same_world else len(loaded.rank_states)
        if fits.other_corpus:  # train.resume_other_corpus: another corpus is read from its start
            pass
        elif loaded.same_world:
            self.stream.load_state_dict(loaded.rank_states[0]["stream"])
        else:  # another layout: the same global batches where the slot count holds (data/position.py)
            dp = eng.parallel
            streams = states_for_layout([s["stream"] for s in loaded.rank_states], dp.world_size,
                                        self.cfg.engine.grad_accum)
            self.stream.load_state_dict(streams[dp.rank])
        if not loaded.same_world:
            seed_everything(rederived_seed(self.cfg.train.seed, self.state.step, eng.rank))
        self.recorder.resumed_at(self.state.step, old_world)
        if eng.is_main:
            log.info("resumed from %s at step %d", self.ckpt.root / tag, self.state.step)
            if not loaded.same_world:
                log.info("the checkpoint was written by %d rank(s), this run has %d: weights, optimizer state and LR "
                         "schedule carried; each rank's RNG streams re-derived from train.seed, the step and the "
                         "rank (the old ranks' streams cannot be split)", old_world, eng.world_size)

    def _baseline(self) -> float:
        cfg, eng = self.cfg, self.engine
        shards = run_source(cfg.data)  # a directory, URL or pipe: command
        base_nll = unigram_nll(shards, vocab=self.vocab, on_corrupt=cfg.data.on_corrupt) if eng.is_main else 0.0
        base_nll = eng.parallel.broadcast_object(base_nll)
        if eng.is_main:
            n_params = self.param_counts.get("total", 0)
            log.info("training %s: %d ranks on %s, %s params, %s, target-unigram valid nll %.3f",
                     cfg.name, eng.world_size, eng.device, f"{n_params:,}", cfg.engine.precision, base_nll)
            self.tracker.log_metrics({"baseline/unigram_valid_nll": base_nll}, step=self.state.step)
        return base_nll

    def close(self, status: str = "FINISHED", reason: str = "") -> None:
        """End the job's record with ``status``; ``reason``: why it failed (the run's ``failure`` tag)."""
        self.logger.progress.close()
        try:  # the handlers stay until the run has ended: the launcher's own SIGTERM must not kill us mid-way
            if self.prefetcher is not None:
                self.prefetcher.close()  # the data loader's workers
            self.recorder.close("KILLED" if self.preempted and status == "FINISHED" else status, reason)
        finally:
            self.preemption.uninstall()
            if self.heartbeat is not None:  # a trainer closed without fit (or after it): the threads end here
                self.heartbeat.done()


def train(cfg: Config) -> TrainResult:
    """Train; a preempted job returns with ``result.preempted`` (checkpoint written, MLflow run KILLED):
    ``scaletrain train`` then exits with :data:`scaletrain.train.preemption.PREEMPTED_EXIT`."""
    trainer = Trainer(cfg)
    try:
        result = trainer.fit()
    except BaseException as e:
        killed = isinstance(e, KeyboardInterrupt)
        first = (str(e).strip().splitlines() or [""])[0]
        reason = "" if killed else str(e) if isinstance(e, ScaletrainError) else f"{type(e).__name__}: {first}"
        trainer.close("KILLED" if killed else "FAILED", reason)
        raise
    trainer.close("FINISHED")
    if trainer.engine.is_main:
        summary = Path(result.out_dir) / "train_summary.json"
        summary.write_text(json.dumps(result.__dict__, indent=2))
    return result
