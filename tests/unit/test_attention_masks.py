"""Attention runs without a mask where the batch allows it (docs/MODELS.md §2): decoder self-attention is
causal only, and a source without padding (``src_padded=False``) drops the key-padding mask of encoder
self-attention and cross-attention, so SDPA may pick FlashAttention on CUDA. Outputs equal the masked path."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from scaletrain.data.batch import Example, collate
from scaletrain.models import ModelConfig, build_model
from scaletrain.models.config import ConvConfig, LobefConfig, MoEConfig
from scaletrain.models.kernels import SdpaKernels, sdpa_backend
from scaletrain.vocab import LANG_OFFSET, PAD

V = LANG_OFFSET + 4
ARCHS = {
    "transformer": dict(),
    "moce": dict(arch="moce", conv=ConvConfig(kernels=[0, 1, 3, 5], layers=[0])),
    "msc": dict(arch="msc", conv=ConvConfig(kernels=[0, 3, 3, 5], layers=[0])),
    "byte_ncf": dict(arch="byte_ncf", lobef=LobefConfig(byte_layers=1, ngrams=[1, 2])),
    "byte_wsf": dict(arch="byte_wsf", lobef=LobefConfig(byte_layers=1)),
}


def model(arch: str, moe=None):
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=4, encoder_layers=2, decoder_layers=2, ffn_dim=48, dropout=0.0,
                      max_positions=64, kernels="torch", **ARCHS[arch])
    return build_model(cfg, V, moe=moe).eval()


def tokens(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(4, LANG_OFFSET, (rows, length), generator=g)
    t[:, 0] = LANG_OFFSET
    t[:, length // 2] = 32 + 4  # a space, for WSF's word blocks
    return t


@pytest.mark.parametrize("arch", list(ARCHS) + ["moe"])
def test_unmasked_path_equals_masked_path_without_padding(arch):
    m = model("transformer" if arch == "moe" else arch, MoEConfig(num_experts=4, top_k=2, every=1) if arch == "moe"
              else None)
    src, tgt = tokens(3, 11), tokens(3, 9, seed=1)
    outs = []
    for padded in (True, False):
        m.zero_grad()
        with SdpaKernels() as k:
            logits = m(src, tgt, src_padded=padded)
            logits.float().pow(2).mean().backward()
        outs.append((logits.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None], k.calls))
    (lm, gm, km), (lu, gu, ku) = outs
    torch.testing.assert_close(lu, lm, rtol=1e-5, atol=1e-5)
    for a, b in zip(gu, gm):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # decoder self-attention is causal and unmasked either way; encoder self- and cross-attention drop the mask
    assert not any(masked for _, masked in ku if arch != "byte_wsf"), ku
    assert sum(masked for _, masked in km) > sum(masked for _, masked in ku)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_padded_batch_keeps_the_mask(arch):
    """Row 0 padded next to a longer row gives the logits it gives alone (unpadded, without a mask)."""
    m = model(arch)
    src, tgt = tokens(2, 13), tokens(2, 9, seed=1)
    src[0, 8:] = PAD
    src[0, 4] = 32 + 4
    alone = m(src[:1, :8], tgt[:1], src_padded=False)
    with SdpaKernels() as k:
        both = m(src, tgt)
    torch.testing.assert_close(both[:1], alone, rtol=1e-5, atol=1e-5)
    assert any(masked for _, masked in k.calls)


def test_batch_knows_its_padding_on_the_host():
    ex = [Example(0, 1, b"abc", b"xy"), Example(0, 1, b"def", b"z")]
    assert not collate(ex).src_padded  # equal source lengths: no PAD in src
    assert collate(ex + [Example(0, 1, b"a", b"z")]).src_padded
    assert collate(ex, pad_to_multiple=8).src_padded  # padded up to the multiple


def test_sdpa_backend_names_the_kernel():
    q = torch.randn(2, 4, 8, 16)
    assert sdpa_backend(q, q, q) in {"flash", "efficient", "cudnn", "math", "overrideable"}
    with SdpaKernels() as k:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert Counter(k.calls) == Counter({("flash-cpu", False): 1})
