"""Sparse mixture-of-experts feed-forward blocks (the top-level ``moe`` config section).

A ``MoEFeedForward`` replaces the dense feed-forward block of every ``moe.every``-th encoder and
decoder layer (``moe_ffn_factory``). Per token (a row of the flattened [B*T, D] input):

1. Router, in fp32 whatever the training precision: probabilities p = softmax(x W_r) over the E
   experts; the token picks its top-k experts (token choice, k = ``moe.top_k``). Combine weights:
   the top-k probabilities renormalised to sum to 1 when k > 1 (GShard), the raw probability when
   k = 1 (Switch; otherwise the router would get no gradient from the output).
2. Capacity (``moe.capacity_factor`` c > 0 only; default 0 = dropless): each expert takes at most
   ceil(c * N * k / E) of this rank's N*k (token, slot) pairs. Drop policy: first choices before
   second choices, then token order; a dropped pair contributes nothing (the residual carries the
   token), the other slot's weight is not renormalised. Dropped pairs are counted (``moe_stats``).
3. Load-balancing loss (Switch / GShard): aux = coef * E * sum_e f_e * P_e, with f_e the fraction
   of the N*k routing choices that picked expert e (before drops) and P_e the mean router
   probability of e over the N tokens; 1 * coef for perfectly uniform routing. Kept in
   ``self.aux_loss`` after each forward; the model sums them (``Transformer.last_aux_loss``).
4. Expert computation: the kept pairs are sorted by expert (``scaletrain.parallel.exchange``),
   sent to the rank holding their expert when the parallel context has ep_size > 1, computed
   there (``Experts``: each expert is an FFN fc1 -> activation -> dropout -> fc2), sent back and
   summed with the combine weights. An optional shared expert (a dense FFN) adds its output for
   every token.

Host reads (device syncs on an accelerator; counted by ``scaletrain.models.host_reads``): on one
rank, where ``torch._grouped_mm`` applies (CPU fp32/bf16/fp16, compiled bf16 only; CUDA bf16 on compute capability 9+),
none: all N*k (token, slot) rows run through one grouped GEMM per projection with device-side group
ends, the dropped and pad pairs sorted last into the last expert's group with combine weight 0.
Otherwise one per layer and forward: the per-expert counts (the per-expert loop's sizes; over EP,
the all-to-all split sizes). The statistics stay on the device until ``moe_stats`` reads them.

Expert parameters are stacked per layer ([local experts, ...]) and carry ``p.expert = True``
(``is_expert_param``): an engine puts them in their own optimizer group and reduces their gradients
over the expert-data-parallel group only; checkpoint consolidation reads the same mark, and
``Experts.first_expert`` / ``num_experts`` say which slice of the layer's experts a rank holds.

Padding: encoder and decoder layers hand their pad masks in (source pads; decoder-input pads), and
pad positions are neither routed nor counted in the aux loss or the capacity (their output is 0).
The router still sees every row (a fixed shape: selecting the real rows would be a host read).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models import kernels
from scaletrain.models.config import ModelConfig, MoEConfig
from scaletrain.models.transformer import FeedForward
from scaletrain.parallel import ParallelContext
from scaletrain.parallel.exchange import combine, dispatch, expert_counts, permute, unpermute


def is_expert_param(p: torch.Tensor) -> bool:
    """Whether ``p`` is an expert parameter (held by one EP rank, replicated over its EDP group)."""
    return bool(getattr(p, "expert", False))


_GROUPED_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_mm_ok(x: torch.Tensor, ffn_dim: int) -> bool:
    """``torch._grouped_mm`` exists on this build and applies without a host read: on CUDA its CUTLASS
    kernel (compute capability >= 9.0, bf16 activations, every row stride a multiple of 16 bytes:
    d_model and the expert hidden size multiples of 8; the GPU suite's moe-grouped-gemm check); on
    the CPU in fp32/bf16/fp16 (PyTorch's loop over the groups: fwd+bwd 1.7x faster than ours, measured
    [2048, 256] x 8 experts of 1024, fp32, 1 thread), with the same 16-byte row strides. Elsewhere
    (fp64, odd sizes, older CUDA) the per-expert loop. Under ``torch.compile`` (``engine.compile``) bf16
    only: dynamo traces the call with the op's meta function, which takes CUDA's rule (bf16) on every
    device, and fails on fp32 CPU activations that the op itself accepts."""
    if not hasattr(torch, "_grouped_mm") or (x.shape[-1] * x.element_size()) % 16 or (ffn_dim * x.element_size()) % 16:
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False
    if x.device.type == "cpu":
        return x.dtype in _GROUPED_CPU_DTYPES
    return x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)


class Router(nn.Linear):
    """Router logits [N, E] in fp32 whatever the precision around it (autocast off, weights upcast).
    A module of its own so that ZeRO-3 gathers its weight when it is called."""

    def __init__(self, dim: int, num_experts: int):
        super().__init__(dim, num_experts, bias=False)
        nn.init.normal_(self.weight, std=dim**-0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=h.device.type, enabled=False):
            return F.linear(h.float(), self.weight.float())


class Experts(nn.Module):
    """This rank's experts of one layer, stacked: fc1 [n, D, F] + [n, F], fc2 [n, F, D] + [n, D].

    Initialised expert by expert over ALL ``num_experts`` experts of the layer (xavier like the dense
    FFN, zero biases), keeping only the local ones: the random stream is consumed identically at
    every ep_size, so an ep_size=P model holds exactly the slices of the ep_size=1 model built from
    the same seed."""

    def __init__(self, num_experts: int, local: range, dim: int, ffn_dim: int, activation: str,
                 activation_dropout: float, kernel_mode: str = "auto"):
        super().__init__()
        n = len(local)
        self.num_experts, self.first_expert, self.ffn_dim = num_experts, local.start, ffn_dim
        self.w1 = nn.Parameter(torch.empty(n, dim, ffn_dim))
        self.b1 = nn.Parameter(torch.zeros(n, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(n, ffn_dim, dim))
        self.b2 = nn.Parameter(torch.zeros(n, dim))
        with torch.no_grad():
            for e in range(num_experts):
                fc1, fc2 = torch.empty(ffn_dim, dim), torch.empty(dim, ffn_dim)  # nn.Linear layout
                nn.init.xavier_uniform_(fc1)
                nn.init.xavier_uniform_(fc2)
                if e in local:
                    self.w1[e - local.start].copy_(fc1.t())
                    self.w2[e - local.start].copy_(fc2.t())
        for p in self.parameters():
            p.expert = True
        self.act = {"relu": F.relu, "gelu": F.gelu}[activation]
        self.activation_dropout, self.kernel_mode = activation_dropout, kernel_mode

    def grouped_ok(self, x: torch.Tensor) -> bool:
        return _grouped_mm_ok(x, self.ffn_dim)  # not w1.shape: ZeRO-3 empties partitioned parameters

    def forward(self, x: torch.Tensor, counts: Optional[list[int]] = None, ends: Optional[torch.Tensor] = None,
                expert: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows ``x`` [m, D] grouped by local expert: ``counts[j]`` rows for local expert j (host ints), or
        ``ends``/``expert`` on the device for the grouped GEMM (``grouped``; no host read). Always called as
        a module (ZeRO-3 gathers the expert weights in the module's forward hooks)."""
        if ends is not None:
            return self.grouped(x, ends, expert)
        if self.grouped_ok(x):
            n = torch.tensor(counts, device=x.device)
            expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), n, output_size=x.shape[0])
            return self.grouped(x, torch.cumsum(n, 0).to(torch.int32), expert)
        out, start = [], 0
        for j, n in enumerate(counts):  # every expert runs, empty or not: its gradient is defined (0)
            out.append(self._ffn(x[start:start + n], self.w1[j], self.b1[j], self.w2[j], self.b2[j]))
            start += n
        return torch.cat(out) if out else x

    def _ffn(self, x, w1, b1, w2, b2):
        h = kernels.dropout(self.act(x @ w1 + b1), self.activation_dropout, self.training, self.kernel_mode)
        return h @ w2 + b2

    def grouped(self, x: torch.Tensor, ends: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """One grouped GEMM per projection (``torch._grouped_mm``): local expert j takes the rows
        ``ends[j-1]:ends[j]`` (int32, on the device: no host read); ``expert`` [m] is each row's expert
        (for the biases). Rows past ``ends[-1]`` are not allowed: the last group must end at m."""
        w1, w2 = self.w1.to(x.dtype), self.w2.to(x.dtype)
        h = _grad_contiguous(torch._grouped_mm(x, w1, offs=ends)) + self.b1.to(x.dtype).index_select(0, expert)
        h = kernels.dropout(self.act(h), self.activation_dropout, self.training, self.kernel_mode)
        return _grad_contiguous(torch._grouped_mm(h, w2, offs=ends)) + self.b2.to(x.dtype).index_select(0, expert)


class _GradContiguous(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: ``_grouped_mm``'s backward on the CPU
    rejects an expanded one (strides 0, e.g. the gradient of a ``sum()``)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _grad_contiguous(x: torch.Tensor) -> torch.Tensor:
    return _GradContiguous.apply(x) if x.requires_grad else x


class MoEFeedForward(nn.Module):
    """Token-choice top-k MoE feed-forward block (see the module docstring); ``forward(x, pad_mask=None)``."""

    takes_pad_mask = True  # the encoder layer hands its pad mask in

    def __init__(self, dim: int, moe: MoEConfig, ffn_dim: int, activation: str, activation_dropout: float,
                 kernel_mode: str = "auto", parallel: Optional[ParallelContext] = None):
        super().__init__()
        self.parallel = parallel or ParallelContext.single()
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.capacity_factor, self.aux_loss_coef = float(moe.capacity_factor), float(moe.aux_loss_coef)
        self.router = Router(dim, moe.num_experts)
        self.experts = Experts(moe.num_experts, self.parallel.local_experts(moe.num_experts), dim, ffn_dim,
                               activation, activation_dropout, kernel_mode)
        self.shared = (FeedForward(dim, ffn_dim, activation, activation_dropout, kernel_mode)
                       if moe.shared_expert else None)
        self.aux_loss: Optional[torch.Tensor] = None
        self._stats = self._new_stats()

    # ---- routing -------------------------------------------------------------------------
    def route(self, h: torch.Tensor):
        """fp32 router over rows ``h`` [N, D] -> (expert index [N, k], combine weights [N, k] fp32,
        probabilities [N, E] fp32)."""
        probs = self.router(h).softmax(dim=-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return idx, weights, probs

    def load_balancing_loss(self, idx: torch.Tensor, probs: torch.Tensor,
                            valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """coef * E * sum_e f_e * P_e over this call's routed tokens (``valid`` [N] bool: the non-pad
        rows; None = all); 0 when there are none."""
        E = self.num_experts
        if valid is None:
            valid = torch.ones(idx.shape[0], dtype=torch.bool, device=idx.device)
        n = valid.sum().to(probs.dtype)
        key = torch.where(valid[:, None], idx, torch.full_like(idx, E)).reshape(-1)
        f = expert_counts(key, E + 1)[:E].to(probs.dtype) / (n * self.top_k).clamp(min=1)
        mean_p = torch.where(valid[:, None], probs, torch.zeros_like(probs)).sum(dim=0) / n.clamp(min=1)
        return self.aux_loss_coef * E * torch.sum(f * mean_p)

    def capacity(self, n_tokens):
        """Pairs an expert may take: ceil(c * n * k / E), for an int or an int tensor (on its device)."""
        if torch.is_tensor(n_tokens):  # the same float64 operations as the int version
            return torch.ceil(self.capacity_factor * n_tokens.to(torch.float64) * self.top_k / self.num_experts)
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.num_experts)

    def apply_capacity(self, idx: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``idx`` with the pairs over capacity set to -1 (first choices first, then token order);
        ``keep`` [N, k] bool: the pairs that are routed at all (False = pad, already out of every queue)."""
        n, k = idx.shape
        flat = idx.t().reshape(-1)  # slot-major: every first choice before any second choice
        onehot = flat[:, None] == torch.arange(self.num_experts, device=idx.device)  # no one_hot: no host read
        if keep is not None:
            onehot = onehot & keep.t().reshape(-1, 1)
        position = (onehot.cumsum(0) * onehot).sum(1) - 1  # place of the pair in its expert's queue
        n_routed = n if keep is None else keep[:, 0].sum()
        within = position < self.capacity(n_routed)
        if keep is not None:
            within = within & keep.t().reshape(-1)
        flat = torch.where(within, flat, torch.full_like(flat, -1))
        return flat.view(k, n).t()

    # ---- forward -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Every row goes through the router (a fixed shape, no host read); pad rows are marked dropped,
        so they are computed by no expert (or, on the grouped path, with weight 0) and their output is 0."""
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        valid = None if pad_mask is None else (~pad_mask).reshape(-1)
        y = self._moe(h, valid)
        if self.shared is not None:
            y = y + self.shared(h)
        if valid is not None:
            y = torch.where(valid[:, None], y, torch.zeros_like(y))
        return y.view(shape)

    @torch.no_grad()
    def join_exchange(self) -> None:
        """Take part in this layer's expert exchanges with no tokens (lock-step decoding under expert
        parallelism, ``scaletrain.parallel.lockstep``: a rank without a step to run)."""
        self._moe(self.router.weight.new_zeros(0, self.router.in_features))

    def _moe(self, h: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        idx, weights, probs = self.route(h)
        self.aux_loss = self.load_balancing_loss(idx, probs, valid)
        routed = idx if valid is None else torch.where(valid[:, None], idx, torch.full_like(idx, -1))
        if self.capacity_factor > 0:
            routed = self.apply_capacity(idx, None if valid is None else valid[:, None].expand_as(idx))
        xp, perm = permute(h, routed, self.num_experts, trim=False)
        if self.parallel.ep_size == 1 and self.experts.grouped_ok(xp) and xp.shape[0] > 0:
            # every (token, slot) row in one grouped GEMM per projection, no host read: the dropped and
            # pad rows (sorted last) ride in the last expert's group and get weight 0 in unpermute
            ends = torch.cumsum(perm.counts, 0)
            ends[-1] = xp.shape[0]
            y = self.experts(xp, ends=ends.to(torch.int32), expert=perm.expert.clamp(max=self.num_experts - 1))
        else:  # the per-expert loop or the expert-parallel exchange: one host read (the counts)
            xl, d = dispatch(xp, perm.counts, self.parallel)
            y = combine(self.experts(xl, d.local_counts), d, self.parallel)
        self._count(routed, valid, perm.counts)
        return unpermute(y, perm, weights)

    @torch.no_grad()
    def _count(self, routed: torch.Tensor, valid: Optional[torch.Tensor], kept: torch.Tensor) -> None:
        """Accumulate the statistics on the device (read by ``moe_stats``, not here: no host read)."""
        if torch._C._current_graph_task_id() != -1:  # a recomputation in backward (activation checkpointing)
            return
        pairs = torch.full((), routed.numel(), dtype=torch.int64, device=kept.device)
        if valid is not None:
            pairs = valid.sum() * routed.shape[1]
        s = self._stats
        if s["load"].device != kept.device:
            s.update({k: v.to(kept.device) for k, v in s.items()})
        s["pairs"] += pairs
        s["dropped"] += pairs - kept.sum()
        s["load"] += kept

    def _new_stats(self) -> dict:
        zero = torch.zeros((), dtype=torch.int64)
        return {"pairs": zero, "dropped": zero.clone(), "load": torch.zeros(self.num_experts, dtype=torch.int64)}

    def moe_stats(self, reset: bool = True) -> dict:
        """This rank's counts since the last reset: routed (token, slot) pairs, dropped pairs, kept
        pairs per expert (all experts of the layer, whichever rank holds them). Reads the device."""
        s = self._stats
        out = {"pairs": int(s["pairs"]), "dropped": int(s["dropped"]), "load": s["load"].tolist()}
        if reset:
            self._stats = self._new_stats()
        return out


def moe_ffn_factory(cfg: ModelConfig, moe: Optional[MoEConfig],
                    parallel: Optional[ParallelContext] = None) -> Optional[Callable[[str, int], Optional[nn.Module]]]:
    """For ``Transformer(ffn=...)``: ``(side, layer index) -> MoEFeedForward`` on the MoE layers,
    None elsewhere (the dense block). None when MoE is off."""
    if moe is None or not moe.enabled():
        return None

    def make(side: str, index: int) -> Optional[nn.Module]:
        if not moe.moe_layer(index):
            return None
        return MoEFeedForward(cfg.d_model, moe, moe.expert_ffn_dim(cfg), cfg.activation, cfg.activation_dropout,
                              cfg.kernels, parallel)

    return make
