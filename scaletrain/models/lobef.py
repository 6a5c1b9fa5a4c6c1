"""LOBEF encoder front-ends (docs/MODELS.md §4, §5; not reproduced: §13.1-13.3): Byte-nCF and Byte-WSF.

Both replace the first ``model.lobef.byte_layers`` encoder layers with a front-end that owns its
own (standard) byte layers; ``model.encoder_layers`` ordinary layers follow. The paper setups:
nCF 4 byte layers + 2 encoder layers, WSF 2 + 4. Outputs stay at byte resolution.

Byte-nCF: H = byte layers(x); for each n in ``model.lobef.ngrams`` (1 = identity) U_n = Conv1d(d, d, n,
stride n) over H zero-padded on the right to a multiple of n, repeated n times along time and cut
to T; out = sum_n w_n U_n with one learnable scalar per stream (Linear(#streams -> 1, no bias)).
Windows are aligned to index 0, i.e. to the sentence start under the project's right padding
(``scaletrain.data.batch``); H is zeroed at pad positions first, so a sentence's last partial window
sees zeros whatever the batch (the reference leaks pad states there).

Byte-WSF: the byte layers attend only within words. A word is a maximal run of tokens that are
neither a separator (``model.lobef.separators``, byte values, default space) nor padding; separators and
pads are one-token groups of their own. So the source tag joins the first word and EOS the last,
every position may attend to itself, a sentence without separators is one block (ordinary
attention over its real tokens), and real queries never see pad keys. The mask is [B, 1, T, T]
(broadcast over heads), built on the device with cumsum, no Python loops (the reference's mask is
misaligned, lacks the diagonal and mixes up the head/batch layout).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.config import ModelConfig
from scaletrain.models.embeddings import make_embeddings
from scaletrain.models.registry import register_model
from scaletrain.models.transformer import EncoderContext, EncoderLayer, Transformer
from scaletrain.vocab import BYTE_OFFSET, PAD


class NGramFusion(nn.Module):
    """Combine H with its n-gram convolution streams (the "+2,360,836" of the paper for d=512)."""

    def __init__(self, dim: int, ngrams: list[int]):
        super().__init__()
        self.ngrams = list(ngrams)
        self.convs = nn.ModuleDict({str(n): nn.Conv1d(dim, dim, n, stride=n) for n in self.ngrams if n > 1})
        self.weights = nn.Linear(len(self.ngrams), 1, bias=False)  # PyTorch default init, U(-0.5, 0.5) for 4

    def streams(self, h: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> [B, T, D, #streams]."""
        B, T, D = h.shape
        h = h.masked_fill(pad_mask[..., None], 0.0)
        out = []
        for n in self.ngrams:
            if n == 1:
                out.append(h)
                continue
            x = h.transpose(1, 2)  # [B, D, T]
            x = F.pad(x, (0, (-T) % n))
            u = self.convs[str(n)](x)  # [B, D, ceil(T/n)]
            u = u.repeat_interleave(n, dim=2)[:, :, :T]
            out.append(u.transpose(1, 2))
        return torch.stack(out, -1)

    def forward(self, h: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        return self.weights(self.streams(h, pad_mask)).squeeze(-1)


class ByteNCFFrontEnd(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.lobef.byte_layers))
        self.variant = NGramFusion(cfg.d_model, cfg.lobef.ngrams)

    def forward(self, x: torch.Tensor, ctx: EncoderContext):
        for layer in self.layers:
            x = layer(x, ctx)
        return self.variant(x, ctx.pad_mask), ctx.pad_mask


def word_groups(tokens: torch.Tensor, separator_ids: torch.Tensor) -> torch.Tensor:
    """Group id per position [B, T]: words are maximal runs of non-separator, non-pad tokens;
    every separator and every pad is a group of its own."""
    single = tokens.eq(PAD) | torch.isin(tokens, separator_ids)
    prev_single = F.pad(single[:, :-1], (1, 0), value=True)
    start = single | prev_single  # a new group starts at a singleton or right after one
    return torch.cumsum(start.to(torch.int32), dim=1)


def word_block_mask(tokens: torch.Tensor, separator_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool, True = may attend: same word (or the position itself)."""
    g = word_groups(tokens, separator_ids)
    return (g[:, :, None] == g[:, None, :])[:, None]


class ByteWSFFrontEnd(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.lobef.byte_layers))
        self.register_buffer(
            "separator_ids", torch.tensor([b + BYTE_OFFSET for b in cfg.lobef.separators], dtype=torch.long),
            persistent=False,
        )

    def forward(self, x: torch.Tensor, ctx: EncoderContext):
        mask = word_block_mask(ctx.src_tokens, self.separator_ids)
        for layer in self.layers:
            x = layer(x, ctx, mask)
        return x, ctx.pad_mask


@register_model("byte_ncf")
def build_byte_ncf(cfg: ModelConfig, vocab_size: int, pieces=None, ffn=None, parallel=None) -> Transformer:
    embeddings = make_embeddings(cfg, vocab_size, pieces)
    return Transformer(cfg, vocab_size, embeddings=embeddings, frontend=ByteNCFFrontEnd(cfg), ffn=ffn)


@register_model("byte_wsf")
def build_byte_wsf(cfg: ModelConfig, vocab_size: int, pieces=None, ffn=None, parallel=None) -> Transformer:
    embeddings = make_embeddings(cfg, vocab_size, pieces)
    return Transformer(cfg, vocab_size, embeddings=embeddings, frontend=ByteWSFFrontEnd(cfg), ffn=ffn)
