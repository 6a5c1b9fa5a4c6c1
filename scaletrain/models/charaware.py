"""Character-aware gated (CG) target embeddings (Renduchintala et al. 2018, "Character-Aware Decoder
for Neural Machine Translation"), as an ``Embeddings`` plug-in of the Transformer core.

For every target vocabulary type v (a subword piece) the composition (paper section 4, after Kim et
al. 2016) reads its spelling ``<w> c_1 .. c_n </w>`` (the keys named are those of ``model.charaware``;
char_dim = ``dim``):

    char embeddings [n+2, char_dim]
      -> one Conv1d per kernel width k in ``kernels`` (3, 4, 5, 6), ``filters`` outputs each
      -> max over positions, tanh  (tanh is monotonic, so max-then-tanh == tanh-then-max, and the
         large [V, filters, chars] tensor is never kept for the backward pass)
      -> concatenation [V, T], T = filters * len(kernels)
      -> ``highway_layers`` highway layers (t = sigmoid(W_t y + b_t), b_t init -2;
         y' = t * relu(W_h y + b_h) + (1 - t) * y)
      -> (only when T != d_model: a linear map T -> d_model)
      -> times d_model ** -0.5: w_comp^v

and mixes it with a standard learned row w_std^v by a learned per-type gate (paper eq. 8-9):

    g^v = sigmoid(w_gate^v),   w_mix^v = g^v * w_std^v + (1 - g^v) * w_comp^v

``gate: vector`` (default) is the paper's gate, g^v in [0, 1]^d: one gate VECTOR per type;
``gate: scalar`` is one gate value per type (V parameters instead of V*d). w_gate starts at 0
(g = 0.5, the paper regularises it towards 0; its gate dropout, which "did not affect performance
noticeably" (paper footnote 3), is not implemented). The mixed matrix E [V, d] is SHARED by the
decoder input embedding and the softmax (``logits = h E^T``): the paper sets w_o = w_s = w_mix.

Choices beyond the paper (documented here, tested in tests/unit/test_models_charaware.py):
- Scale: fairseq-style standard rows start with norm ~1 (std d^-1/2) and are multiplied by sqrt(d)
  at the input (``scale_embeddings``); the composed vector is multiplied by d^-1/2 so both parts of
  the mix live on the same scale at the input and in the tied softmax.
- Padding: each convolution sees the spelling right-padded with k-1 zero vectors and the max runs
  only over windows that START inside the spelling, so a type's composed vector depends on its own
  characters only: not on the table width, nor on other types (no window covers padding alone;
  spellings shorter than a kernel still get windows, padded with zeros).
- Length cap: a piece longer than ``max_len`` characters keeps its first ``max_len``
  characters (then ``</w>``); the char table is [V, max_len + 2].
- Characters are Unicode code points; SentencePiece's word-start mark U+2581 is kept as a character.
  The char vocabulary is the sorted set of code points of the (truncated) pieces; char id 0 = pad,
  1 = ``<w>``, 2 = ``</w>``, then the code points in increasing order.
- Pieces given as '' (specials, language tags) have no spelling: their gate is fixed to exactly 1,
  so their row is exactly the standard row (their w_gate entries exist but get no gradient).
- Encoder side: standard embeddings. ``share_embeddings: true`` -> the encoder reads the standard
  part w_std of the same types (joint source/target subword vocabulary, as share-all does for
  bytes); ``false`` -> the encoder has its own V x d matrix. Decoder input and softmax are tied to
  E in both cases (that tie is the model, not an option).
- The char-id table and the char vocabulary's code points are PERSISTENT buffers: a checkpoint
  holds everything needed to rebuild the module (``pieces_from_state_dict``), no tokenizer needed.

Efficiency: the composition runs over all V types at once (one convolution per kernel width on
[V, char_dim, chars]; no loop over types). In a training forward it runs once: ``decoder_input``
computes E and hands it to the following ``output`` call (the two calls of one forward). In eval
mode with gradients off (generation, validation) E is cached across calls; the cache is dropped
on ``train()``/``eval()`` and recomputed whenever any parameter of this module changed (the key
holds every parameter's storage pointer and in-place version counter, so an optimiser step or a
``load_state_dict`` invalidates it), or the dtype/device/autocast state differs.
Cost: the conv outputs [V, filters, chars] exist only transiently (the masked max keeps indices,
conv keeps its input [V, char_dim, chars + max k - 1], shared by all widths); the highway layers
keep a few [V, T] tensors. Measured on CPU, fp32, V=32k, d=512, paper settings: the forward of
the composition grows the peak RSS by ~1.8 GB and takes ~15 s on one core (~115 GMAC: convs
~81, highways ~34; a Transformer-base forward over 4k+4k tokens is ~350 GMAC), once per training
step whatever the batch size: the paper's noted limit on the target vocabulary size.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.errors import ScaletrainError
from scaletrain.models.config import ModelConfig
from scaletrain.models.transformer import Embeddings, _init_embedding, _lookup

CHAR_PAD, CHAR_BOW, CHAR_EOW = 0, 1, 2
CHAR_OFFSET = 3  # first code point's char id


def char_table(pieces: Sequence[str], max_chars: int) -> tuple[list[int], torch.Tensor]:
    """``(code_points, table)``: the sorted code points of the pieces' first ``max_chars`` characters
    and the int64 table [V, max_chars + 2] with rows ``<w> chars </w> pad..`` ('' -> all pad)."""
    spellings = [p[:max_chars] for p in pieces]
    code_points = sorted({ord(c) for s in spellings for c in s})
    index = {cp: i + CHAR_OFFSET for i, cp in enumerate(code_points)}
    width = max_chars + 2
    rows = [
        ([CHAR_BOW] + [index[ord(c)] for c in s] + [CHAR_EOW] + [CHAR_PAD] * (max_chars - len(s)))
        if s
        else [CHAR_PAD] * width
        for s in spellings
    ]
    table = torch.tensor(rows, dtype=torch.long).reshape(len(pieces), width)  # one factory call, any device context
    return code_points, table


def pieces_from_state_dict(state_dict: Mapping[str, torch.Tensor], prefix: str = "embeddings.") -> list[str]:
    """The (truncated) pieces stored in a checkpoint's state dict; building ``CharAwareEmbeddings``
    from them gives a module with the same shapes, char table and char vocabulary."""
    try:
        table = state_dict[prefix + "char_ids"]
        cps = state_dict[prefix + "char_codepoints"].tolist()
    except KeyError as e:
        raise ScaletrainError(
            f"state dict has no {e.args[0]!r}: it was not saved from a model.embedding=charaware model "
            f"(or its embeddings live under another prefix than {prefix!r})"
        ) from None
    pieces = []
    for row in table.tolist():
        pieces.append("".join(chr(cps[c - CHAR_OFFSET]) for c in row if c >= CHAR_OFFSET))
    return pieces


class Highway(nn.Module):
    """y' = t * relu(W_h y + b_h) + (1 - t) * y, t = sigmoid(W_t y + b_t); b_t starts at -2 (Kim et al.)."""

    def __init__(self, dim: int):
        super().__init__()
        self.transform = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim)
        nn.init.constant_(self.gate.bias, -2.0)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        t = torch.sigmoid(self.gate(y))
        return t * F.relu(self.transform(y)) + (1.0 - t) * y


