"""Convolutional self-attention variants for the encoder (docs/MODELS.md §6-§8; not reproduced: §13).

- ``msc``:  MSC, a fixed kernel per head-chunk of the layer *input*, before the Q/K/V projections.
- ``msha``: MSHA, a fixed kernel per head, applied to that head's projected q, k and v.
- ``moce``: Ada-MSHA / MoCE, per token and head a top-k mixture of experts {identity, Conv k=1,3,..}
  applied to q, k and v; one expert bank and one router per layer, shared by heads and by Q/K/V.

Each is a ``SelfAttention`` subclass plugged into the chosen encoder layers (``model.conv.layers``)
through the core's ``encoder_self_attn`` factory. Extra weights live under ``.variant.`` so
``count_parameters`` can report them.

Intended behaviour, not the reference's bugs: pad positions are zeroed before every convolution
(sentence edges act as zero padding, so outputs do not depend on the batch), top-k is clamped to
the number of experts, there is no Python randomness in routing, and no host sync on accelerators
(the CPU path reads per-expert counts on the host, where that costs nothing).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.config import ModelConfig
from scaletrain.models.embeddings import make_embeddings
from scaletrain.models.moce_ep import routed_experts_ep, shard_conv_experts
from scaletrain.models.moce_routed import routed_experts
from scaletrain.models.registry import register_model
from scaletrain.models.transformer import EncoderContext, SelfAttention, Transformer
from scaletrain.parallel import ParallelContext
from scaletrain.vocab import LANG_OFFSET, PAD


def _conv_init(weight: torch.Tensor, bias: torch.Tensor) -> None:
    """PyTorch's Conv1d default initialisation (the reference keeps it)."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    fan_in = weight.shape[1] * weight.shape[2]
    bound = 1 / math.sqrt(fan_in)
    nn.init.uniform_(bias, -bound, bound)


