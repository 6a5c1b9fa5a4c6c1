"""Validation during training: BLEU/chrF on a fixed validation subset, best checkpoint, early stopping.

Components, each usable on its own (the Trainer calls them every ``M`` steps):

* :func:`first_n_per_direction` - the fixed subset: the first ``N`` lines of every direction, in shard
  order (the same lines at every evaluation and after a resume).
* :class:`BleuValidator` - decodes the subset (greedy by default; with the bounds ``evaluate`` decodes with,
  :func:`scaletrain.eval.bounds.decoding_bounds`: length limits from the recipe and from training's
  length ratios, the stop at invalid UTF-8) and scores it with
  :func:`scaletrain.eval.scoring.score_directions` (per-language BLEU tokenizer, chrF, groups, pivot
  averages). With several ranks (all data parallel) every one decodes its own share (lines ``rank::world_size``
  of the parallel context), the hypotheses are all-gathered over every rank, and every rank scores the complete subset, so all ranks hold the same
  numbers (and can take the same early-stopping decision) and the result equals a single-process run.
* The module to decode with comes from ``Engine.inference_module()``: the engine alone knows whether its
  parameters are partitioned (ZeRO-3) and a full copy must be gathered first.
* :class:`BestCheckpoint` - tracks a chosen metric (mode ``max`` or ``min``), keeps the best checkpoint
  as ``<out_dir>/checkpoints/best`` (written by ``checkpoint.manager.keep_copy``: hard links into the saved
  checkpoint, so no copy and it survives the ``keep_last`` rotation), and reports early stopping after ``patience`` evaluations without improvement.
  Its ``state_dict()`` goes into the trainer state so resume continues the count.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from scaletrain.checkpoint.manager import keep_copy
from scaletrain.data.batch import Example
from scaletrain.errors import ScaletrainError
from scaletrain.eval.bounds import DEFAULT_MAX_LEN_A, DEFAULT_MAX_LEN_B, decoding_bounds
from scaletrain.eval.requests import translate_examples
from scaletrain.eval.scoring import Report, example_records, report_to_metrics, score_directions
from scaletrain.vocab import ByteVocab

__all__ = [
    "first_n_per_direction",
    "ValidationResult",
    "BleuValidator",
    "Decision",
    "BestCheckpoint",
]


def first_n_per_direction(examples: Sequence[Example], n: int) -> list[Example]:
    """The first ``n`` examples of every (src, tgt) direction, keeping their order; ``n <= 0``: all."""
    if n <= 0:
        return list(examples)
    seen: dict[tuple[int, int], int] = {}
    out = []
    for ex in examples:
        k = (ex.src_lang, ex.tgt_lang)
        if seen.get(k, 0) < n:
            seen[k] = seen.get(k, 0) + 1
            out.append(ex)
    return out


@dataclass
class ValidationResult:
    report: Report
    metrics: dict[str, float]  # flat, e.g. valid/bleu_avg/all, valid/chrf/en-de (see report_to_metrics)
    lines: int
    local_lines: int  # decoded by this rank
    seconds: float
    hypotheses: list[str] = field(repr=False, default_factory=list)  # in subset order


def _all_gather_objects(obj, world_size: int, group=None) -> list:
    """``obj`` of every rank of ``group`` (None: the default group), ``world_size`` of them."""
    import torch.distributed as dist

    if world_size == 1:
        return [obj]
    if not (dist.is_available() and dist.is_initialized()):
        raise ScaletrainError(
            f"BleuValidator.run(world_size={world_size}) needs an initialised torch.distributed process group "
            "(or pass gather=...)"
        )
    out = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


class BleuValidator:
    """BLEU/chrF of a model on a fixed list of examples; see the module docstring for the distributed rules.

    ``examples``: the subset (e.g. ``first_n_per_direction(read_split(shards, 'valid'), 100)``).
    ``beam``: 1 = greedy (default; cheap enough to run often). Decoding settings (``length_ratios`` too) as in
    :func:`scaletrain.eval.requests.translate_examples`; scoring settings as in
    :func:`scaletrain.eval.scoring.score_directions`.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        vocab: ByteVocab,
        *,
        beam: int = 1,
        lenpen: float = 1.0,
        max_len_a: float = DEFAULT_MAX_LEN_A,
        max_len_b: int = DEFAULT_MAX_LEN_B,
        batch_tokens: int = 8192,
        pivot: str = "en",
        groups: Mapping[str, Sequence[str]] | None = None,
        tokenize: Mapping[str, str] | None = None,
        prefix: str = "valid",
        stop_invalid_utf8: bool = True,
        length_ratios: Mapping[tuple[int, int], float] | None = None,
    ):
        self.examples = list(examples)
        if not self.examples:
            raise ScaletrainError("BleuValidator: the validation subset is empty (is the valid split empty?)")
        self.vocab = vocab
        self.decode_kw = dict(beam=beam, lenpen=lenpen, max_len_a=max_len_a, max_len_b=max_len_b,
                              batch_tokens=batch_tokens, stop_invalid_utf8=stop_invalid_utf8,
                              length_ratios=length_ratios)
        self.pivot, self.groups, self.tokenize, self.prefix = pivot, dict(groups or {}), tokenize, prefix

    @classmethod
    def for_run(cls, cfg, vocab: ByteVocab, n_per_direction: int, split: str = "valid", **kw) -> "BleuValidator":
        """The first ``n_per_direction`` lines per direction of ``split`` of ``cfg.data.shards``, decoding
        and scoring settings from ``cfg.eval`` (beam defaults to 1 = greedy; override with ``beam=``), decoded
        within the bounds ``evaluate`` applies (:func:`~scaletrain.eval.bounds.decoding_bounds`)."""
        from scaletrain.data.shards import read_split

        ec = cfg.eval
        args = dict(beam=1, lenpen=ec.lenpen, batch_tokens=ec.batch_tokens, pivot=ec.pivot,
                    groups=ec.groups or None, **decoding_bounds(ec, cfg.data.shards))
        args.update(kw)
        return cls(first_n_per_direction(read_split(cfg.data.shards, split), n_per_direction), vocab, **args)

    def share(self, rank: int, world_size: int) -> list[int]:
        """Indices of the subset this rank decodes (interleaved, so long and short lines spread evenly)."""
        return list(range(rank, len(self.examples), world_size))

    def run(self, model, *, rank: int = 0, world_size: int = 1, group=None,
            gather: Callable[[object], list] | None = None,
            progress: Callable[[int], None] | None = None) -> ValidationResult:
        """Decode this rank's share with ``model`` (no collectives, except a ``LockstepDecoder``'s under
        expert parallelism, joined to the end by ``finish()``), gather every rank's hypotheses (a
        collective: all ranks must call ``run``), score the whole subset. ``rank``/``world_size``: the
        data-parallel rank and size that split the lines, ``group`` their process group (None: the default
        group). ``gather(obj) -> [obj of each rank]`` defaults to ``torch.distributed.all_gather_object`` over
        ``group``; ``progress(n)`` is called after each decoded batch of this rank with its number of lines."""
        if not (0 <= rank < world_size):
            raise ScaletrainError(f"BleuValidator.run: rank {rank} outside world size {world_size}")
        t0 = time.time()
        idx = self.share(rank, world_size)
        mine: list[tuple[int, str, int]] = []
        if idx:
            res = translate_examples(model, [self.examples[i] for i in idx], self.vocab, progress=progress,
                                     stage="in-training BLEU decoding", batch_tokens_key="eval.batch_tokens",
                                     **self.decode_kw)
            mine = list(zip(idx, res.texts, res.invalid))
        if hasattr(model, "finish"):  # lock-step decoding (expert parallelism): join the other ranks' batches
            model.finish()
        parts = gather(mine) if gather is not None else _all_gather_objects(mine, world_size, group)
        hyps: list[str | None] = [None] * len(self.examples)
        invalid = [0] * len(self.examples)
        for part in parts:
            for i, text, inv in part:
                hyps[i], invalid[i] = text, inv
        missing = [i for i, h in enumerate(hyps) if h is None]
        if missing:
            raise ScaletrainError(f"BleuValidator: {len(missing)} lines were decoded by no rank (first: {missing[:5]})")
        records = example_records(self.examples, self.vocab.langs, hyps, invalid)
        report = score_directions(records, pivot=self.pivot, groups=self.groups or None, tokenize=self.tokenize)
        return ValidationResult(report, report_to_metrics(report, self.prefix), len(records), len(idx),
                                time.time() - t0, hypotheses=list(hyps))


