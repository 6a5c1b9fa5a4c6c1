"""May this run continue from a checkpoint, or start from its weights? The model, the vocabulary and the corpus
of a checkpoint compared with the run's, each difference named with both values in one line.

What a checkpoint says about itself (files of ``manager.py``): ``config.yaml`` (the resolved config it was
trained with), ``langs.json`` (the language tags, whose order gives their ids), ``vocab.json`` (a
SentencePiece vocabulary's file and sha256; absent = bytes) and, in ``trainer_state.json``, ``corpus``
(:func:`corpus_record`: the shards' identity; checkpoints written before it existed lack it and their corpus
is not checked).

**Resume** (:func:`check_resume`, called before the engine loads anything, so a refusal writes nothing and
touches no MLflow run) refuses, with one line naming the checkpoint, every differing key with both values and
what to do:

* the model: every ``model.*`` key but the regularisation and implementation ones (:data:`FREE_MODEL_KEYS`:
  dropouts, ``kernels``, ``moce.dispatch``), and the ``moe.*`` keys that define the experts
  (:data:`MOE_MODEL_KEYS`); ``moe.ep_size``/``moce_partition`` are layout, ``capacity_factor``/
  ``aux_loss_coef`` training settings;
* the vocabulary: the tokenizer, the SentencePiece model (sha256, size) and the languages in tag order;
* the optimizer settings the checkpoint's optimizer state carries (:data:`CARRIED_OPTIM_KEYS`: AdamW's betas,
  eps and weight decay are restored from its param groups, so a new value would be silently ignored);
* the corpus (the manifest's shard checksums): unless ``train.resume_other_corpus=true``, which is well
  defined when the vocabulary is the same: the model, the optimizer, the LR schedule and the counters carry
  on and the data stream starts at the new corpus's beginning (a position in other shards means nothing).

Everything else may change on resume: ``train.*`` (length, cadences, policies), ``eval.*``, ``tracking.*``,
``engine.*`` (the layout), ``optim.lr``/warm-up/clipping/label smoothing (the schedule is a function of the
config and the updates applied, so new values apply from the resumed step); the data stream refuses the
``data.*`` batching settings it cannot continue exactly itself (``scaletrain.data.stream``).

**Warm start** (:mod:`scaletrain.checkpoint.warm_start`) uses :func:`model_differences` and
:func:`tokenizer_differences`: the same model and tokenizer, any languages.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from scaletrain.config import Config, dump_yaml, flatten
from scaletrain.errors import ScaletrainError

log = logging.getLogger("scaletrain")

#: ``model.*`` keys that change neither the parameters nor the function they compute (regularisation,
#: kernel choice): free to change on resume and at a warm start.
FREE_MODEL_KEYS = frozenset({
    "model.dropout", "model.attention_dropout", "model.activation_dropout", "model.kernels",
    "model.encoder_input_dropout", "model.decoder_input_dropout", "model.decoder_last_layer_dropout",
    "model.moce.dispatch",
})
#: ``moe.*`` keys that define the experts (their number, width, placement and routing).
MOE_MODEL_KEYS = ("moe.num_experts", "moe.top_k", "moe.every", "moe.ffn_dim", "moe.shared_expert")
#: ``optim.*`` keys the optimizer state restored at resume carries in its param groups.
CARRIED_OPTIM_KEYS = ("optim.betas", "optim.eps", "optim.weight_decay")
UNSET = "(unset)"


@dataclass
class ResumeCheck:
    """What :func:`check_resume` found: ``other_corpus``: the corpus differs and ``train.resume_other_corpus``
    allows it (the data stream starts afresh); ``corpus_checked``: the checkpoint recorded its corpus."""

    other_corpus: bool = False
    corpus_checked: bool = True


def corpus_record(manifest: dict, shards: str) -> dict:
    """The corpus's identity for ``trainer_state.json``: ``digest``, the sha256 of the languages and every
    split's shard names and sha256 (the manifest's other fields, e.g. a tokenizer added later, do not count),
    and ``shards``, where it was read from (informational: the same shards may move)."""
    splits = manifest.get("splits") or {}
    ident = {"languages": list(manifest.get("languages") or []),
             "splits": {name: [[sh["name"], sh["sha256"]] for sh in split.get("shards", [])]
                        for name, split in sorted(splits.items())}}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
    return {"digest": digest, "shards": str(shards)}


def saved_config(ckpt: Path) -> dict:
    """The checkpoint's ``config.yaml`` as a plain mapping (not validated: a checkpoint of an older version
    still compares)."""
    path = Path(ckpt) / "config.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ScaletrainError(f"{path}: unreadable ({type(e).__name__}: {e}); the checkpoint is damaged, use "
                              "an earlier one") from None
    if not isinstance(data, dict):
        raise ScaletrainError(f"{path}: not a config mapping; the checkpoint is damaged, use an earlier one")
    return data


def run_config(cfg: Config) -> dict:
    """``cfg`` as its checkpoint's ``config.yaml`` would hold it (the same YAML round trip)."""
    return yaml.safe_load(dump_yaml(cfg))


