"""One decoder step as both searches take it: the model's log-probabilities with only content ids and EOS
allowed, the EOS constraints of the length limits, and the :class:`Hypothesis` a search returns.

Model API decoded against (see ``scaletrain.models``)::

    enc = model.encode(src)                                # EncoderOut, batch-first
    enc = enc.index_select(index)                          # reorder / expand / shrink the batch dim
    logits, cache = model.decode_step(tokens, step, enc, cache)   # tokens [N] = input at position `step`
    cache = model.reorder_cache(cache, index)

The decoder input at step 0 is the target-language tag (``tgt_in = [__tgt__] + bytes``), so the tag is
forced and never emitted. At every step only byte ids and EOS can be generated; PAD, BOS, UNK and the
language tags are masked to ``-inf``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from scaletrain.errors import ScaletrainError
from scaletrain.vocab import BYTE_OFFSET, EOS, LANG_OFFSET


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]  # byte ids, no tag, no EOS
    score: float  # normalised: sum of log-probs (bytes + EOS) / (len(tokens) + 1) ** lenpen
    cut: bool = False  # stopped before a byte that made the output invalid UTF-8 (no EOS; score without EOS)


def model_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def model_max_positions(model) -> int | None:
    for obj in (model, getattr(model, "cfg", None), getattr(model, "config", None)):
        mp = getattr(obj, "max_positions", None) if obj is not None else None
        if isinstance(mp, int) and mp > 0:
            return mp
    return None


def allowed_mask(vocab_size: int, device, dtype=torch.float32, lang_offset: int = LANG_OFFSET) -> torch.Tensor:
    """0 for content ids (bytes or subword pieces: ``BYTE_OFFSET .. lang_offset - 1``) and EOS, -inf for
    everything else (PAD, BOS, UNK, language tags)."""
    if vocab_size <= EOS:
        raise ScaletrainError(f"model vocabulary of size {vocab_size} has no EOS id ({EOS})")
    mask = torch.full((vocab_size,), -math.inf, device=device, dtype=dtype)
    mask[BYTE_OFFSET : min(lang_offset, vocab_size)] = 0.0
    mask[EOS] = 0.0
    return mask


def step_lprobs(model, tokens, step, enc, cache, mask_cache: dict):
    logits, cache = model.decode_step(tokens, step, enc, cache)
    lprobs = torch.log_softmax(logits.float(), dim=-1)
    V = lprobs.shape[-1]
    if mask_cache.get("V") != V:
        mask_cache["V"] = V
        mask_cache["mask"] = allowed_mask(V, lprobs.device, lang_offset=mask_cache["lang_offset"])
    return lprobs.add_(mask_cache["mask"]), cache


def constrain_eos(lprobs: torch.Tensor, step: int, min_len: int, row_max: torch.Tensor, min_row_max: int,
                   beams: int = 1) -> None:
    """In place: no EOS before ``min_len`` unless the length limit forces it; a row at its length limit
    (``step >= row_max``) can only emit EOS. ``row_max``: the limit of each sentence, whose ``beams``
    consecutive rows share it. ``min_row_max = min(row_max)``: before it no row is at its limit, and one
    column write does (no per-row test, no host sync)."""
    if step < min_row_max:
        if step < min_len:
            lprobs[:, EOS] = -math.inf
        return
    if beams > 1:
        row_max = row_max.repeat_interleave(beams)
    if step < min_len:  # no EOS before min_len, unless the length limit forces it
        eos_col = lprobs[:, EOS].clone()
        lprobs[:, EOS] = torch.where(step >= row_max, eos_col, torch.full_like(eos_col, -math.inf))
    forced = step >= row_max
    if bool(forced.any()):
        eos_col = lprobs[:, EOS].clone()
        lprobs[forced] = -math.inf
        lprobs[forced, EOS] = eos_col[forced]
