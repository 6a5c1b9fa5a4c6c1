"""Byte-level Transformer encoder-decoder: the one core every variant plugs into.

Read top to bottom: positions -> embeddings -> attention -> layers -> encoder / decoder -> model.

Conventions
- Tensors are batch first: tokens [B, T], states [B, T, D], per-head states [B, H, T, Dh].
- ``pad_mask`` is a bool tensor [B, S] with True at padding (PAD id 0, see ``scaletrain.vocab``).
- Attention masks handed to ``kernels.attention`` (SDPA or its CPU twin) are bool with True = may attend.
- Targets are right padded (``scaletrain.data.batch``), so in the decoder every pad key lies in the
  future of every real query and the causal mask alone hides it: decoder self-attention runs with
  ``is_causal=True`` and no pad mask (the fast fused kernels accept that).

Plug-in points (variants use these instead of forking the core):
- ``embeddings``: an ``Embeddings`` module with ``encoder_input(tokens)``, ``decoder_input(tokens)``,
  ``output(h)`` and ``raw(tokens)``, called as ``embeddings(x, kind)`` (default: ``SharedEmbeddings`` /
  ``SeparateEmbeddings``; one-hot lives in ``scaletrain.models.onehot``).
- ``frontend``: a module ``(x, ctx) -> (x, pad_mask)`` applied between the embedded input and the
  encoder layers (e.g. byte layers + n-gram fusion replacing the first L layers).
- ``encoder_self_attn``: a factory ``(layer_index) -> nn.Module`` building each encoder layer's
  self-attention; the module is called as ``attn(x, ctx, attn_mask)`` (see ``SelfAttention``).
- ``ffn``: a factory ``(side, layer_index) -> nn.Module | None`` ("encoder" | "decoder") for the
  feed-forward block of each layer, None = the dense ``FeedForward`` (MoE: ``scaletrain.models.moe``).
  A block with ``takes_pad_mask = True`` is called as ``ffn(h, pad_mask)`` (encoder: the source pads;
  decoder: the pad positions of the decoder input); a block
  that keeps a tensor in ``aux_loss`` during forward adds it to ``Transformer.last_aux_loss``.

Incremental decoding (``decode_step`` / ``reorder_cache``): the self-attention K/V live in buffers with
room to grow (``kv_append``). For beam search, ``EncoderOut.expand_beams`` groups the decoder rows by
sentence: cross-attention K/V once per sentence, self-attention K/V in per-beam slots with a slot table
(``DecoderCache.slots``), so a beam reorder moves no K/V. ``python benchmarks/bench_generate.py --reps 7
--threads 1``: 1.47-1.54x Hugging Face ``generate()`` (was 1.21x); see ``scaletrain.eval.generate``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.errors import ScaletrainError
from scaletrain.models import kernels
from scaletrain.models.config import ModelConfig
from scaletrain.vocab import PAD


# ---------------------------------------------------------------------------------------
# positions
# ---------------------------------------------------------------------------------------
def sinusoidal_table(n_positions: int, dim: int) -> torch.Tensor:
    """fairseq's sinusoidal table [n_positions, dim]: sin in the first half, cos in the second.

    Row 0 is all zeros: position 0 is reserved for padding; real tokens use 1, 2, ... (fairseq,
    whose pad id is 1, starts at 2; irrelevant when training from scratch).
    """
    half = dim // 2
    scale = math.log(10000.0) / max(half - 1, 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.float64) * -scale)
    pos = torch.arange(n_positions, dtype=torch.float64)[:, None] * freqs[None, :]
    table = torch.cat([torch.sin(pos), torch.cos(pos)], dim=1)
    if dim % 2 == 1:
        table = torch.cat([table, torch.zeros(n_positions, 1, dtype=torch.float64)], dim=1)
    table[0] = 0.0
    return table.float()


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal positions, zero at pad positions (fairseq ``make_positions``).

    The position of a real token is its rank among the real tokens of its row (1-based), so
    left and right padding give the same encodings at real positions.
    """

    def __init__(self, dim: int, max_positions: int):
        super().__init__()
        self.max_positions = max_positions
        self.register_buffer("table", sinusoidal_table(max_positions + 1, dim), persistent=False)

    def _check(self, n: int) -> None:
        if n > self.max_positions:
            raise ScaletrainError(
                f"sequence of {n} tokens is longer than model.max_positions={self.max_positions}; "
                "raise model.max_positions or lower the byte cap (data max bytes / generation max length)"
            )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self._check(tokens.shape[1])
        real = tokens.ne(PAD)
        positions = torch.cumsum(real, dim=1) * real  # 0 at pads
        return F.embedding(positions, self.table)

    def at(self, step: int, batch: int) -> torch.Tensor:
        """Encoding [B, 1, D] of decoder position ``step`` (0-based; stored at row step + 1)."""
        self._check(step + 1)
        return self.table[step + 1].expand(batch, 1, -1)


