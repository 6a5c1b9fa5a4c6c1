"""What an evaluation is called, and where its record lives.

An evaluation is named by everything that changes its numbers, so two different evaluations never share
a record and the same evaluation run twice does:

    <split>[@<shards>].<lines>.beam<B>.lp<P>[.len<A>x+<B>].step<N>[-<checkpoint>]

* ``<lines>``: ``full`` when every line of the split was decoded, ``first<N>`` for ``--max-lines N`` (the
  first N lines of each direction; ``full`` again when no direction has more than N);
* ``beam<B>``, ``lp<P>``: beam size and length penalty (``lp1.0``);
* ``len<A>x+<B>``: the output length limit ``A * source length + B``, only when it is not the recipe's
  (``eval.max_len_a``/``max_len_b`` of the checkpoint's config);
* ``@<shards>``: only when the shards are not the ones the model was trained on (their directory name
  and a hash of the full path, so two directories of the same name differ);
* ``step<N>``: the checkpoint's step; ``-<checkpoint>`` follows when the checkpoint is not a
  ``step-N`` directory (an averaged checkpoint or an exported file can share a step with a real one).

Example: ``test.full.beam5.lp1.0.step1200``, ``test.first5.beam4.lp1.0.step1200``. The name is also a set
of tags (:meth:`EvalSpec.tags`), with the checkpoint and shard paths written out.

The run's *full* evaluation of a split is the one :attr:`EvalSpec.primary` marks: every line, the
recipe's decoding settings, the training shards (what ``./launch.sh`` runs after training). Only a full
evaluation updates the training run's headline metrics (``test/bleu/all``, ...; not for ``valid``, whose keys
the in-training validation logs); every evaluation, full or not, has its own record:

* files: ``RUN/eval/<name>/`` (``eval.json``, ``{src,ref,hyp}.<src>-<tgt>.txt``, ``scores.png`` + ``.json``),
  written beside and swapped in whole (:func:`scaletrain.fileio.replace_dir`);
* MLflow: a run nested under the training run (``mlflow.parentRunId``), named ``<name>`` and tagged with
  :meth:`EvalSpec.tags`, holding the scores under the usual keys (``test/bleu/all``, ...) at the
  checkpoint's step and the record's files as artifacts (:func:`scaletrain.tracking.log_evaluation`).

Why nested runs rather than prefixed keys in the training run: the metric keys stay the same for every
evaluation, so MLflow's UI charts and compares them across evaluations and runs; the run's own metrics
list does not grow with every subset tried; the description of each evaluation is searchable tags
(``tags.`scaletrain.eval.beam` = '4'``); and the files of one evaluation sit together as that run's
artifacts. The training run keeps the headline keys its full evaluation wrote, with the tag
``scaletrain.full_eval.<split>`` naming that evaluation (and ``...run_id``, ``...step`` beside it).

This module imports neither torch nor MLflow (``scaletrain compare`` reads names and tags with it); it sits in
the tracking package, below ``eval``, which writes the records it names.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["EvalSpec", "KIND_TAG", "EVALUATION", "TAG_PREFIX", "checkpoint_label", "shards_label",
           "record_dir", "headline_tag"]

KIND_TAG = "scaletrain.kind"  # on a nested evaluation run: "evaluation"
EVALUATION = "evaluation"
TAG_PREFIX = "scaletrain.eval."
TRAINER_SPLITS = ("valid",)  # the trainer logs valid/bleu/<direction> itself (in-training validation)
_STEP_DIR = re.compile(r"^step-0*(\d+)$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def _safe(text: str) -> str:
    return _UNSAFE.sub("_", text).strip("._") or "_"


def checkpoint_label(path: str | os.PathLike) -> str:
    """'' for a ``step-N`` checkpoint directory (the step names it), else the directory's or file's name
    (``avg5``, ``model``), made safe for a file name."""
    p = Path(path)
    p = p.resolve() if p.is_symlink() else p
    if _STEP_DIR.match(p.name):
        return ""
    return _safe(p.stem if p.suffix == ".safetensors" else p.name)


def shards_label(shards: str, training_shards: str) -> str:
    """'' for the shards the model trained on, else ``<dir name>-<6 hex of the full path>``."""
    def norm(s: str) -> str:
        return s if "://" in s or s.startswith("pipe:") else str(Path(s).resolve())

    if norm(str(shards)) == norm(str(training_shards)):
        return ""
    name = str(shards).rstrip("/").rsplit("/", 1)[-1]
    return f"{_safe(name)}-{hashlib.sha1(norm(str(shards)).encode()).hexdigest()[:6]}"


def _num(x: float) -> str:
    return repr(float(x))  # 1.0 -> '1.0', 0.6 -> '0.6'


@dataclass(frozen=True)
class EvalSpec:
    """Everything that makes one evaluation differ from another (see the module docstring)."""

    split: str
    lines: int  # lines decoded
    max_lines: int  # per direction; 0 = no limit
    full: bool  # no direction was cut by max_lines
    beam: int
    lenpen: float
    max_len_a: float
    max_len_b: int
    recipe_max_len: bool  # max_len_a/b are the checkpoint config's eval settings
    recipe_decoding: bool  # beam, lenpen and max_len are the checkpoint config's eval settings
    step: int | None
    checkpoint: str  # the checkpoint's path
    checkpoint_label: str  # '' for a step-N directory
    shards: str  # the shards' path
    shards_label: str  # '' for the training shards

    @property
    def primary(self) -> bool:
        """The run's full evaluation of this split: every line, the recipe's settings, the training shards."""
        return self.full and self.recipe_decoding and not self.shards_label

    @property
    def headline(self) -> bool:
        """Whether its scores also become the training run's own ``<split>/...`` metrics: the full evaluation,
        of a split whose keys the trainer does not log itself (its in-training validation logs ``valid/...``)."""
        return self.primary and self.split not in TRAINER_SPLITS

    @property
    def lines_label(self) -> str:
        return "full" if self.full else f"first{self.max_lines}"

    @property
    def name(self) -> str:
        parts = [self.split + (f"@{self.shards_label}" if self.shards_label else ""), self.lines_label,
                 f"beam{self.beam}", f"lp{_num(self.lenpen)}"]
        if not self.recipe_max_len:
            parts.append(f"len{self.max_len_a:g}x+{self.max_len_b}")
        step = f"step{self.step}" if self.step is not None else "step_"
        parts.append(step + (f"-{self.checkpoint_label}" if self.checkpoint_label else ""))
        return ".".join(parts)

    def describe(self) -> str:
        """One line for titles and tables: split, lines, beam, lenpen, length limit, step."""
        lines = f"all {self.lines} lines" if self.full else f"first {self.max_lines} lines per direction ({self.lines})"
        where = f" of {self.shards}" if self.shards_label else ""
        ck = f" ({self.checkpoint_label})" if self.checkpoint_label else ""
        return (f"{self.split}{where}, {lines}, beam {self.beam}, lenpen {_num(self.lenpen)}, "
                f"max_len {self.max_len_a:g}x+{self.max_len_b}, step {self.step}{ck}")

    def tags(self) -> dict[str, str]:
        """The MLflow tags of the evaluation's nested run (and its params, without the kind)."""
        t = {KIND_TAG: EVALUATION, TAG_PREFIX + "name": self.name}
        for k, v in asdict(self).items():
            t[TAG_PREFIX + k] = "" if v is None else str(v)
        t[TAG_PREFIX + "primary"] = str(self.primary).lower()
        return t

    def to_json(self) -> dict:
        return {"name": self.name, "primary": self.primary, "description": self.describe(), **asdict(self)}


def record_dir(run_dir: str | os.PathLike, name: str) -> Path:
    """``RUN/eval/<name>``: the evaluation's files."""
    return Path(run_dir) / "eval" / name


def headline_tag(split: str) -> str:
    """The training run's tag naming the evaluation behind its ``<split>/...`` headline metrics."""
    return f"scaletrain.full_eval.{split}"