# ----------------------------------------------------------------------------------------------
# best checkpoint and early stopping


@dataclass(frozen=True)
class Decision:
    improved: bool  # this evaluation is the new best
    stop: bool  # early stopping: `patience` evaluations in a row without improvement
    value: float
    best_value: float
    best_step: int
    bad_evals: int  # evaluations since the last improvement


class BestCheckpoint:
    """Track ``metric`` over evaluations; keep the best checkpoint; decide early stopping.

    ``mode``: ``max`` (BLEU, chrF) or ``min`` (loss). An evaluation improves if it beats the best by more than
    ``min_delta``. ``patience``: stop after that many evaluations in a row without improvement (0 = never).
    A NaN value never improves. ``keep(ckpt_dir)`` (rank 0) makes ``<root>/best`` a hard-linked copy of a saved
    checkpoint directory (files copied where links are impossible) and writes ``best.json`` beside it.
    """

    def __init__(self, root: str | Path | None, metric: str, mode: str = "max", patience: int = 0,
                 min_delta: float = 0.0):
        if mode not in ("max", "min"):
            raise ScaletrainError(f"best checkpoint: mode must be 'max' or 'min', got {mode!r}")
        if patience < 0 or min_delta < 0:
            raise ScaletrainError(f"best checkpoint: patience and min_delta must be >= 0, got {patience}, {min_delta}")
        self.root = Path(root) if root is not None else None
        self.metric, self.mode, self.patience, self.min_delta = metric, mode, patience, min_delta
        self.best_value = math.nan
        self.best_step = -1
        self.bad_evals = 0
        self.history: list[tuple[int, float]] = []

    @classmethod
    def for_run(cls, cfg, root: str | Path | None) -> "BestCheckpoint":
        """``train.best_metric`` / ``best_mode`` / ``patience`` / ``best_min_delta``, kept under ``root``."""
        tc = cfg.train
        return cls(root, tc.best_metric, tc.best_mode, tc.patience, tc.best_min_delta)

    def _better(self, v: float) -> bool:
        if math.isnan(v):
            return False
        if math.isnan(self.best_value):
            return True
        return v > self.best_value + self.min_delta if self.mode == "max" else v < self.best_value - self.min_delta

    def update(self, step: int, metrics: Mapping[str, float]) -> Decision:
        if self.metric not in metrics:
            raise ScaletrainError(
                f"best checkpoint metric {self.metric!r} is not among the validation metrics; choose one of: "
                + ", ".join(sorted(metrics))
            )
        v = float(metrics[self.metric])
        self.history.append((step, v))
        improved = self._better(v)
        if improved:
            self.best_value, self.best_step, self.bad_evals = v, step, 0
        else:
            self.bad_evals += 1
        stop = self.patience > 0 and self.bad_evals >= self.patience
        return Decision(improved, stop, v, self.best_value, self.best_step, self.bad_evals)

    # ---- keeping the checkpoint ----------------------------------------------------------------
    @property
    def best_dir(self) -> Path:
        if self.root is None:
            raise ScaletrainError("BestCheckpoint was created without a root directory")
        return self.root / "best"

    def keep(self, ckpt_dir: str | Path) -> Path:
        """Make ``best`` a copy (hard links) of ``ckpt_dir`` with ``best.json`` beside its files; atomic: a
        reader sees the old or the new one (``checkpoint.manager.keep_copy`` writes it)."""
        info = {"metric": self.metric, "mode": self.mode, "value": self.best_value, "step": self.best_step,
                "source": Path(ckpt_dir).name}
        return keep_copy(ckpt_dir, self.best_dir, {"best.json": info})

    # ---- resume ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"metric": self.metric, "mode": self.mode, "best_value": None if math.isnan(self.best_value) else self.best_value,
                "best_step": self.best_step, "bad_evals": self.bad_evals, "history": [list(h) for h in self.history]}

    def load_state_dict(self, st: Mapping) -> None:
        if st.get("metric") != self.metric or st.get("mode") != self.mode:
            raise ScaletrainError(
                f"resumed run tracked best {st.get('metric')!r} ({st.get('mode')}) but this config asks for "
                f"{self.metric!r} ({self.mode}); keep the metric or start a new out_dir"
            )
        bv = st.get("best_value")
        self.best_value = math.nan if bv is None else float(bv)
        self.best_step = int(st.get("best_step", -1))
        self.bad_evals = int(st.get("bad_evals", 0))
        self.history = [(int(s), float(v)) for s, v in st.get("history", [])]