def _flat(tree: dict, section: str) -> dict[str, Any]:
    sub = tree.get(section)
    return flatten(sub, f"{section}.") if isinstance(sub, dict) else {}


def model_differences(saved: dict, run: dict) -> list[tuple[str, Any, Any]]:
    """``(key, checkpoint's value, run's value)`` for every model-defining key that differs (``model.*`` but
    :data:`FREE_MODEL_KEYS`, :data:`MOE_MODEL_KEYS`). A key the checkpoint's config lacks (written before the
    key existed) is not compared; one this run's model no longer uses shows as ``(unset)``."""
    a = {**_flat(saved, "model"), **{k: v for k, v in _flat(saved, "moe").items() if k in MOE_MODEL_KEYS}}
    b = {**_flat(run, "model"), **{k: v for k, v in _flat(run, "moe").items() if k in MOE_MODEL_KEYS}}
    return [(k, a[k], b.get(k, UNSET)) for k in a if k not in FREE_MODEL_KEYS and a[k] != b.get(k, UNSET)]


def optimizer_differences(saved: dict, run: dict) -> list[tuple[str, Any, Any]]:
    """The :data:`CARRIED_OPTIM_KEYS` that differ."""
    a, b = _flat(saved, "optim"), _flat(run, "optim")
    return [(k, a[k], b.get(k, UNSET)) for k in CARRIED_OPTIM_KEYS if k in a and a[k] != b.get(k, UNSET)]


def _tokenizer_of(vocab) -> tuple[str, str | None, int]:
    """(kind, sha256 of the SentencePiece model or None, ids before the language tags)."""
    kind = getattr(vocab, "kind", "byte")
    return kind, getattr(vocab, "sha256", None) if kind != "byte" else None, int(vocab.lang_offset)


def tokenizer_differences(saved_vocab, vocab) -> list[tuple[str, Any, Any]]:
    """The tokenizer's differences (``data.tokenizer``; the SentencePiece model's sha256 and size), languages
    aside."""
    (ka, sa, na), (kb, sb, nb) = _tokenizer_of(saved_vocab), _tokenizer_of(vocab)
    if ka != kb:
        return [("data.tokenizer", ka, kb)]
    out = []
    if na != nb:
        out.append(("vocabulary size before the language tags (the SentencePiece model's)", na, nb))
    if sa != sb:
        out.append(("SentencePiece model sha256 (vocab.json)", sa[:12], sb[:12]))
    return out


def language_differences(saved_langs: list[str], langs: list[str]) -> list[tuple[str, Any, Any]]:
    if list(saved_langs) == list(langs):
        return []
    return [("languages (langs.json; their order gives the tag ids)", ",".join(saved_langs), ",".join(langs))]


def describe(diffs: list[tuple[str, Any, Any]]) -> str:
    """``key: checkpoint A, this run B; ...``."""
    return "; ".join(f"{k}: checkpoint {_show(a)}, this run {_show(b)}" for k, a, b in diffs)