# ---------------------------------------------------------------------------------------
# token embeddings (+ output projection)
# ---------------------------------------------------------------------------------------
def _lookup(tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of ``weight``; exactly zero at pad positions even if the (shared) pad row has drifted
    through the output projection's gradient."""
    return F.embedding(tokens, weight, padding_idx=PAD).masked_fill(tokens.eq(PAD)[..., None], 0.0)


def _init_embedding(weight: torch.Tensor, dim: int) -> None:
    nn.init.normal_(weight, mean=0.0, std=dim**-0.5)
    with torch.no_grad():
        weight[PAD].zero_()


class Embeddings(nn.Module):
    """Token representation interface. The core calls ``module(x, kind)`` (a real module call, so
    hooks such as DeepSpeed ZeRO-3 parameter gathering fire) with kind one of:
    "encoder" (scaled source rows), "decoder" (scaled target rows), "output" (logits from h),
    "raw" (unscaled source rows, e.g. the MoCE +lid router input). Rows are zero at pad tokens."""

    def forward(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        if kind == "encoder":
            return self.encoder_input(x)
        if kind == "decoder":
            return self.decoder_input(x)
        if kind == "output":
            return self.output(x)
        if kind == "raw":
            return self.raw(x)
        raise ValueError(f"unknown embeddings call {kind!r}")


class SharedEmbeddings(Embeddings):
    """One matrix for encoder input, decoder input and output projection (share-all)."""

    def __init__(self, vocab_size: int, dim: int, scale: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))
        _init_embedding(self.weight, dim)
        self.scale = math.sqrt(dim) if scale else 1.0

    def raw(self, tokens: torch.Tensor) -> torch.Tensor:
        return _lookup(tokens, self.weight)

    def encoder_input(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.raw(tokens) * self.scale

    decoder_input = encoder_input

    def output(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight)


class SeparateEmbeddings(Embeddings):
    """Independent encoder input, decoder input and output matrices (``share_embeddings: false``)."""

    def __init__(self, vocab_size: int, dim: int, scale: bool):
        super().__init__()
        self.encoder_weight = nn.Parameter(torch.empty(vocab_size, dim))
        self.decoder_weight = nn.Parameter(torch.empty(vocab_size, dim))
        self.output_weight = nn.Parameter(torch.empty(vocab_size, dim))
        for w in (self.encoder_weight, self.decoder_weight, self.output_weight):
            _init_embedding(w, dim)
        self.scale = math.sqrt(dim) if scale else 1.0

    def raw(self, tokens: torch.Tensor) -> torch.Tensor:
        return _lookup(tokens, self.encoder_weight)

    def encoder_input(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.raw(tokens) * self.scale

    def decoder_input(self, tokens: torch.Tensor) -> torch.Tensor:
        return _lookup(tokens, self.decoder_weight) * self.scale

    def output(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.output_weight)


# ---------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------
@dataclass
class EncoderContext:
    """What encoder plug-ins may look at besides the hidden states."""

    src_tokens: torch.Tensor  # [B, S]
    pad_mask: torch.Tensor  # [B, S] bool, True = pad
    embeddings: Any  # the model's Embeddings module (``embeddings(tokens, "raw")`` gives unscaled rows)
    extras: dict = field(default_factory=dict)  # per-forward scratch space for plug-ins
    padded: bool = True  # False: the caller knows src has no PAD (``Transformer.forward(src_padded=False)``)

    def key_mask(self) -> Optional[torch.Tensor]:
        """[B, 1, 1, S] bool, True = may attend; None for a batch without padding (no mask: SDPA may
        then use its fastest kernel, FlashAttention on CUDA, which takes no mask)."""
        return (~self.pad_mask)[:, None, None, :] if self.padded else None


class MultiheadAttention(nn.Module):
    """Projections + SDPA. fairseq initialisation (xavier; q/k/v gain 1/sqrt 2; zero out bias)."""

    def __init__(self, dim: int, n_heads: int, attention_dropout: float, kernel_mode: str = "auto"):
        super().__init__()
        self.dim, self.n_heads, self.head_dim = dim, n_heads, dim // n_heads
        self.attention_dropout = attention_dropout
        self.kernel_mode = kernel_mode  # model.kernels (scaletrain.models.kernels)
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        for p in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(p.weight, gain=2**-0.5)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

    def split(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, H, T, Dh]
        B, T, _ = x.shape
        return x.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)

    def merge(self, x: torch.Tensor) -> torch.Tensor:  # [B, H, T, Dh] -> [B, T, D]
        B, H, T, Dh = x.shape
        return x.transpose(1, 2).reshape(B, T, H * Dh)

    def attend(self, q, k, v, mask=None, is_causal=False, scale=None) -> torch.Tensor:
        p = self.attention_dropout if self.training else 0.0
        o = kernels.attention(q, k, v, mask, is_causal=is_causal, scale=scale, dropout_p=p, mode=self.kernel_mode)
        return self.out_proj(self.merge(o))


class SelfAttention(MultiheadAttention):
    """Encoder self-attention. Variants subclass and override ``transform_input`` (before the
    projections, e.g. MSC) and/or ``transform_qkv`` (per-head q/k/v, e.g. MSHA, Ada-MSHA)."""

    def transform_input(self, x: torch.Tensor, ctx: EncoderContext) -> torch.Tensor:
        return x

    def transform_qkv(self, q, k, v, ctx: EncoderContext):
        return q, k, v

    def forward(self, x: torch.Tensor, ctx: EncoderContext, attn_mask: Optional[torch.Tensor] = None):
        x = self.transform_input(x, ctx)
        q, k, v = self.split(self.q_proj(x)), self.split(self.k_proj(x)), self.split(self.v_proj(x))
        q, k, v = self.transform_qkv(q, k, v, ctx)
        return self.attend(q, k, v, ctx.key_mask() if attn_mask is None else attn_mask)


# ---------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------
class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, activation: str, activation_dropout: float, kernel_mode: str = "auto"):
        super().__init__()
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)
        for p in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(p.weight)
            nn.init.zeros_(p.bias)
        self.act = {"relu": F.relu, "gelu": F.gelu}[activation]
        self.activation_dropout = activation_dropout
        self.kernel_mode = kernel_mode

    def forward(self, x):
        h = self.fc1(x)
        # without autograd, ReLU in place: no second [rows, ffn] tensor per layer and decoding step
        h = torch.relu_(h) if self.act is F.relu and not torch.is_grad_enabled() else self.act(h)
        h = kernels.dropout(h, self.activation_dropout, self.training, self.kernel_mode)
        return self.fc2(h)