def charaware_filters(cfg: ModelConfig) -> int:
    """Output channels per kernel width: ``model.charaware.filters``, or 0 -> d_model / len(kernels)
    (the paper: "1/4 of the final desired embedding size" with 4 kernels)."""
    ca = cfg.charaware
    return ca.filters or max(1, cfg.d_model // len(ca.kernels))


def charaware_parameter_count(cfg: ModelConfig, vocab_size: int, n_chars: int) -> int:
    """Parameters of ``CharAwareEmbeddings`` (``n_chars`` = distinct code points in the pieces):

        std V*d + gate V*d (vector) | V (scalar) + [encoder V*d if not share_embeddings]
        + char embeddings (n_chars + 3) * char_dim
        + sum_k (k * char_dim * F + F)                 convolutions, F = filters per width
        + L * 2 * (T*T + T)                            highway layers, T = F * len(kernels)
        + [T*d + d if T != d]                          projection
    """
    ca = cfg.charaware
    d, c, V = cfg.d_model, ca.dim, vocab_size
    f = charaware_filters(cfg)
    t = f * len(ca.kernels)
    n = V * d + (V * d if ca.gate == "vector" else V)
    n += 0 if cfg.share_embeddings else V * d
    n += (n_chars + CHAR_OFFSET) * c
    n += sum(k * c * f + f for k in ca.kernels)
    n += ca.highway_layers * 2 * (t * t + t)
    n += 0 if t == d else t * d + d
    return n


class CharAwareEmbeddings(Embeddings):
    """CG embeddings: standard encoder rows; decoder input and softmax share E = gate-mix of the
    standard rows and the character composition (see the module docstring)."""

    def __init__(self, pieces: Sequence[str], cfg: ModelConfig):
        super().__init__()
        pieces = list(pieces)
        bad = [i for i, p in enumerate(pieces) if not isinstance(p, str)]
        if bad:
            raise ScaletrainError(
                f"model.embedding=charaware: pieces must be strings ('' for specials and language tags); "
                f"id {bad[0]} is {pieces[bad[0]]!r}"
            )
        ca = cfg.charaware
        code_points, table = char_table(pieces, ca.max_len)
        if not code_points:
            raise ScaletrainError(
                "model.embedding=charaware: no piece has any character (all are ''); pass the subword "
                "vocabulary's surface strings (SentencePiece, data.tokenizer: spm)"
            )
        V, d = len(pieces), cfg.d_model
        self.vocab_size, self.dim = V, d
        self.kernels = list(ca.kernels)
        self.scale = math.sqrt(d) if cfg.scale_embeddings else 1.0
        self.comp_scale = d**-0.5
        self.register_buffer("char_ids", table)  # persistent: the checkpoint carries the spellings
        self.register_buffer("char_codepoints", torch.tensor(code_points, dtype=torch.long))

        self.std_weight = nn.Parameter(torch.empty(V, d))
        _init_embedding(self.std_weight, d)
        if cfg.share_embeddings:
            self.encoder_weight = None
        else:
            self.encoder_weight = nn.Parameter(torch.empty(V, d))
            _init_embedding(self.encoder_weight, d)
        self.gate_weight = nn.Parameter(torch.zeros(V, d if ca.gate == "vector" else 1))

        f = charaware_filters(cfg)
        t = f * len(self.kernels)
        self.char_embed = nn.Embedding(len(code_points) + CHAR_OFFSET, ca.dim, padding_idx=CHAR_PAD)
        self.convs = nn.ModuleList(nn.Conv1d(ca.dim, f, k) for k in self.kernels)
        self.highways = nn.ModuleList(Highway(t) for _ in range(ca.highway_layers))
        self.proj = nn.Linear(t, d) if t != d else None

        self._pending: Optional[torch.Tensor] = None  # E of this training forward: decoder_input -> output
        self._cache: Optional[tuple] = None  # (key, E) in eval mode without gradients

    # ---- the composition ---------------------------------------------------------------
    def composed(self) -> torch.Tensor:
        """w_comp for every type [V, d] (rows of '' pieces are finite and unused: their gate is 1)."""
        ids = self.char_ids
        L = ids.shape[1]
        lengths = ids.ne(CHAR_PAD).sum(1)  # [V]; 0 for '' pieces
        x = self.char_embed(ids).transpose(1, 2)  # [V, c, L]
        x = F.pad(x, (0, max(self.kernels) - 1))  # zero vectors after the spelling
        # windows starting at a spelling position; additive mask so nothing big is saved for backward
        starts = torch.arange(L, device=ids.device)
        neg = torch.zeros(ids.shape[0], 1, L, device=ids.device, dtype=x.dtype)
        neg = neg.masked_fill((starts[None, :] >= lengths[:, None])[:, None, :], float("-inf"))
        feats = []
        for k, conv in zip(self.kernels, self.convs):  # one convolution per width over all V types
            y = conv(x[..., : L + k - 1]).add_(neg)  # [V, F, L]: window starting at each position
            feats.append(y.max(dim=-1).values)  # (conv keeps its input, not y; max keeps only indices)
        h = torch.tanh(torch.cat(feats, dim=1))  # [V, T]
        h = h.masked_fill(lengths.eq(0)[:, None], 0.0)  # '' pieces have no window (gated out anyway)
        for hw in self.highways:
            h = hw(h)
        if self.proj is not None:
            h = self.proj(h)
        return h * self.comp_scale

    def gate(self) -> torch.Tensor:
        """g [V, d] or [V, 1]: sigmoid(w_gate), exactly 1 for '' pieces (standard row only)."""
        composable = self.char_ids[:, 0].eq(CHAR_BOW)[:, None]
        return torch.where(composable, torch.sigmoid(self.gate_weight), torch.ones_like(self.gate_weight))

    def mixed(self) -> torch.Tensor:
        """E [V, d] = g * w_std + (1 - g) * w_comp, computed now (no cache)."""
        g = self.gate()
        return g * self.std_weight + (1.0 - g) * self.composed()

    # ---- caching ------------------------------------------------------------------------
    def _cache_key(self, ref: torch.Tensor) -> tuple:
        dev = ref.device.type
        autocast = torch.is_autocast_enabled(dev)
        return (
            tuple((p.data_ptr(), p._version, p.dtype) for p in self.parameters()),
            (self.char_ids.data_ptr(), self.char_ids._version),
            str(ref.device),
            autocast,
            torch.get_autocast_dtype(dev) if autocast else None,
            torch.is_inference_mode_enabled(),
        )

    def matrix(self, producer: bool = False) -> torch.Tensor:
        """E for this call. Eval + no grad: cached across calls. Otherwise computed by the
        producer call (``decoder_input``) and reused once by the next ``output`` call."""
        if not self.training and not torch.is_grad_enabled():
            self._pending = None
            key = self._cache_key(self.std_weight)
            if self._cache is None or self._cache[0] != key:
                self._cache = (key, self.mixed())
            return self._cache[1]
        self._cache = None
        if producer:
            self._pending = self.mixed()
            return self._pending
        if self._pending is not None:
            e, self._pending = self._pending, None
            return e
        return self.mixed()

    def train(self, mode: bool = True):
        self._cache = None
        self._pending = None
        return super().train(mode)

    def _apply(self, fn, *args, **kwargs):  # .to() / .half() / .cuda(): drop tensors of the old storage
        self._cache = None
        self._pending = None
        return super()._apply(fn, *args, **kwargs)

    # ---- Embeddings interface -----------------------------------------------------------
    def raw(self, tokens: torch.Tensor) -> torch.Tensor:
        w = self.std_weight if self.encoder_weight is None else self.encoder_weight
        return _lookup(tokens, w)

    def encoder_input(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.raw(tokens) * self.scale

    def decoder_input(self, tokens: torch.Tensor) -> torch.Tensor:
        return _lookup(tokens, self.matrix(producer=True)) * self.scale

    def output(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.matrix().to(h.dtype))
