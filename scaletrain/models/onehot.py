"""Embeddingless input/output (Shaham & Levy 2021, docs/MODELS.md §3): frozen one-hot rows.

Row i of E [V, d] is the unit vector e_i (pad row zero), kept as a buffer: it has no gradient and
is not a parameter. Inputs are ``s * E[id]``; with ``share_embeddings`` the output logits are
``s_out * h E^T = s_out * h[..., :V]`` (pad logit always 0); without sharing (LOBEF's
"--no-encoder-embed --no-decoder-embed") the output projection is a learned V x d matrix.

``model.onehot.learnable_scales`` turns s_enc, s_dec (and s_out when shared) into learnable scalars
initialised to sqrt(d); otherwise they are the constant sqrt(d) (1 if ``scale_embeddings`` is off).
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
            self.output_scale = nn.Parameter(torch.full((1,), init)) if share_output else None
        else:
            self.encoder_scale = self.decoder_scale = init
            self.output_scale = 1.0
        if share_output:
            self.output_weight = None
        else:
            self.output_weight = nn.Parameter(torch.empty(vocab_size, dim))
            nn.init.normal_(self.output_weight, mean=0.0, std=dim**-0.5)

    def raw(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.table)

    def encoder_input(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.raw(tokens) * self.encoder_scale

    def decoder_input(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.raw(tokens) * self.decoder_scale

    def output(self, h: torch.Tensor) -> torch.Tensor:
        if self.output_weight is not None:
            return F.linear(h, self.output_weight)
        out = F.linear(h, self.table.to(h.dtype))
        scale = self.output_scale
        return out * (scale.to(out.dtype) if torch.is_tensor(scale) else scale)