def _show(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(map(str, v)) + "]"
    return str(v).lower() if isinstance(v, bool) else str(v)


def saved_languages(ckpt: Path) -> list[str]:
    path = Path(ckpt) / "langs.json"
    try:
        langs = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ScaletrainError(f"{path}: unreadable ({type(e).__name__}: {e}); the checkpoint is damaged") from None
    if not isinstance(langs, list) or not all(isinstance(x, str) for x in langs):
        raise ScaletrainError(f"{path}: not a list of language codes; the checkpoint is damaged")
    return langs


def _saved_corpus(ckpt: Path) -> dict | None:
    try:
        rec = json.loads((Path(ckpt) / "trainer_state.json").read_text()).get("corpus")
    except (OSError, ValueError, AttributeError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("digest"), str) else None


def check_resume(ckpt: Path, cfg: Config, vocab, corpus: dict, *, is_main: bool = True) -> ResumeCheck:
    """Raise one line when ``cfg`` (its vocabulary ``vocab``, its corpus ``corpus``: :func:`corpus_record`)
    may not resume checkpoint ``ckpt`` (module docstring); else say what the resume does about the corpus.
    Reads only the checkpoint's small files; writes nothing."""
    from scaletrain.checkpoint.inference import load_checkpoint_vocab

    ckpt = Path(ckpt)
    saved, run = saved_config(ckpt), run_config(cfg)
    langs = saved_languages(ckpt)
    shape = model_differences(saved, run)
    words = tokenizer_differences(load_checkpoint_vocab(ckpt, langs), vocab) + language_differences(langs, vocab.langs)
    optim = optimizer_differences(saved, run)
    saved_corpus = _saved_corpus(ckpt)
    other = saved_corpus is not None and saved_corpus["digest"] != corpus["digest"]
    if shape or words or optim:
        raise ScaletrainError(_refusal(ckpt, shape, words, optim, other and (saved_corpus, corpus)))
    if other and not cfg.train.resume_other_corpus:
        raise ScaletrainError(
            f"cannot resume from {ckpt}: {_corpus_diff(saved_corpus, corpus)}; set train.resume_other_corpus=true "
            "to carry on this run (model, optimizer, LR schedule, counters) on the new corpus from its start, or "
            "start a new train.out_dir (train.init_from=CHECKPOINT takes the weights only), or point data.shards "
            "at the checkpoint's corpus")
    if is_main and saved_corpus is None:
        log.warning("%s records no corpus identity (written before it was recorded): the corpus is not checked", ckpt)
    if is_main and other:
        log.warning("resuming %s on another corpus (train.resume_other_corpus=true: %s): the model, optimizer, LR "
                    "schedule and counters carry on; the data stream starts at the new corpus's beginning",
                    ckpt, _corpus_diff(saved_corpus, corpus))
    return ResumeCheck(other_corpus=other, corpus_checked=saved_corpus is not None)


def _corpus_diff(saved: dict, run: dict) -> str:
    return (f"corpus (the shards' checksums): checkpoint {saved['digest'][:12]} ({saved.get('shards')}), "
            f"this run {run['digest'][:12]} ({run.get('shards')})")


def _refusal(ckpt: Path, shape, words, optim, corpus) -> str:
    parts = [describe(shape + words + optim)] + ([_corpus_diff(*corpus)] if corpus else [])
    langs_only = words and not shape and all(k.startswith("languages") for k, _, _ in words)
    if langs_only:  # a warm start maps the tags by name
        fix = (f"start a new train.out_dir with train.init_from={ckpt} (its weights, the language tags mapped by "
               "name, a new optimizer), or resume with the checkpoint's values")
    elif shape or words:
        fix = "start a new train.out_dir for this model or vocabulary, or resume with the checkpoint's values"
    else:
        fix = "resume with the checkpoint's values"
    if optim:
        fix += " (its optimizer state holds " + ", ".join(k for k, _, _ in optim) + ": a new value would be ignored)"
    return f"cannot resume from {ckpt}: {'; '.join(parts)}; {fix}"
