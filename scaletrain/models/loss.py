"""Label-smoothed cross-entropy, summed over non-pad target tokens (the trainer normalises).

Smoothing choice (docs/MODELS.md §11, §13.8): the target distribution is
    q(c) = (1 - eps) * [c == y] + eps / (V - 1)   for every class c != pad,   q(pad) = 0,
i.e. epsilon is spread uniformly over all V - 1 non-pad classes (the gold class included), and the
pad class gets no mass (fairseq 0.9 spreads eps/V over every class, fairseq 0.12 eps/(V-1) with the
gold class excluded; both put mass on pad). So per token
    loss = (1 - eps) * nll + eps / (V - 1) * sum_{c != pad} -log p(c).
The softmax itself still runs over all V classes. Everything is computed in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from scaletrain.errors import ScaletrainError


def label_smoothed_ce(
    logits: torch.Tensor, target: torch.Tensor, epsilon: float = 0.1, ignore_index: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits`` [..., V] (any float dtype), ``target`` [...] int64.

    Returns ``(loss_sum, nll_sum, n_tokens)``: fp32 scalars summed over targets != ignore_index,
    and the int64 count of those targets (a tensor, so no host sync).
    """
    if logits.shape[:-1] != target.shape:
        raise ScaletrainError(f"loss: logits {tuple(logits.shape)} do not match target {tuple(target.shape)}")
    if not 0.0 <= epsilon < 1.0:
        raise ScaletrainError(f"label smoothing epsilon must be in [0, 1), got {epsilon}")
    V = logits.shape[-1]
    lprobs = F.log_softmax(logits.float(), dim=-1)
    keep = target.ne(ignore_index)
    safe_target = target.masked_fill(~keep, 0)
    nll = -lprobs.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
    nll = nll.masked_fill(~keep, 0.0)
    nll_sum = nll.sum()
    if epsilon > 0.0:
        smooth = -lprobs.sum(-1)
        if 0 <= ignore_index < V:
            smooth = smooth + lprobs[..., ignore_index]  # exclude the pad class
            n_classes = V - 1
        else:
            n_classes = V
        smooth = smooth.masked_fill(~keep, 0.0)
        loss_sum = (1.0 - epsilon) * nll_sum + (epsilon / n_classes) * smooth.sum()
    else:
        loss_sum = nll_sum
    return loss_sum, nll_sum, keep.sum()