def zero_pads(z: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
    """Zero ``z`` [B, H, T, Dh] (or [B, T, D]) at pad positions (``pad_mask`` [B, T], True = pad)."""
    if z.dim() == 4:
        return z.masked_fill(pad_mask[:, None, :, None], 0.0)
    return z.masked_fill(pad_mask[:, :, None], 0.0)


class PerHeadConv(nn.Module):
    """One Conv1d(Dh -> Dh, k_h, 'same' padding, bias) per head h, run as ONE grouped conv.

    Kernel 0 heads use a constant identity kernel (centre tap = I, no bias, no parameters).
    Input/output [N, H, T, Dh].
    """

    def __init__(self, kernels: list[int], head_dim: int):
        super().__init__()
        self.kernels = list(kernels)
        self.head_dim = head_dim
        self.kmax = max(max(self.kernels), 1)
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for k in self.kernels:
            if k > 0:
                w = nn.Parameter(torch.empty(head_dim, head_dim, k))
                b = nn.Parameter(torch.empty(head_dim))
                _conv_init(w, b)
                self.weights.append(w)
                self.biases.append(b)
        eye = torch.zeros(head_dim, head_dim, self.kmax)
        eye[:, :, self.kmax // 2] = torch.eye(head_dim)
        self.register_buffer("identity", eye, persistent=False)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        ws, bs, j = [], [], 0
        for k in self.kernels:
            if k == 0:
                ws.append(self.identity)
                bs.append(self.identity.new_zeros(self.head_dim))
            else:
                p = (self.kmax - k) // 2
                ws.append(F.pad(self.weights[j], (p, p)))
                bs.append(self.biases[j])
                j += 1
        return torch.cat(ws, 0), torch.cat(bs, 0)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        N, H, T, Dh = z.shape
        w, b = self.stacked()
        x = z.transpose(2, 3).reshape(N, H * Dh, T)
        y = F.conv1d(x, w.to(x.dtype), b.to(x.dtype), padding=self.kmax // 2, groups=H)
        return y.view(N, H, Dh, T).transpose(2, 3)


class MSCAttention(SelfAttention):
    """MSC: the layer input, split into head-sized chunks, is convolved per chunk, then projected."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.d_model, cfg.n_heads, cfg.attention_dropout, cfg.kernels)
        self.variant = PerHeadConv(cfg.conv.kernels, self.head_dim)

    def transform_input(self, x: torch.Tensor, ctx: EncoderContext) -> torch.Tensor:
        x = zero_pads(x, ctx.pad_mask)
        return self.merge(self.variant(self.split(x)))


class MSHAAttention(SelfAttention):
    """MSHA: head h's q, k and v each go through that head's convolution (q before scaling)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.d_model, cfg.n_heads, cfg.attention_dropout, cfg.kernels)
        self.variant = PerHeadConv(cfg.conv.kernels, self.head_dim)

    def transform_qkv(self, q, k, v, ctx: EncoderContext):
        B = q.shape[0]
        z = zero_pads(torch.cat([q, k, v], 0), ctx.pad_mask.repeat(3, 1))
        return self.variant(z).split(B, 0)


class MoCEExperts(nn.Module):
    """Expert bank {identity, Conv1d(Dh->Dh, k)} and router, shared by all heads and by Q/K/V.

    Dense path (CUDA, ``model.kernels: torch``): all conv experts run as ONE conv whose output
    channels stack the experts (kernels zero padded to the largest size). CPU path: only the routed
    (slot, expert) pairs are computed (``scaletrain.models.moce_routed``). Routing per (q|k|v, batch,
    head, position): logits = W_r z (or W_r [z; lid]), top-k on the logits, softmax over the k
    selected (fp32), output = sum of the k weighted experts.
    """

    def __init__(self, kernels: list[int], head_dim: int, top_k: int, lid: bool, n_langs: int, *,
                 dispatch: str = "auto", kernel_mode: str = "auto", parallel: ParallelContext | None = None):
        super().__init__()
        self.kernels = list(kernels)
        self.head_dim = head_dim
        self.n_experts = len(self.kernels)
        self.top_k = max(1, min(top_k, self.n_experts))
        self.conv_kernels = [k for k in self.kernels if k > 0]
        self.kmax = max(self.conv_kernels, default=1)
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for k in self.conv_kernels:
            w = nn.Parameter(torch.empty(head_dim, head_dim, k))
            b = nn.Parameter(torch.empty(head_dim))
            _conv_init(w, b)
            self.weights.append(w)
            self.biases.append(b)
        self.lid = lid
        self.router = nn.Linear(head_dim * (2 if lid else 1), self.n_experts, bias=False)
        # receptive radius of each expert, for the statistics
        self.register_buffer(
            "radius", torch.tensor([(k - 1) / 2 if k > 0 else 0.0 for k in self.kernels]), persistent=False
        )
        self.n_langs = max(n_langs, 1)
        # expert index -> identity? / position in the stacked conv output (0 for identities)
        self.register_buffer("is_identity", torch.tensor([k == 0 for k in self.kernels]), persistent=False)
        slots, j = [], 0
        for k in self.kernels:
            slots.append(j if k > 0 else 0)
            j += k > 0
        self.register_buffer("conv_slot", torch.tensor(slots, dtype=torch.long), persistent=False)
        self.collect_stats = True
        self.dispatch = dispatch  # auto | dense | routed (model.moce.dispatch)
        self.kernel_mode = kernel_mode  # model.kernels: auto lets dispatch auto take the routed path on CPU
        self._stats: dict[str, torch.Tensor] | None = None  # plain tensors, never DDP-broadcast buffers
        # expert parallelism (moe.ep_size > 1): each conv expert on one rank of the EP group (moce_ep)
        # (moe.moce_partition hands a context at every ep_size: the conv experts are then marked as experts
        # at ep_size 1 too, so runs at different ep_size have the same optimizer groups and checkpoints
        # reshard between them)
        self.parallel = parallel if parallel is not None and parallel.ep_size > 1 else None
        owners = (shard_conv_experts(self.weights, self.biases, self.conv_kernels, parallel)
                  if parallel is not None else None)
        self.owners = owners if self.parallel is not None else None

    def conv_outputs(self, z: torch.Tensor) -> torch.Tensor:
        """z [N, T, Dh] -> [N, T, n_conv, Dh] (one stacked conv)."""
        return self.expert_bank(z).permute(0, 3, 1, 2)

    def router_logits(self, z: torch.Tensor, lid: torch.Tensor | None) -> torch.Tensor:
        """W_r z, or W_r [z; lid] with lid broadcast over positions. The +lid product is split as
        W_z z + W_lid lid so the lid half is computed once per (sentence, head), not per position,
        and the concatenated [.., 2*Dh] input is never built."""
        if lid is None:
            return self.router(z)
        w = self.router.weight
        return F.linear(z, w[:, : self.head_dim]) + F.linear(lid, w[:, self.head_dim :])

    def route_topk(self, z: torch.Tensor, lid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routing: (weights [..., k] >= 0 summing to 1, expert indices [..., k]).
        Top-k on the router logits first, then softmax over the k selected (in fp32)."""
        top = self.router_logits(z, lid).topk(self.top_k, dim=-1)  # values sorted, largest first
        # softmax over the k selected, written out: over a last dim of 2 this is ~3x faster than
        # torch.softmax on CPU (measured [3, 32, 8, 64, 2]: 0.52 vs 1.64 ms)
        v = top.values.float()
        e = (v - v[..., :1]).exp()
        return (e / e.sum(-1, keepdim=True)).to(z.dtype), top.indices

    def route(self, z: torch.Tensor, lid: torch.Tensor | None) -> torch.Tensor:
        """Dense routing weights [..., E]: >= 0, exactly k non-zero, summing to 1."""
        w, idx = self.route_topk(z, lid)
        return w.new_zeros(*w.shape[:-1], self.n_experts).scatter(-1, idx, w)

    def expert_bank(self, z: torch.Tensor) -> torch.Tensor:
        """z [N, T, Dh] -> the conv experts' outputs [N, n_conv, Dh, T] from ONE conv (output channels
        stacked, kernels zero-padded to the largest size); identity experts are not materialised."""
        N, T, Dh = z.shape
        ws = [F.pad(w, ((self.kmax - w.shape[-1]) // 2,) * 2) for w in self.weights]
        w = torch.cat(ws, 0).to(z.dtype)
        b = torch.cat(list(self.biases), 0).to(z.dtype)
        if z.device.type == "cpu":
            # z [N, T, Dh] IS the channels-last layout of an [N, Dh, 1, T] image: a 2-D conv over it runs
            # ~1.9x faster (fwd+bwd) than conv1d on the transposed view (oneDNN, measured at N 768, T 64,
            # Dh 36, 5 experts); the output [N, n_conv*Dh, 1, T] is channels-last too: [N, T, n_conv*Dh]
            x = z.transpose(1, 2).unsqueeze(2).contiguous(memory_format=torch.channels_last)
            w2 = w.unsqueeze(2).contiguous(memory_format=torch.channels_last)
            y = F.conv2d(x, w2, b, padding=(0, self.kmax // 2)).squeeze(2)  # [N, n_conv*Dh, T]
        else:
            y = F.conv1d(z.transpose(1, 2), w, b, padding=self.kmax // 2)  # [N, n_conv*Dh, T]
        return y.view(N, len(ws), Dh, T)

    def forward(self, z: torch.Tensor, pad_mask: torch.Tensor, lid: torch.Tensor | None, lang: torch.Tensor | None):
        """z [3, B, H, T, Dh] (q, k, v), pad_mask [B, T], lid [B, H, Dh] or None, lang [B] or None.

        Two equivalent paths (``routed_path``): on CPU only the routed slots are computed
        (``moce_routed``); elsewhere all conv experts run in one conv and per (slot, position) only
        the top-k outputs are gathered and mixed (identity picks add w * z directly): no dense [.., E]
        mixing, no host sync. Output rows at pad positions are 0.
        """
        G, B, H, T, Dh = z.shape
        N, K = G * B * H, self.top_k
        # zero the pads as a multiply by a keep mask laid out [1, B, 1, T*Dh]: on CPU ~4x faster than
        # masked_fill with a [1, B, 1, T, 1] mask (its backward too)
        keep = (~pad_mask).to(z.dtype)[None, :, None, :, None].expand(1, B, 1, T, Dh).reshape(1, B, 1, T * Dh)
        z = (z.reshape(G, B, H, T * Dh) * keep).view(G, B, H, T, Dh)
        lid_in = None if lid is None else lid[None, :, :, None, :]
        w, idx = self.route_topk(z, lid_in)  # [3, B, H, T, K]
        if self.collect_stats and lang is not None:
            with torch.no_grad():
                dense = w.new_zeros(G, B, H, T, self.n_experts).scatter(-1, idx, w)
            self._accumulate(dense, pad_mask, lang)
        zf = z.reshape(N, T, Dh)
        if self.parallel is not None:
            real = (~pad_mask)[None, :, None, :].expand(G, B, H, T)
            out = routed_experts_ep(zf, w.reshape(N, T, K), idx.reshape(N, T, K), real, self.kernels,
                                    self.is_identity, self.weights, self.biases, self.owners, self.parallel)
            return out.view(G, B, H, T, Dh)
        if self.routed_path(z):
            real = (~pad_mask)[None, :, None, :].expand(G, B, H, T)
            out = routed_experts(zf, w.reshape(N, T, K), idx.reshape(N, T, K), real, self.kernels,
                                 self.is_identity, self.weights, self.biases)
            return out.view(G, B, H, T, Dh)
        wk = w.reshape(N, T, K).transpose(1, 2)  # [N, K, T]
        ik = idx.reshape(N, T, K).transpose(1, 2)
        is_id = self.is_identity[ik]  # [N, K, T] bool
        out = None
        if self.conv_kernels:
            y = self.expert_bank(zf)  # [N, C, Dh, T]
            slot = self.conv_slot[ik]  # identity picks read slot 0 with weight 0
            picked = y.gather(1, slot[:, :, None, :].expand(N, K, Dh, T))  # [N, K, Dh, T]
            out = (picked * wk.masked_fill(is_id, 0.0)[:, :, None, :]).sum(1)  # [N, Dh, T]
        if len(self.conv_kernels) < self.n_experts:
            w_id = wk.masked_fill(~is_id, 0.0).sum(1)  # [N, T]
            ident = zf.transpose(1, 2) * w_id[:, None, :]
            out = ident if out is None else out + ident
        # pad rows are 0 on both paths (they are never attended to and never reach a real position)
        return (out.transpose(1, 2).reshape(G, B, H, T * Dh) * keep).view(G, B, H, T, Dh)

    @torch.no_grad()
    def join_exchange(self) -> None:
        """Take part in this layer's expert exchanges with no rows (lock-step decoding under expert
        parallelism, ``scaletrain.parallel.lockstep``: a rank with nothing to encode)."""
        z = self.router.weight.new_zeros(0, 1, self.head_dim)
        idx = torch.zeros(0, 1, self.top_k, dtype=torch.long, device=z.device)
        routed_experts_ep(z, z.new_zeros(0, 1, self.top_k), idx, idx.new_zeros(0, 1, dtype=torch.bool), self.kernels,
                          self.is_identity, self.weights, self.biases, self.owners, self.parallel)

    def routed_path(self, z: torch.Tensor) -> bool:
        """Evaluate only the routed slots (``moce_routed``) instead of the dense one-conv bank: on CPU
        with ``model.kernels: auto`` (needs host-side counts, free on CPU, a device sync elsewhere)."""
        return self.dispatch == "routed" or (self.dispatch == "auto" and z.device.type == "cpu"
                                             and self.kernel_mode == "auto")

    # ---- statistics (device-side accumulation, no host sync) ---------------------------
    @torch.no_grad()
    def _accumulate(self, weights: torch.Tensor, pad_mask: torch.Tensor, lang: torch.Tensor) -> None:
        weights = weights.float()  # statistics in fp32 whatever the model's dtype
        real = (~pad_mask).float()[None, :, None, :, None]  # [1, B, 1, T, 1]
        selected = (weights > 0).to(torch.float32) * real  # [3, B, H, T, E]
        per_sentence = selected.sum(dim=(0, 2, 3))  # [B, E]
        radius = (weights * self.radius.to(weights.device, torch.float32)).sum(-1, keepdim=True) * real
        radius_sum = radius.sum(dim=(0, 2, 3, 4))  # [B]
        tokens = real.sum(dim=(0, 2, 3, 4)) * weights.shape[0] * weights.shape[2]  # [B]
        if self._stats is None or self._stats["selected"].device != weights.device:
            dev = weights.device
            self._stats = {
                "selected": torch.zeros(self.n_langs, self.n_experts, device=dev),
                "radius": torch.zeros(self.n_langs, device=dev),
                "tokens": torch.zeros(self.n_langs, device=dev),
            }
        s = self._stats
        s["selected"].index_add_(0, lang, per_sentence)
        s["radius"].index_add_(0, lang, radius_sum)
        s["tokens"].index_add_(0, lang, tokens)

    def routing_stats(self, reset: bool = True) -> dict:
        """Per source language (manifest index): ``selection`` = share of (q|k|v, head, token)
        routing slots that picked each expert (rows sum to top_k), ``mean_radius`` = routing-weighted
        kernel radius (k-1)/2 averaged over tokens, ``tokens`` = routed slots. Host copy happens here."""
        if self._stats is None:
            return {"kernels": self.kernels, "top_k": self.top_k, "selection": [], "mean_radius": [], "tokens": []}
        s = self._stats
        tok = s["tokens"].clamp(min=1)
        out = {
            "kernels": self.kernels,
            "top_k": self.top_k,
            "selection": (s["selected"] / tok[:, None]).tolist(),
            "mean_radius": (s["radius"] / tok).tolist(),
            "tokens": s["tokens"].tolist(),
        }
        if reset:
            self._stats = None
        return out


class AdaMSHAAttention(SelfAttention):
    """Ada-MSHA (MoCE): q, k, v of every head go through the routed expert mixture, then SDPA."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, parallel: ParallelContext | None = None):
        super().__init__(cfg.d_model, cfg.n_heads, cfg.attention_dropout, cfg.kernels)
        moce = cfg.moce
        self.route_scaled_q = moce.route_scaled_q
        self.variant = MoCEExperts(cfg.conv.kernels, self.head_dim, moce.top_k, moce.lid, vocab_size - LANG_OFFSET,
                                   dispatch=moce.dispatch, kernel_mode=cfg.kernels, parallel=parallel)

    @staticmethod
    def source_tag(src: torch.Tensor) -> torch.Tensor:
        """Id of the first non-pad token of each row (the ``__src__`` tag; works for left padding)."""
        first = src.ne(PAD).to(torch.int8).argmax(dim=1)
        return src.gather(1, first[:, None]).squeeze(1)

    def forward(self, x: torch.Tensor, ctx: EncoderContext, attn_mask=None):
        B, T, _ = x.shape
        q, k, v = self.split(self.q_proj(x)), self.split(self.k_proj(x)), self.split(self.v_proj(x))
        scale = None
        if self.route_scaled_q:  # reference: q scaled by Dh^-1/2 before routing and experts
            q = q * self.head_dim**-0.5
            scale = 1.0
        tag = self.source_tag(ctx.src_tokens)
        lid = None
        if self.variant.lid:
            lid = ctx.embeddings(tag, "raw").view(B, self.n_heads, self.head_dim).to(q.dtype)
        lang = (tag - LANG_OFFSET).clamp(0, self.variant.n_langs - 1)
        z = self.variant(torch.stack([q, k, v]), ctx.pad_mask, lid, lang)
        q, k, v = z.unbind(0)
        return self.attend(q, k, v, ctx.key_mask() if attn_mask is None else attn_mask, scale=scale)


# ---------------------------------------------------------------------------------------
# builders
# ---------------------------------------------------------------------------------------
def _build(cfg: ModelConfig, vocab_size: int, pieces, make_attn, ffn=None) -> Transformer:
    """The Transformer with ``make_attn()`` as self-attention of the encoder layers ``model.conv.layers``."""
    layers = set(cfg.conv.layers)

    def factory(i: int):
        return make_attn() if i in layers else None

    embeddings = make_embeddings(cfg, vocab_size, pieces)
    return Transformer(cfg, vocab_size, embeddings=embeddings, encoder_self_attn=factory, ffn=ffn)


@register_model("msc")
def build_msc(cfg: ModelConfig, vocab_size: int, pieces=None, ffn=None, parallel=None) -> Transformer:
    return _build(cfg, vocab_size, pieces, lambda: MSCAttention(cfg), ffn)


@register_model("msha")
def build_msha(cfg: ModelConfig, vocab_size: int, pieces=None, ffn=None, parallel=None) -> Transformer:
    return _build(cfg, vocab_size, pieces, lambda: MSHAAttention(cfg), ffn)


@register_model("moce")
def build_moce(cfg: ModelConfig, vocab_size: int, pieces=None, ffn=None,
               parallel: ParallelContext | None = None) -> Transformer:
    """``parallel``: with ep_size > 1 the conv experts of every Ada-MSHA layer are spread over the EP
    group (``scaletrain.models.moce_ep``)."""
    return _build(cfg, vocab_size, pieces, lambda: AdaMSHAAttention(cfg, vocab_size, parallel), ffn)
