"""Greedy and batched beam-search decoding for byte-level models: :func:`generate` and
:func:`generate_with_scores`, the one entry of every decoding (``translate``, ``evaluate``, the in-training
BLEU, export checks).

The model API decoded against, and the forced target-language tag: ``decode_step.py``.

The parts: one decoder step and the hypothesis (``decode_step.py``), greedy decoding (here), beam search
(``beam.py``), the stop at invalid UTF-8 (``utf8_guard.py``), the length limits (``bounds.py``), and batches
of requests translated in input order (``requests.py``: ``translate_examples``).
"""
from __future__ import annotations

import math

import torch

from scaletrain.errors import ScaletrainError
from scaletrain.eval.beam import beam_search
from scaletrain.eval.bounds import DEFAULT_MAX_LEN_A, DEFAULT_MAX_LEN_B, max_output_lengths
from scaletrain.eval.decode_step import Hypothesis, constrain_eos, model_device, model_max_positions, step_lprobs
from scaletrain.eval.utf8_guard import HostUtf8Guard, complete_prefix
from scaletrain.vocab import EOS, LANG_OFFSET

__all__ = ["generate", "generate_with_scores"]


def _check_inputs(src, tgt_tags, beam, lenpen, max_len_a, max_len_b, min_len, lang_offset=LANG_OFFSET):
    if not isinstance(src, torch.Tensor) or src.dim() != 2 or src.dtype not in (torch.int64, torch.int32):
        raise ScaletrainError("generate: src must be an integer tensor of shape [batch, src_len]")
    if src.shape[0] == 0:
        raise ScaletrainError("generate: empty batch")
    if isinstance(tgt_tags, int):
        tgt_tags = torch.full((src.shape[0],), tgt_tags, dtype=torch.int64)
    elif not isinstance(tgt_tags, torch.Tensor):
        tgt_tags = torch.as_tensor(list(tgt_tags), dtype=torch.int64)
    tgt_tags = tgt_tags.to(torch.int64).reshape(-1)
    if tgt_tags.shape[0] != src.shape[0]:
        raise ScaletrainError(
            f"generate: got {tgt_tags.shape[0]} target tags for a batch of {src.shape[0]} sentences"
        )
    if bool((tgt_tags < lang_offset).any()):
        raise ScaletrainError(
            f"generate: target tags must be language-tag ids (>= {lang_offset}, see scaletrain.vocab); "
            f"got {tgt_tags.tolist()}"
        )
    if not isinstance(beam, int) or beam < 1:
        raise ScaletrainError(f"generate: beam must be an integer >= 1, got {beam!r}")
    if not math.isfinite(lenpen):
        raise ScaletrainError(f"generate: lenpen must be finite, got {lenpen!r}")
    if max_len_a < 0 or max_len_b < 0:
        raise ScaletrainError(f"generate: max_len_a/max_len_b must be >= 0, got {max_len_a}, {max_len_b}")
    if min_len < 0:
        raise ScaletrainError(f"generate: min_len must be >= 0, got {min_len}")
    return src.to(torch.int64), tgt_tags


class _DecodeMode:
    """Eval mode and ``torch.inference_mode`` for the duration (as Hugging Face ``generate()`` decodes: no
    autograd bookkeeping per op, ~5% less CPU time than ``no_grad`` in beam search, benchmarks/bench_generate.py);
    afterwards the model's previous mode is restored and every tensor it created while decoding and kept on a
    module (routing statistics, caches: in buffers, attributes, or dicts, lists and tuples of them) is replaced
    by a normal clone, so that training can update it in place again (an inference tensor refuses that)."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.was_training = bool(getattr(self.model, "training", False))
        self.model.eval()
        self.inference = torch.inference_mode()
        self.inference.__enter__()

    def __exit__(self, *exc):
        self.inference.__exit__(*exc)
        if isinstance(self.model, torch.nn.Module):
            for module in self.model.modules():
                _normal_tensors(module._buffers)
                _normal_tensors(module.__dict__, skip=_MODULE_INTERNALS)
        if self.was_training:
            self.model.train()


_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))  # parameters, buffers, submodules, hooks, flags


def _normal(value, depth: int = 0):
    """``value`` with inference tensors replaced by normal clones: a tensor, or a dict or list (changed in
    place) or tuple (rebuilt) holding them, nested up to 4 deep; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.is_inference() else value
    if depth >= 4:
        return value
    if isinstance(value, (dict, list)):
        _normal_tensors(value, depth=depth + 1)
        return value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        new = tuple(_normal(v, depth + 1) for v in value)
        return new if any(a is not b for a, b in zip(new, value)) else value
    return value


def _normal_tensors(store, skip=(), depth: int = 0) -> None:
    """In place: every value of the dict or list ``store`` (keys in ``skip`` left alone) made normal."""
    items = store.items() if isinstance(store, dict) else enumerate(store)
    for k, v in list(items):
        if k not in skip:
            new = _normal(v, depth)
            if new is not v:
                store[k] = new


# ----------------------------------------------------------------------------------------------
# public entry points


