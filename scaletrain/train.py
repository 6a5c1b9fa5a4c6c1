"""The one training loop. Engine-agnostic: DeepSpeed or Accelerate behind `scaletrain.engine.Engine`.

Loss normalisation: each rank computes *summed* label-smoothed CE over its micro-batches; the loop
all-reduces the number of target tokens of the whole step (all ranks, all micro-batches) first and
scales each micro-batch loss so that, after the engine's averaging over ranks and accumulation
steps, the gradient is d(sum of losses)/d(theta) / (global target tokens).
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from scaletrain.checkpoint import CheckpointManager
from scaletrain.config import Config, dump_yaml, flatten, to_dict
from scaletrain.data.batch import Batch
from scaletrain.data.shards import load_manifest
from scaletrain.data.stream import ShardLoader, ShardStream
from scaletrain.engine import build_engine
from scaletrain.models import build_model, count_parameters
from scaletrain.models.loss import label_smoothed_ce
from scaletrain.models.routing_stats import routing_metrics
from scaletrain.vocab import load_vocab

log = logging.getLogger("scaletrain")


@dataclass
class TrainResult:
    steps: int
    tokens: int
    valid_nll: list[tuple[int, float]]  # (step, nats per target token)
    train_loss: list[tuple[int, float]]  # (step, label-smoothed loss per target token) at each log line
    unigram_nll: float
    train_seconds: float
    run_id: str | None
    out_dir: str
    final_checkpoint: str


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def unigram_nll(shards: str, split: str = "valid", vocab=None, max_examples: int = 200_000) -> float:
    """Cross-entropy (nats/token) of `split` targets under a target-side unigram model fit on train.

    The bar a model must clear to show it uses the source at all (add-one smoothing; EOS counted).
    Tokens are bytes, or the subword pieces of ``vocab`` when it is a SentencePiece vocabulary. The
    unigram is fit on the first ``max_examples`` training pairs and scored on as many ``split`` pairs
    (the whole split of the bundled corpus; a bounded pass on OPUS-scale data).
    """
    from itertools import islice

    from scaletrain.data.shards import read_split

    spm = vocab is not None and getattr(vocab, "kind", "byte") != "byte"

    def ids(exs) -> list[np.ndarray]:
        if spm:
            return [a.astype(np.int64) for a in vocab.encode_batch([ex.tgt for ex in exs])]
        return [np.frombuffer(ex.tgt, dtype=np.uint8).astype(np.int64) for ex in exs]

    n_ids = vocab.size if spm else 256
    eos = vocab.eos if spm else 256
    counts = np.ones(n_ids + (0 if spm else 1), dtype=np.float64)  # + EOS (bytes: index 256)
    for a in ids(list(islice(read_split(shards, "train"), max_examples))):
        counts += np.bincount(a, minlength=len(counts))
        counts[eos] += 1
    logp = np.log(counts / counts.sum())
    tot, n = 0.0, 0
    for a in ids(list(islice(read_split(shards, split), max_examples))):
        tot -= logp[a].sum() + logp[eos]
        n += len(a) + 1
    return float(tot / max(n, 1))


class Trainer:
    """``stream``: optional batch source replacing the shard stream (an iterable of Batch with
    ``state_dict()``/``load_state_dict()``), e.g. a fixed replay in equivalence tests."""

    def __init__(self, cfg: Config, stream=None):
        self.cfg = cfg
        seed_everything(cfg.train.seed)
        self.engine = build_engine(cfg)
        eng = self.engine
        self.manifest = load_manifest(cfg.data.shards)
        self.vocab = load_vocab(self.manifest.languages, cfg.data.tokenizer, cfg.data.shards,
                                vocab_size=cfg.data.spm_vocab_size)
        torch.manual_seed(cfg.train.seed)  # same init on every rank
        model = build_model(cfg.model, self.vocab.size, pieces=self.vocab.pieces())
        self.param_counts = count_parameters(model)
        eng.setup(model)
        self.stream = stream if stream is not None else ShardLoader(
            cfg.data.shards, "train", rank=eng.rank, world_size=eng.world_size, num_workers=cfg.data.num_workers,
            seed=cfg.data.seed, max_tokens=cfg.data.max_tokens, max_bytes=cfg.data.max_bytes,
            buffer_size=cfg.data.buffer_size, temperature=cfg.data.temperature, vocab=self.vocab,
        )
        self.out_dir = cfg.out_dir
        self.ckpt = CheckpointManager(self.out_dir, eng, cfg.train.keep_last)
        from scaletrain.eval.in_training import BestCheckpoint, BleuValidator

        tc = cfg.train
        self.bleu = BleuValidator.from_config(cfg, self.vocab, cfg.eval.valid_lines) if tc.bleu_every else None
        self.best = BestCheckpoint(
            self.ckpt.root, tc.best_metric, tc.best_mode, tc.patience, tc.best_min_delta
        ) if tc.best_metric else None
        self.step = 0
        self.tokens_seen = 0
        self.examples_seen = 0
        self.skipped_steps = 0  # fp16 overflow: updates the engine skipped (loss scale lowered)
        self.run_id: str | None = None
        self.valid_history: list[tuple[int, float]] = []
        self.loss_history: list[tuple[int, float]] = []
        self.last_routing: dict[str, float] = {}  # MoCE routing metrics of the last log line
        self.tracker = None

    # ------------------------------------------------------------------------------
    def _start_tracking(self, resumed_run_id: str | None) -> None:
        from scaletrain.tracking import Tracker, broadcast_run_id

        cfg = self.cfg
        eng = self.engine
        enabled = cfg.tracking.enabled
        self.tracker = Tracker(
            uri=cfg.tracking.uri or None, experiment=cfg.tracking.experiment,
            run_name=cfg.tracking.run_name or cfg.name, is_main=eng.is_main and enabled, project_dir=Path.cwd(),
        )
        run_id = None
        if eng.is_main and enabled:
            if resumed_run_id:
                self.tracker.resume(resumed_run_id)
                run_id = resumed_run_id
            else:
                params = flatten(to_dict(cfg))
                params.update({"world_size": eng.world_size, "vocab_size": self.vocab.size})
                params.update({f"params.{k}": v for k, v in self.param_counts.items()})
                run_id = self.tracker.start(params, tags={"recipe": cfg.name})
                self.tracker.log_text(dump_yaml(cfg), "config.yaml")
        self.run_id = broadcast_run_id(run_id, eng.is_main)

    def _maybe_resume(self) -> str | None:
        if not self.cfg.train.resume:
            return None
        tag = self.ckpt.latest()
        if tag is None:
            return None
        state, rank_state = self.ckpt.load(tag)
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.examples_seen = state["examples_seen"]
        self.skipped_steps = state.get("skipped_steps", 0)
        self.valid_history = [tuple(x) for x in state.get("valid_history", [])]
        if self.best is not None and state.get("best"):
            self.best.load_state_dict(state["best"])
        self.stream.load_state_dict(rank_state["stream"])
        if self.engine.is_main:
            log.info("resumed from %s at step %d", self.ckpt.root / tag, self.step)
        return state.get("run_id")

    def save(self) -> Path:
        state = {
            "step": self.step, "tokens_seen": self.tokens_seen, "examples_seen": self.examples_seen,
            "world_size": self.engine.world_size, "run_id": self.run_id, "skipped_steps": self.skipped_steps,
            "valid_history": self.valid_history,
            "best": self.best.state_dict() if self.best is not None else None,
            "recipe": self.cfg.name,
        }
        return self.ckpt.save(self.step, state, {"stream": self.stream.state_dict()}, dump_yaml(self.cfg), self.vocab.langs,
                              vocab=self.vocab)

    # ------------------------------------------------------------------------------
    def _loss(self, batch: Batch):
        logits = self.engine.forward(batch.src, batch.tgt_in)
        return label_smoothed_ce(logits, batch.tgt_out, epsilon=self.cfg.optim.label_smoothing, ignore_index=self.vocab.pad)

    @torch.no_grad()
    def validate(self) -> float:
        eng = self.engine
        eng.train(False)
        stream = ShardStream(
            self.cfg.data.shards, "valid", rank=eng.rank, world_size=eng.world_size, seed=0,
            max_tokens=self.cfg.data.max_tokens, max_bytes=self.cfg.data.max_bytes, epochs=1, vocab=self.vocab,
        )
        nll = 0.0
        n = 0
        for i, batch in enumerate(stream):
            if i >= self.cfg.train.valid_max_batches:
                break
            _, nll_sum, ntok = self._loss(batch.to(eng.device))
            nll += float(nll_sum)
            n += int(ntok)
        tot_nll, tot_n = eng.all_reduce_sum([nll, n])
        routing_metrics(eng.module, reset=True)  # routing statistics describe training batches only
        eng.train(True)
        return tot_nll / max(tot_n, 1)

    def fit(self) -> TrainResult:
        cfg = self.cfg
        eng = self.engine
        tc = cfg.train
        gas = cfg.engine.grad_accum
        resumed = self._maybe_resume()
        self._start_tracking(resumed)
        base_nll = unigram_nll(cfg.data.shards, vocab=self.vocab) if eng.is_main else 0.0
        base_nll = eng.broadcast_object(base_nll)
        if eng.is_main:
            n_params = sum(v for k, v in self.param_counts.items() if k == "total")
            log.info(
                "training %s: %d ranks on %s, %s params, %s, target-unigram valid nll %.3f",
                cfg.name, eng.world_size, eng.device, f"{n_params:,}", cfg.engine.precision, base_nll,
            )
            if self.tracker:
                self.tracker.log_metrics({"baseline/unigram_valid_nll": base_nll}, step=self.step)
        if tc.valid_every and self.step == 0:
            self._log_valid()  # the start of the validation curve
        it = iter(self.stream)
        eng.train(True)
        t_start = time.time()
        t_log = time.time()
        tok_log = 0
        loss_acc = nll_acc = 0.0
        ntok_acc = 0
        skipped_log = 0
        steps_at_start = self.step
        stop = False
        while self.step < tc.max_steps and not stop:
            micro = [next(it) for _ in range(gas)]
            local_tok = sum(b.n_tgt_tokens for b in micro)
            elapsed = time.time() - t_start
            over_time = 1.0 if (tc.max_minutes > 0 and elapsed > tc.max_minutes * 60) else 0.0
            g_tok, g_stop = eng.all_reduce_sum([local_tok, over_time])
            if g_stop > 0:
                break
            scale = eng.world_size * gas / g_tok
            for b in micro:
                b = b.to(eng.device)
                loss_sum, nll_sum, ntok = self._loss(b)
                eng.backward(loss_sum * scale)
                loss_acc += float(loss_sum.detach())
                nll_acc += float(nll_sum.detach())
                ntok_acc += int(ntok)
                self.examples_seen += b.size
            info = eng.step()
            self.step += 1
            if info.skipped:
                self.skipped_steps += 1
                skipped_log += 1
            self.tokens_seen += int(g_tok)
            tok_log += int(g_tok)
            if self.step % tc.log_every == 0 or self.step == tc.max_steps:
                l, nl, nt = eng.all_reduce_sum([loss_acc, nll_acc, ntok_acc])
                dt = time.time() - t_log
                tps = tok_log / max(dt, 1e-9)
                done = self.step - steps_at_start
                per_step = (time.time() - t_start) / max(done, 1)
                eta_steps = (tc.max_steps - self.step) * per_step
                if tc.max_minutes > 0:
                    eta_steps = min(eta_steps, max(0.0, tc.max_minutes * 60 - (time.time() - t_start)))
                metrics = {
                    "train/loss": l / max(nt, 1), "train/nll": nl / max(nt, 1), "train/lr": info.lr,
                    "train/grad_norm": info.grad_norm, "train/tokens_per_s": tps,
                    "train/tokens_seen": self.tokens_seen, "train/skipped_steps": float(self.skipped_steps),
                }
                self.loss_history.append((self.step, metrics["train/loss"]))
                if eng.is_main:
                    log.info(
                        "step %6d | loss %.4f | nll %.4f | lr %.3e | gnorm %.3f | %8.0f tgt tok/s | eta %s%s",
                        self.step, metrics["train/loss"], metrics["train/nll"], info.lr, info.grad_norm, tps,
                        _fmt_secs(eta_steps),
                        f" | skipped {skipped_log} (fp16 overflow; {self.skipped_steps} in all)" if skipped_log else "",
                    )
                    self.tracker.log_metrics(metrics, step=self.step)
                routing = routing_metrics(eng.module, self.vocab.langs)  # MoCE: expert shares, mean radius
                self.last_routing = routing
                if eng.is_main and routing:
                    self.tracker.log_metrics(routing, step=self.step)
                loss_acc = nll_acc = 0.0
                ntok_acc = 0
                tok_log = 0
                skipped_log = 0
                t_log = time.time()
            metrics = {}
            if tc.valid_every and self.step % tc.valid_every == 0:
                metrics["valid/nll"] = self._log_valid()
            if tc.bleu_every and self.step % tc.bleu_every == 0:
                metrics.update(self._bleu_valid())
            decision = None
            if self.best is not None and self.best.metric in metrics:
                decision = self.best.update(self.step, metrics)  # same metrics on every rank -> same decision
            if (tc.save_every and self.step % tc.save_every == 0) or (decision is not None and decision.improved):
                saved = self.save()
                if decision is not None and decision.improved:
                    if eng.is_main:
                        self.best.keep(saved)
                    eng.barrier()
            if decision is not None and decision.stop:
                if eng.is_main:
                    log.info("early stop at step %d: %s best %.4f at step %d (patience %d)", self.step,
                             self.best.metric, decision.best_value, decision.best_step, tc.patience)
                stop = True
        train_seconds = time.time() - t_start
        if not self.valid_history or self.valid_history[-1][0] != self.step:
            self._log_valid()
        final = self.save()
        if eng.is_main:
            self.tracker.log_metrics({"train/seconds": train_seconds, "train/steps": self.step}, step=self.step)
            self.tracker.flush()
        return TrainResult(
            steps=self.step, tokens=self.tokens_seen, valid_nll=list(self.valid_history),
            train_loss=list(self.loss_history), unigram_nll=base_nll,
            train_seconds=train_seconds, run_id=self.run_id, out_dir=str(self.out_dir), final_checkpoint=str(final),
        )

    def _log_valid(self) -> float:
        v = self.validate()
        self.valid_history.append((self.step, v))
        if self.engine.is_main:
            log.info("step %6d | valid nll %.4f (%.3f bits/byte)", self.step, v, v / math.log(2))
            self.tracker.log_metrics({"valid/nll": v}, step=self.step)
        return v

    def _bleu_valid(self) -> dict:
        from scaletrain.eval.in_training import decoding_model

        eng = self.engine
        model = decoding_model(eng, self.cfg.model, self.vocab.size, pieces=self.vocab.pieces())  # collective under ZeRO-3
        res = self.bleu.run(model, rank=eng.rank, world_size=eng.world_size)  # collective (all_gather_object)
        del model
        routing_metrics(eng.module, reset=True)
        eng.train(True)
        if eng.is_main:
            a = res.report.average("all")
            log.info("step %6d | valid BLEU %.2f chrF %.2f on %d lines (%.1fs)", self.step, a.bleu, a.chrf,
                     res.lines, res.seconds)
            self.tracker.log_metrics(res.metrics, step=self.step)
        return res.metrics

    def close(self, status: str = "FINISHED") -> None:
        if self.tracker is not None:
            self.tracker.end(status)


def _fmt_secs(s: float) -> str:
    s = int(s)
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def train(cfg: Config) -> TrainResult:
    trainer = Trainer(cfg)
    try:
        result = trainer.fit()
    except BaseException:
        trainer.close("FAILED")
        raise
    trainer.close("FINISHED")
    if trainer.engine.is_main:
        summary = Path(result.out_dir) / "train_summary.json"
        summary.write_text(json.dumps(result.__dict__, indent=2))
    return result
