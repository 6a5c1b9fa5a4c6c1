"""Warm start (``train.init_from``): a fresh run whose model starts from another run's weights.

Only the weights are taken: the optimizer is new, the LR schedule starts at update 0 (its warm-up included),
the data stream at the corpus's beginning and the counters at 0. The weights are consolidated from a
checkpoint of any engine (``inference.load_model_weights``: Accelerate's safetensors, DeepSpeed's files of any
ZeRO stage, expert shards joined) and copied into the freshly built model before the engine wraps it, so every
engine and layout gets them the same way (ZeRO-3 partitions them, expert parallelism cuts its experts out:
``parallel.state.shard_state_dict``).

It applies only to a run that starts fresh: with a checkpoint in ``train.out_dir`` to resume from
(``train.resume``, the default) the run resumes and ``init_from`` is ignored, said once in the log, so
re-running the same command after a preemption continues the run instead of starting it again.

The checkpoint must have the run's model (``compat.model_differences``) and tokenizer
(``compat.tokenizer_differences``); otherwise one line names each differing key with both values, before
anything is written. The languages may differ (fine-tuning on a new language set): every id before the
language tags (specials, bytes or SentencePiece pieces) is shared, so those rows of the vocabulary-sized
tensors (the embeddings, the output projection) are copied, the row of each language both have is copied by
its tag's name (its id may differ), and a language only this run has keeps its fresh initialisation; the log
says which. Any other parameter whose shape differs is named with both shapes.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from scaletrain.checkpoint.compat import (describe, language_differences, model_differences, run_config,
                                          saved_config, saved_languages, tokenizer_differences)
from scaletrain.checkpoint.inference import load_checkpoint_vocab, load_model_weights, resolve_checkpoint
from scaletrain.checkpoint.manager import latest_tag
from scaletrain.config import Config
from scaletrain.errors import ScaletrainError
from scaletrain.parallel.state import shard_state_dict

log = logging.getLogger("scaletrain")


def warm_start(cfg: Config, model: nn.Module, vocab, *, is_main: bool = True) -> dict | None:
    """Load ``train.init_from``'s weights into ``model`` (built for ``vocab``, not yet wrapped by the engine)
    when the run starts fresh; returns what ``trainer_state.json`` records of the source (checkpoint, its step,
    the languages mapped), or None (no ``init_from``, or a resume ignores it)."""
    src = cfg.train.init_from
    if not src:
        return None
    if cfg.train.resume and latest_tag(Path(cfg.out_dir) / "checkpoints") is not None:
        if is_main:
            log.info("train.init_from=%s ignored: %s has a checkpoint to resume from (a warm start applies only to "
                     "a run that starts fresh)", src, cfg.out_dir)
        return None
    try:
        ckpt = resolve_checkpoint(src)
    except ScaletrainError as e:
        raise ScaletrainError(f"config key 'train.init_from': {e}") from None
    langs = saved_languages(ckpt)
    diffs = model_differences(saved_config(ckpt), run_config(cfg))
    diffs += tokenizer_differences(load_checkpoint_vocab(ckpt, langs), vocab)
    if diffs:
        raise ScaletrainError(f"cannot warm-start from {ckpt} (train.init_from): {describe(diffs)}; a warm start "
                              "needs the checkpoint's model and tokenizer (the languages may differ): set these "
                              "keys to its values, or train without train.init_from")
    sd = shard_state_dict(load_model_weights(ckpt, quiet=True), model)  # under expert parallelism: this rank's
    mapped = map_language_rows(sd, model, langs, vocab.langs, vocab.lang_offset)
    load_exactly(model, sd, ckpt)
    step = _saved_step(ckpt)
    if is_main:
        how = "" if mapped is None else (
            f"; languages differ ({describe(language_differences(langs, vocab.langs))}): shared ids and the tags of "
            f"{', '.join(mapped['copied']) or 'no language'} copied by name"
            + (f", {', '.join(mapped['new'])} freshly initialised" if mapped["new"] else "")
            + (f", {', '.join(mapped['dropped'])} left out" if mapped["dropped"] else ""))
        log.info("warm start from %s (step %s, train.init_from): model weights only; new optimizer, LR schedule "
                 "from update 0, data from the start%s", ckpt, step, how)
    return {"checkpoint": str(ckpt.resolve()), "step": step, **({"languages": mapped} if mapped else {})}


def _saved_step(ckpt: Path) -> int | None:
    try:
        return int(json.loads((ckpt / "trainer_state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def vocabulary_rows(model: nn.Module, vocab_size: int) -> set[str]:
    """State-dict keys of the tensors with one row per vocabulary id: those of ``model.embeddings`` (input
    embeddings, the output projection, a character-aware table's spellings) whose first dimension is the
    vocabulary size."""
    emb = getattr(model, "embeddings", None)
    if emb is None:
        return set()
    return {f"embeddings.{k}" for k, t in emb.state_dict().items() if t.dim() and t.shape[0] == vocab_size}


def map_language_rows(sd: dict[str, torch.Tensor], model: nn.Module, saved_langs: list[str], langs: list[str],
                      lang_offset: int) -> dict | None:
    """Rewrite ``sd``'s vocabulary-row tensors for ``langs`` (in place): the ids before ``lang_offset`` and
    the tags of the languages both have (by name) from ``sd``, every other row the model's fresh one. Returns
    which languages were copied, new and dropped, or None when the languages are the same."""
    if list(saved_langs) == list(langs):
        return None
    fresh = model.state_dict()
    rows = [k for k in vocabulary_rows(model, lang_offset + len(langs)) if k in sd]
    old_size = lang_offset + len(saved_langs)
    index = {code: i for i, code in enumerate(saved_langs)}
    for k in rows:
        src = sd[k]
        if src.shape[0] != old_size or src.shape[1:] != fresh[k].shape[1:]:
            continue  # left to load_exactly, which names the shapes
        out = fresh[k].detach().clone().to(src.dtype)
        out[:lang_offset] = src[:lang_offset]
        for j, code in enumerate(langs):
            if code in index:
                out[lang_offset + j] = src[lang_offset + index[code]]
        sd[k] = out
    return {"copied": [c for c in langs if c in index], "new": [c for c in langs if c not in index],
            "dropped": [c for c in saved_langs if c not in set(langs)]}


def load_exactly(model: nn.Module, sd: dict[str, torch.Tensor], ckpt: Path) -> None:
    """Copy ``sd`` into ``model``'s parameters and persistent buffers; one line naming every tensor whose shape
    differs (both shapes), is missing or is extra, and nothing copied then."""
    own = model.state_dict()
    skip = ("_float_tensor",)  # placeholders some modules keep in their state dict, not weights
    missing = [k for k in own if k not in sd and not k.endswith(skip)]
    extra = [k for k in sd if k not in own]
    shapes = [(k, tuple(sd[k].shape), tuple(own[k].shape)) for k in own if k in sd and sd[k].shape != own[k].shape]
    if missing or extra or shapes:
        parts = [f"{k}: checkpoint {list(a)}, this run {list(b)}" for k, a, b in shapes[:8]]
        parts += [f"missing in the checkpoint: {', '.join(missing[:5])}"] if missing else []
        parts += [f"not in this run's model: {', '.join(extra[:5])}"] if extra else []
        raise ScaletrainError(f"cannot warm-start from {ckpt} (train.init_from): its weights do not fit this run's "
                              f"model ({'; '.join(parts)}); use a checkpoint of the same model and vocabulary")
    with torch.no_grad():
        for k, t in own.items():
            if k in sd:
                t.copy_(sd[k].to(t.dtype))