def generate(
    model,
    src: torch.Tensor,
    tgt_tags,
    *,
    beam: int = 1,
    lenpen: float = 1.0,
    max_len_a: float = DEFAULT_MAX_LEN_A,
    max_len_b: int = DEFAULT_MAX_LEN_B,
    min_len: int = 0,
    max_positions: int | None = None,
    lang_offset: int = LANG_OFFSET,
    stop_invalid_utf8: bool = False,
) -> list[list[int]]:
    """Decode a batch; returns per row the generated byte ids (no tag, no EOS).

    ``src``: [B, S] right-padded ``[__src__] + bytes + [EOS]``. ``tgt_tags``: [B] target-language tag ids
    (or one int for all rows). ``beam == 1`` is greedy decoding (a fast path with the same result as beam
    search with one beam). ``max_positions`` defaults to the model's ``max_positions`` if it exposes one.
    ``lang_offset``: the first language-tag id (``vocab.lang_offset``; bytes: ``LANG_OFFSET``); ids from
    ``BYTE_OFFSET`` up to it are the content (bytes or subword pieces) that may be generated.
    ``stop_invalid_utf8``: end a hypothesis before a byte that makes it invalid UTF-8 (module doc).
    """
    return [h.tokens for h in generate_with_scores(
        model, src, tgt_tags, beam=beam, lenpen=lenpen, max_len_a=max_len_a, max_len_b=max_len_b,
        min_len=min_len, max_positions=max_positions, lang_offset=lang_offset, stop_invalid_utf8=stop_invalid_utf8,
    )]


def generate_with_scores(
    model,
    src: torch.Tensor,
    tgt_tags,
    *,
    beam: int = 1,
    lenpen: float = 1.0,
    max_len_a: float = DEFAULT_MAX_LEN_A,
    max_len_b: int = DEFAULT_MAX_LEN_B,
    min_len: int = 0,
    max_positions: int | None = None,
    lang_offset: int = LANG_OFFSET,
    stop_invalid_utf8: bool = False,
    row_limits: torch.Tensor | None = None,
) -> list[Hypothesis]:
    """Like :func:`generate` but returns the best :class:`Hypothesis` (tokens, normalised score, cut).
    ``row_limits`` ([B] ints): a tighter output limit per row (the smaller of it and ``max_len_a/b`` holds)."""
    src, tgt_tags = _check_inputs(src, tgt_tags, beam, lenpen, max_len_a, max_len_b, min_len, lang_offset)
    if max_positions is None:
        max_positions = model_max_positions(model)
    device = model_device(model)
    src = src.to(device)
    tgt_tags = tgt_tags.to(device)
    max_lens = max_output_lengths(src, max_len_a, max_len_b, max_positions)
    if row_limits is not None:
        max_lens = torch.minimum(max_lens, torch.as_tensor(row_limits, dtype=torch.int64, device=device).clamp(min=0))
    # inference mode; what a model created on its modules while decoding (e.g. routing statistics) is made a
    # normal tensor again at the end, so the next in-place update in training works (_DecodeMode)
    with _DecodeMode(model):
        if beam == 1:
            return _greedy(model, src, tgt_tags, max_lens, min_len, lenpen, lang_offset, stop_invalid_utf8)
        return beam_search(model, src, tgt_tags, max_lens, min_len, beam, lenpen, lang_offset, stop_invalid_utf8)


# ----------------------------------------------------------------------------------------------
# greedy


def _greedy(model, src, tgt_tags, max_lens, min_len, lenpen, lang_offset=LANG_OFFSET,
            stop_invalid_utf8: bool = False) -> list[Hypothesis]:
    B = src.shape[0]
    enc = model.encode(src)
    cache = None
    tokens = tgt_tags.clone()
    alive = torch.arange(B, device=src.device)  # original row of each live row
    alive_max = max_lens.clone()
    score = torch.zeros(B, dtype=torch.float64, device=src.device)
    out: list[list[int]] = [[] for _ in range(B)]
    result: list[Hypothesis | None] = [None] * B
    mask_cache: dict = {"lang_offset": lang_offset}
    guard = HostUtf8Guard(B) if stop_invalid_utf8 else None
    step = 0
    while alive.numel():
        lprobs, cache = step_lprobs(model, tokens, step, enc, cache, mask_cache)
        constrain_eos(lprobs, step, min_len, alive_max, int(alive_max.min()))
        best_lp, best = lprobs.max(dim=-1)
        score = score + best_lp.double()
        best_cpu = best.tolist()
        # per row: 0 = continues, 1 = EOS, 2 = cut before an invalid byte (its log-prob taken off again)
        status = [int(t == EOS) for t in best_cpu]
        if guard is not None:
            guard.advance(best_cpu, status)
        for r, row in enumerate(alive.tolist()):
            if status[r] == 1:
                result[row] = Hypothesis(out[row], float(score[r]) / float(len(out[row]) + 1) ** lenpen)
            elif status[r] == 2:
                kept = complete_prefix(out[row])
                sc = float(score[r]) - float(best_lp[r])
                result[row] = Hypothesis(kept, sc / float(len(kept) + 1) ** lenpen, cut=True)
            else:
                out[row].append(best_cpu[r])
        if any(status):
            rows = [r for r, st in enumerate(status) if st == 0]
            if not rows:
                break
            keep = torch.tensor(rows, dtype=torch.int64, device=src.device)
            alive, alive_max, score, best = alive[keep], alive_max[keep], score[keep], best[keep]
            if guard is not None:
                guard.keep(rows)
            enc = enc.index_select(keep)
            cache = model.reorder_cache(cache, keep)
        tokens = best
        step += 1
    return result  # type: ignore[return-value]