class _Residual(nn.Module):
    """One sub-layer wrapper: post-LN ``LN(x + drop(f(x)))`` or pre-LN ``x + drop(f(LN(x)))``."""

    def __init__(self, dim: int, pre_ln: bool, dropout: float, kernel_mode: str = "auto"):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.pre_ln = pre_ln
        self.dropout = dropout
        self.kernel_mode = kernel_mode

    def forward(self, x, fn):
        if self.pre_ln:
            return kernels.residual_dropout(x, fn(self.norm(x)), self.dropout, self.training, self.kernel_mode)
        return self.norm(kernels.residual_dropout(x, fn(x), self.dropout, self.training, self.kernel_mode))


def _feed_forward(cfg: ModelConfig, ffn: Optional[nn.Module]) -> nn.Module:
    if ffn is not None:
        return ffn
    return FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation, cfg.activation_dropout, cfg.kernels)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, self_attn: Optional[nn.Module] = None, ffn: Optional[nn.Module] = None):
        super().__init__()
        d, mode = cfg.d_model, cfg.kernels
        if self_attn is None:
            self_attn = SelfAttention(d, cfg.n_heads, cfg.attention_dropout, mode)
        self.self_attn = self_attn
        self.ffn = _feed_forward(cfg, ffn)
        self.attn_res = _Residual(d, cfg.pre_ln, cfg.dropout, mode)
        self.ffn_res = _Residual(d, cfg.pre_ln, cfg.dropout, mode)

    def forward(self, x, ctx: EncoderContext, attn_mask: Optional[torch.Tensor] = None):
        x = self.attn_res(x, lambda h: self.self_attn(h, ctx, attn_mask))
        if getattr(self.ffn, "takes_pad_mask", False):  # MoE: pads are not routed
            return self.ffn_res(x, lambda h: self.ffn(h, ctx.pad_mask))
        return self.ffn_res(x, self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dropout: Optional[float] = None, ffn: Optional[nn.Module] = None):
        super().__init__()
        d, mode = cfg.d_model, cfg.kernels
        p = cfg.dropout if dropout is None else dropout
        self.self_attn = MultiheadAttention(d, cfg.n_heads, cfg.attention_dropout, mode)
        self.cross_attn = MultiheadAttention(d, cfg.n_heads, cfg.attention_dropout, mode)
        self.ffn = _feed_forward(cfg, ffn)
        self.self_res = _Residual(d, cfg.pre_ln, p, mode)
        self.cross_res = _Residual(d, cfg.pre_ln, p, mode)
        self.ffn_res = _Residual(d, cfg.pre_ln, p, mode)

    def set_residual_dropout(self, p: float) -> None:
        for r in (self.self_res, self.cross_res, self.ffn_res):
            r.dropout = p

    @property
    def residual_dropout(self) -> float:
        return self.self_res.dropout

    def _self(self, h, layer_cache, beam_mask=None):
        a = self.self_attn
        if beam_mask is not None:
            return self._self_beams(h, layer_cache, beam_mask)
        q, k, v = a.split(a.q_proj(h)), a.split(a.k_proj(h)), a.split(a.v_proj(h))
        if layer_cache is None:  # full sequence, causal
            return a.attend(q, k, v, is_causal=True)
        k, v = kv_append(layer_cache.get("k"), k), kv_append(layer_cache.get("v"), v)
        layer_cache["k"], layer_cache["v"] = k, v
        return a.attend(q, k, v)  # one query at the newest position sees every cached key

    def _self_beams(self, h, layer_cache, beam_mask):
        """One decoder step of the beams of each sentence together (``DecoderCache`` with beams > 1): the
        K/V of every beam are kept per sentence in the slot of the beam that computed them ([B, H, t,
        beams * Dh]) and each beam's query sees, through ``beam_mask`` [B, 1, beams, t * beams], the slots
        of its own history, so reordering the beams moves no K/V (``DecoderCache.index_select``)."""
        a = self.self_attn
        N, _, D = h.shape
        K = beam_mask.size(2)
        B, H, Dh = N // K, a.n_heads, a.head_dim

        def per_sentence(x):  # [N, 1, D] -> [B, H, 1, beams, Dh]
            return x.view(B, K, H, Dh).transpose(1, 2).unsqueeze(2)

        k = kv_append(layer_cache.get("k"), per_sentence(a.k_proj(h)))
        v = kv_append(layer_cache.get("v"), per_sentence(a.v_proj(h)))
        layer_cache["k"], layer_cache["v"] = k, v
        t = k.size(2)
        q = a.q_proj(h).view(B, K, H, Dh).transpose(1, 2)  # [B, H, beams, Dh]
        return a.attend(q, k.view(B, H, t * K, Dh), v.view(B, H, t * K, Dh), beam_mask).view(N, 1, D)

    def _cross(self, h, enc: "EncoderOut", key_mask, layer_cache):
        a = self.cross_attn
        q = a.q_proj(h)
        if enc.beams > 1:  # the queries of a sentence's beams attend to its one copy of the keys together
            N, T, D = q.shape
            q = q.reshape(N // enc.beams, enc.beams * T, D)
        q = a.split(q)
        if layer_cache is not None and "ck" in layer_cache:
            k, v = layer_cache["ck"], layer_cache["cv"]
        else:
            k, v = a.split(a.k_proj(enc.out)), a.split(a.v_proj(enc.out))
            if layer_cache is not None:  # read at every step: contiguous once (a matmul would copy each time)
                k, v = k.contiguous(), v.contiguous()
                layer_cache["ck"], layer_cache["cv"] = k, v
        return a.attend(q, k, v, key_mask).view(h.shape)

    def forward(self, x, enc: "EncoderOut", key_mask, layer_cache: Optional[dict] = None,
                pad_mask: Optional[torch.Tensor] = None, beam_mask: Optional[torch.Tensor] = None):
        """``pad_mask`` [B, T] (True = pad decoder input) is handed to a feed-forward block that takes it;
        ``beam_mask``: incremental decoding of beams grouped per sentence (``_self_beams``)."""
        x = self.self_res(x, lambda h: self._self(h, layer_cache, beam_mask))
        x = self.cross_res(x, lambda h: self._cross(h, enc, key_mask, layer_cache))
        if pad_mask is not None and getattr(self.ffn, "takes_pad_mask", False):  # MoE: pads are not routed
            return self.ffn_res(x, lambda h: self.ffn(h, pad_mask))
        return self.ffn_res(x, self.ffn)


# ---------------------------------------------------------------------------------------
# encoder / decoder outputs and cache
# ---------------------------------------------------------------------------------------
def beam_blocks(index: torch.Tensor, beams: int) -> Optional[torch.Tensor]:
    """For ``index`` over decoder rows that form blocks of ``beams`` rows per sentence: the old block
    (sentence) each new block reads from, if every new block reads rows of a single old block (beam
    reordering, dropping finished sentences); None otherwise."""
    if index.dim() != 1 or index.numel() % beams:
        return None
    blocks = torch.div(index.view(-1, beams), beams, rounding_mode="floor")
    first = blocks[:, 0]
    return first if bool((blocks == first[:, None]).all()) else None


@dataclass
class EncoderOut:
    """The encoder states of ``out.size(0)`` sentences; each serves ``beams`` consecutive decoder rows
    (1 unless made by ``expand_beams``)."""

    out: torch.Tensor  # [B, S, D]
    pad_mask: torch.Tensor  # [B, S] bool, True = pad
    beams: int = 1
    max_steps: int = 0  # decoder positions the search may run (0 = unknown)
    padded: bool = True  # False: no row has padding, cross-attention runs without a mask

    def key_mask(self) -> Optional[torch.Tensor]:
        """Cross-attention mask [B, 1, 1, S] (True = may attend), None without padding."""
        return (~self.pad_mask)[:, None, None, :] if self.padded else None

    def expand_beams(self, beams: int, max_steps: int = 0) -> "EncoderOut":
        """Serve ``beams`` consecutive decoder rows (a sentence's beams) from every row, without copying:
        the same as ``index_select(arange(B).repeat_interleave(beams))`` up to round-off, but the decoder
        projects the cross-attention K/V once per sentence and attends with all its beams' queries in one
        matmul (a quarter of the memory traffic at beam 4, benchmarks/bench_generate.py). ``max_steps``
        (the most decoder positions the search runs) sizes the self-attention K/V buffers once, up to
        ``KV_PRESIZE_MAX`` positions, instead of growing them (a copy and fresh pages each time)."""
        if self.beams != 1:
            raise ScaletrainError(f"EncoderOut.expand_beams: already expanded ({self.beams} beams)")
        return EncoderOut(self.out, self.pad_mask, beams, max_steps, self.padded)

    def index_select(self, index: torch.Tensor) -> "EncoderOut":
        """Reorder / expand / shrink the decoder rows (beam search: ``index = arange(B).repeat_interleave(k)``).
        After ``expand_beams`` an index that keeps the sentence blocks together selects sentences; any other
        index gives every decoder row its own encoder row again."""
        if self.beams == 1:
            return EncoderOut(self.out.index_select(0, index), self.pad_mask.index_select(0, index), padded=self.padded)
        blocks = beam_blocks(index, self.beams)
        if blocks is None:
            rows = torch.div(index, self.beams, rounding_mode="floor")
            return EncoderOut(self.out.index_select(0, rows), self.pad_mask.index_select(0, rows), padded=self.padded)
        return EncoderOut(self.out.index_select(0, blocks), self.pad_mask.index_select(0, blocks), self.beams,
                          self.max_steps, self.padded)


_KV_START = 32  # first capacity (positions) of a self-attention K/V buffer; doubled when full
KV_PRESIZE_MAX = 256  # most positions a buffer is given up front (EncoderOut.max_steps); untouched pages are free


def _kv_capacity(t: torch.Tensor) -> int:
    """Positions the buffer behind ``t`` ([B, H, n, Dh], a ``kv_append`` result) has room for; ``n``
    for any other tensor (no room: the next append reallocates)."""
    B, H, n, Dh = t.shape
    cap = t.stride(1) // Dh if Dh else n
    if cap < n or t.stride() != (H * cap * Dh, cap * Dh, Dh, 1):
        return n
    if t.untyped_storage().nbytes() < (t.storage_offset() + B * H * cap * Dh) * t.element_size():
        return n
    return cap


def _kv_full(t: torch.Tensor) -> torch.Tensor:
    """``t`` widened to its whole buffer along dim 2 (positions past ``t.size(2)`` are unused)."""
    B, H, _, Dh = t.shape
    return t.as_strided((B, H, _kv_capacity(t), Dh), t.stride(), t.storage_offset())


def kv_append(cached: Optional[torch.Tensor], new: torch.Tensor) -> torch.Tensor:
    """Self-attention K or V cache ``cached`` [B, H, n, Dh] (or None) extended by ``new`` [B, H, m, Dh]
    (or [B, H, m, beams, Dh], kept as [B, H, n, beams * Dh]).

    The cache is a view of a buffer with room along the position axis, written in place; the buffer is
    reallocated with doubled capacity when full. ``torch.cat`` per step instead copies the whole cache
    every step (quadratic in the output length: a fifth of beam-search time on CPU, measured with
    benchmarks/bench_generate.py). Only the positions ``< n`` of a cache are ever read, so a later
    append may overwrite the tail of a buffer that an older, shorter view still points at; caches are
    never forked (beam reordering copies rows, ``kv_index_select``)."""
    tail = new.shape[3:]
    if cached is None:
        cached = new.new_empty(new.shape[:2] + (0, math.prod(tail)))
    B, H, n, Dh = cached.shape
    m = new.size(2)
    if n + m <= _kv_capacity(cached) and cached.dtype == new.dtype:
        buf = _kv_full(cached)
    else:
        buf = new.new_empty(B, H, max(_KV_START, 2 * (n + m)), Dh)
        buf[:, :, :n].copy_(cached)
    buf[:, :, n:n + m].unflatten(3, tail).copy_(new)
    return buf[:, :, :n + m]


def kv_index_select(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t.index_select(0, index)`` into a new buffer with the same spare room as ``t``'s (a
    ``kv_append`` cache), so the next append does not reallocate; copies only the used positions."""
    if t.dim() != 4 or _kv_capacity(t) == t.size(2):
        return t.index_select(0, index)
    B, H, n, Dh = t.shape
    buf = t.new_empty(index.numel(), H, _kv_capacity(t), Dh)
    if t.requires_grad and torch.is_grad_enabled():  # out= does not record gradients
        buf[:, :, :n] = t.index_select(0, index)
    else:
        torch.index_select(t, 0, index, out=buf[:, :, :n])
    return buf[:, :, :n]


ENCODER_SIDE_KEYS = frozenset({"ck", "cv"})  # DecoderCache entries computed from the encoder output


@dataclass
class DecoderCache:
    """Per decoder layer: self-attention K/V so far ("k", "v": [N, H, t, Dh], views of buffers with
    room to grow, see ``kv_append``) and the cross-attention K/V of the encoder output ("ck", "cv":
    [N, H, S, Dh], computed once at step 0).

    With ``beams`` > 1 (decoding an ``EncoderOut.expand_beams`` output) the rows are the beams of
    N / beams sentences: "ck"/"cv" hold one row per sentence, "k"/"v" are [N / beams, H, t, beams * Dh]
    (every beam's K/V in the slot of the beam that computed it) and ``slots`` [N, t] says, per beam and
    position, which slot of its sentence holds its history."""

    layers: list
    beams: int = 1
    slots: Optional[torch.Tensor] = None

    def beam_mask(self) -> torch.Tensor:
        """[N / beams, 1, beams, t * beams] bool: beam j of a sentence may attend to slot b at position p."""
        N, t = self.slots.shape
        K = self.beams
        return (self.slots.view(N // K, K, t, 1) == torch.arange(K, device=self.slots.device)).view(N // K, 1, K, t * K)

    def append_slots(self, n_rows: int, device) -> None:
        """The K/V of the step being decoded go to each beam's own slot."""
        own = (torch.arange(n_rows, device=device) % self.beams)[:, None]
        self.slots = own if self.slots is None else torch.cat([self.slots, own], dim=1)

    def index_select(self, index: torch.Tensor) -> "DecoderCache":
        """Reorder / shrink the decoder rows; the encoder side follows ``EncoderOut.index_select``. Grouped
        by sentence, a reorder that keeps the sentence blocks (beam search) only gathers ``slots`` and, if
        sentences are dropped, their K/V; any other index first gives every row its own K/V again."""
        if self.beams == 1:
            return DecoderCache([{n: kv_index_select(t, index) for n, t in layer.items()} for layer in self.layers])
        blocks = beam_blocks(index, self.beams)
        if blocks is None:
            return self._per_row().index_select(index)
        n_sent = self.slots.shape[0] // self.beams
        same = blocks.numel() == n_sent and bool((blocks == torch.arange(n_sent, device=blocks.device)).all())
        layers = self.layers if same else [{n: kv_index_select(t, blocks) for n, t in layer.items()}
                                           for layer in self.layers]
        return DecoderCache([dict(layer) for layer in layers], self.beams, self.slots.index_select(0, index))

    def _per_row(self) -> "DecoderCache":
        """The same cache with one K/V row per decoder row (beams = 1)."""
        N, t = self.slots.shape
        K = self.beams
        sent = torch.div(torch.arange(N, device=self.slots.device), K, rounding_mode="floor")
        pos = torch.arange(t, device=self.slots.device)
        layers = []
        for layer in self.layers:
            row = {}
            for n, x in layer.items():
                if n in ENCODER_SIDE_KEYS:
                    row[n] = x.index_select(0, sent)
                else:  # [B, H, t, K * Dh] -> [N, H, t, Dh]: row r, position p from slot slots[r, p]
                    x5 = x.unflatten(3, (K, x.size(3) // K))
                    row[n] = x5[sent[:, None], :, pos[None, :], self.slots].permute(0, 2, 1, 3).contiguous()
            layers.append(row)
        return DecoderCache(layers)


# ---------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------
class Transformer(nn.Module):
    """Encoder-decoder over byte ids; ``forward(src, tgt_in) -> logits [B, T, V]``."""

    def __init__(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        *,
        embeddings: Optional[nn.Module] = None,
        frontend: Optional[nn.Module] = None,
        encoder_self_attn: Optional[Callable[[int], nn.Module]] = None,
        n_encoder_layers: Optional[int] = None,
        ffn: Optional[Callable[[str, int], Optional[nn.Module]]] = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.kernel_mode = cfg.kernels  # for the input dropouts; every layer keeps its own
        d = cfg.d_model
        if embeddings is None:
            cls = SharedEmbeddings if cfg.share_embeddings else SeparateEmbeddings
            embeddings = cls(vocab_size, d, cfg.scale_embeddings)
        self.embeddings = embeddings
        self.positions = SinusoidalPositions(d, cfg.max_positions)
        self.frontend = frontend
        n_enc = cfg.encoder_layers if n_encoder_layers is None else n_encoder_layers
        ffn = ffn or (lambda side, i: None)
        self.encoder_layers = nn.ModuleList(
            EncoderLayer(cfg, encoder_self_attn(i) if encoder_self_attn is not None else None, ffn("encoder", i))
            for i in range(n_enc)
        )
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg, ffn=ffn("decoder", i)) for i in range(cfg.decoder_layers))
        if not cfg.decoder_last_layer_dropout and cfg.decoder_layers > 0:
            self.decoder_layers[-1].set_residual_dropout(0.0)
        # pre-LN stacks end with a LayerNorm (fairseq normalize_before); post-LN ones do not
        self.encoder_norm = nn.LayerNorm(d) if cfg.pre_ln else None
        self.decoder_norm = nn.LayerNorm(d) if cfg.pre_ln else None
        self.last_aux_loss: Optional[torch.Tensor] = None

    # ---- encoder ---------------------------------------------------------------------
    def _compute_dtype(self, e: torch.Tensor) -> torch.Tensor:
        """``e`` in the layers' parameter dtype. An embedding may hold its rows in a buffer (the one-hot
        table), which an engine that casts only parameters (DeepSpeed ZeRO-1/2 in bf16) leaves in fp32."""
        ref = next(iter(self.decoder_layers.parameters()), None)
        if ref is None or e.dtype == ref.dtype or not ref.is_floating_point():
            return e
        return e.to(ref.dtype)

    def embed_source(self, src: torch.Tensor) -> torch.Tensor:
        e = self._compute_dtype(self.embeddings(src, "encoder"))
        x = e + self.positions(src).to(dtype=e.dtype)
        if self.cfg.encoder_input_dropout:
            x = kernels.dropout(x, self.cfg.dropout, self.training, self.kernel_mode)
        return x

    def encode(self, src: torch.Tensor, src_padded: bool = True) -> EncoderOut:
        """``src_padded=False``: the caller knows that no row of ``src`` has PAD (e.g. from the batch's
        host-side token count, ``Batch.src_padded``): self- and cross-attention then run without a
        mask, which lets SDPA pick FlashAttention on CUDA; the result equals the masked one. Deciding
        it here would read the device (a sync per step), so the default keeps the mask."""
        self._check_tokens(src, "src")
        pad_mask = src.eq(PAD)
        ctx = EncoderContext(src, pad_mask, self.embeddings, padded=src_padded)
        x = self.embed_source(src)
        if self.frontend is not None:
            x, pad_mask = self.frontend(x, ctx)
            ctx.pad_mask = pad_mask
        for layer in self.encoder_layers:
            x = layer(x, ctx)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        return EncoderOut(x, ctx.pad_mask, padded=ctx.padded)

    # ---- decoder ---------------------------------------------------------------------
    def _decoder_input(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        e = self._compute_dtype(self.embeddings(tokens, "decoder"))
        x = e + pos.to(dtype=e.dtype)
        if self.cfg.decoder_input_dropout:
            x = kernels.dropout(x, self.cfg.dropout, self.training, self.kernel_mode)
        return x

    def _decoder_output(self, x: torch.Tensor) -> torch.Tensor:
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        return self.embeddings(x, "output")

    def decode(self, tgt_in: torch.Tensor, enc: EncoderOut) -> torch.Tensor:
        self._check_tokens(tgt_in, "tgt_in")
        x = self._decoder_input(tgt_in, self.positions(tgt_in))
        key_mask = enc.key_mask()
        pad_mask = tgt_in.eq(PAD)
        for layer in self.decoder_layers:
            x = layer(x, enc, key_mask, None, pad_mask)
        return self._decoder_output(x)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, src_padded: bool = True) -> torch.Tensor:
        """Logits [B, T, V]; ``src_padded=False`` promises a source without PAD (see ``encode``)."""
        self.last_aux_loss = None
        logits = self.decode(tgt_in, self.encode(src, src_padded))
        self.last_aux_loss = self.collect_aux_loss()
        return logits

    def collect_aux_loss(self) -> Optional[torch.Tensor]:
        """Sum of the auxiliary losses (e.g. MoE load balancing, coefficient applied) that plug-ins
        kept in ``aux_loss`` during the last forward; None for a model without any."""
        losses = [m.aux_loss for m in self.modules() if m is not self and getattr(m, "aux_loss", None) is not None]
        return torch.stack(losses).sum() if losses else None

    # ---- incremental decoding ------------------------------------------------------------
    def decode_step(
        self, tokens: torch.Tensor, step: int, enc: EncoderOut, cache: Optional[DecoderCache] = None
    ) -> tuple[torch.Tensor, DecoderCache]:
        """Feed the decoder input at position ``step`` (step 0 = target tag); logits [B, V] for the next token."""
        x = self._decoder_input(tokens[:, None], self.positions.at(step, tokens.shape[0]))
        if cache is None:
            if step != 0:
                raise ScaletrainError(f"decode_step: cache=None is only valid at step 0 (got step {step})")
            cache = self._new_cache(enc, x)
        if cache.beams != enc.beams or tokens.shape[0] != enc.out.shape[0] * enc.beams:
            raise ScaletrainError(
                f"decode_step: {tokens.shape[0]} decoder rows for {enc.out.shape[0]} encoder rows x {enc.beams} "
                f"beams (cache: {cache.beams}); reorder the encoder output and the cache with the same index")
        key_mask = enc.key_mask()
        pad_mask = tokens.eq(PAD)[:, None]
        beam_mask = None
        if cache.beams > 1:
            cache.append_slots(tokens.shape[0], tokens.device)
            beam_mask = cache.beam_mask()
        for layer, lc in zip(self.decoder_layers, cache.layers):
            x = layer(x, enc, key_mask, lc, pad_mask, beam_mask)
        return self._decoder_output(x)[:, 0], cache

    def _new_cache(self, enc: EncoderOut, x: torch.Tensor) -> DecoderCache:
        """An empty cache; for beams grouped per sentence with a known ``max_steps``, the self-attention
        K/V buffers are allocated once with room for that many positions (up to ``KV_PRESIZE_MAX``)."""
        cache = DecoderCache([{} for _ in self.decoder_layers], enc.beams)
        cap = min(enc.max_steps, KV_PRESIZE_MAX)
        if enc.beams > 1 and cap > _KV_START:
            for layer, lc in zip(self.decoder_layers, cache.layers):
                a = layer.self_attn
                for n in ("k", "v"):
                    buf = x.new_empty(enc.out.shape[0], a.n_heads, cap, enc.beams * a.head_dim)
                    lc[n] = buf[:, :, :0]
        return cache

    def routing_stats(self, reset: bool = True) -> dict:
        """Routing statistics of every plug-in that keeps them (e.g. MoCE), keyed by module name.
        Reading them copies to the host; call it every N steps, not every step."""
        return {
            name: mod.routing_stats(reset)
            for name, mod in self.named_modules()
            if mod is not self and callable(getattr(mod, "routing_stats", None))
        }

    @staticmethod
    def reorder_cache(cache: DecoderCache, index: torch.Tensor) -> DecoderCache:
        return cache.index_select(index)

    # ---- helpers ---------------------------------------------------------------------
    def _check_tokens(self, t: torch.Tensor, name: str) -> None:
        if t.dim() != 2 or t.dtype != torch.long:
            raise ScaletrainError(f"model input {name} must be an int64 tensor [batch, length], got {t.dtype} {tuple(t.shape)}")
