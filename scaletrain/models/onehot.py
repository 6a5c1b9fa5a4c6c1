"""Embeddingless input/output (Shaham & Levy 2021, docs/MODELS.md §3): frozen one-hot rows.

Row i of E [V, d] is the unit vector e_i (pad row zero), kept as a buffer: it has no gradient and
is not a parameter. Inputs are ``s * E[id]``; with ``share_embeddings`` the output logits are
``s_out * h E^T = s_out * h[..., :V]`` (pad logit always 0); without sharing (LOBEF's
"--no-encoder-embed --no-decoder-embed") the output projection is a learned V x d matrix.

``model.onehot.learnable_scales`` turns s_enc, s_dec (and s_out when shared) into learnable scalars;
s_enc and s_dec start at sqrt(d) (1 if ``scale_embeddings`` is off), s_out at 1. Otherwise s_enc and
s_dec are the constant sqrt(d) (or 1) and s_out is 1.

Why s_out starts at 1 (the reference code starts it at sqrt(d)): the one-hot table stands in for the
embedding matrix of the standard Transformer (Vaswani et al.), which multiplies by sqrt(d) only where
rows are *looked up*; the pre-softmax projection uses the matrix unscaled. A one-hot row has norm 1
like a row of N(0, 1/d) entries, so with s_out = 1 a logit h_v has the variance of a tied model's
logit h . E_v (about 1 after the final LayerNorm) and the loss at initialisation is about ln V. With
s_out = sqrt(d) the logits start with standard deviation sqrt(d) (22.6 at d 512): about 60 nats per
token at V = 268 instead of 5.6, gradients that overflow fp16's loss scale (every step skipped) and
a first phase spent shrinking s_out (tests/unit/test_models_init_scale.py checks every recipe's initial
loss is about ln V).
The dropout changes of the paper are separate config switches (``encoder_input_dropout``,
``decoder_input_dropout``, ``decoder_last_layer_dropout``); the recipe sets them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.transformer import Embeddings
from scaletrain.vocab import PAD


OUTPUT_SCALE_INIT = 1.0  # s_out at initialisation (learnable) or always (constant scales)


class OneHotEmbeddings(Embeddings):
    def __init__(self, vocab_size: int, dim: int, *, share_output: bool, learnable_scales: bool, scale: bool = True):
        super().__init__()
        # vocab_size <= dim (one unit vector per id) is a model rule: OneHotConfig.validate
        table = torch.eye(vocab_size, dim)
        table[PAD] = 0.0
        self.register_buffer("table", table, persistent=False)
        init = math.sqrt(dim) if scale else 1.0
        self.learnable_scales = learnable_scales
        self.share_output = share_output
        if learnable_scales:
            self.encoder_scale = nn.Parameter(torch.full((1,), init))
            self.decoder_scale = nn.Parameter(torch.full((1,), init))
            # the output's logit scale starts at 1, not sqrt(d): see the module docstring
            self.output_scale = nn.Parameter(torch.full((1,), OUTPUT_SCALE_INIT)) if share_output else None
        else:
            self.encoder_scale = self.decoder_scale = init
            self.output_scale = OUTPUT_SCALE_INIT
        if share_output:
            self.output_weight = None
        else:
            self.output_weight = nn.Parameter(torch.empty(vocab_size, dim))
            nn.init.normal_(self.output_weight, mean=0.0, std=dim**-0.5)

    def raw(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.table)

    def encoder_input(self, tokens: torch.Tensor) -> torch.Tensor:
        return _scaled(self.raw(tokens), self.encoder_scale)

    def decoder_input(self, tokens: torch.Tensor) -> torch.Tensor:
        return _scaled(self.raw(tokens), self.decoder_scale)

    def output(self, h: torch.Tensor) -> torch.Tensor:
        if self.output_weight is not None:
            return F.linear(h, self.output_weight)
        return _scaled(F.linear(h, self.table.to(h.dtype)), self.output_scale)


def _scaled(x: torch.Tensor, scale) -> torch.Tensor:
    """``x * scale`` in x's dtype; a learnable scalar is applied in fp32, so its gradient (a sum over
    every element of x) is reduced in fp32: in fp16 the loss-scaled sum over [batch, length, V]
    overflows at once and every step would be skipped (measured: inf at the GradScaler's 65536)."""
    if not torch.is_tensor(scale):
        return x * scale
    return (x.float() * scale.float()).to(x.dtype)
