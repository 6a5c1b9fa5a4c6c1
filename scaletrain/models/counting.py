"""Model size and compute: parameter counts per component and FLOPs per target token (for MFU)."""
from __future__ import annotations

import math

from torch import nn

from scaletrain.models.config import ModelConfig

_GROUPS = {
    "embeddings": "embeddings",
    "frontend": "frontend",
    "encoder_layers": "encoder",
    "encoder_norm": "encoder",
    "decoder_layers": "decoder",
    "decoder_norm": "decoder",
}


def count_parameters(model: nn.Module, expert_parallel: int = 1) -> dict[str, int]:
    """Parameters per component, shared tensors counted once (where first met). ``expert_parallel``:
    the moe.ep_size the model was built with (a rank holds 1/P of each MoE layer's experts); the counts
    are those of the whole model, every expert included.

    Keys: embeddings, frontend, encoder, decoder (always present), any other top-level child by
    name, ``variant`` (parameters whose name contains ``.variant.``: the extra weights a plug-in
    adds inside an encoder layer; also included in ``encoder``), ``total`` and ``trainable``.
    Frozen one-hot tables are buffers, not parameters, so they are not counted.
    """
    out = {"embeddings": 0, "frontend": 0, "encoder": 0, "decoder": 0}
    seen: set[int] = set()
    variant = total = trainable = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        top = name.split(".", 1)[0]
        group = _GROUPS.get(top, top if "." in name else "other")
        if getattr(p, "full_shape", None) is not None:  # an owned expert (MoCE under EP): whole on one rank
            n = math.prod(p.full_shape)
        else:
            n = p.numel() * (expert_parallel if getattr(p, "expert", False) else 1)
        out[group] = out.get(group, 0) + n
        if ".variant." in name:
            variant += n
        total += n
        trainable += n if p.requires_grad else 0
    out["variant"] = variant
    out["total"] = total
    out["trainable"] = trainable
    return out


def estimate_flops_per_token(
    cfg: ModelConfig, src_len: int, tgt_len: int, vocab_size: int | None = None
) -> float:
    """Training FLOPs (forward + backward = 3 x forward, 2 FLOPs per multiply-add) per target token
    for one sentence pair of ``src_len`` source and ``tgt_len`` target tokens, nanoGPT style.

    Counts every matrix multiply: projections, FFNs, attention scores and weighted sums (full
    T x T for the causal decoder, as nanoGPT does), cross-attention, the output projection when
    ``vocab_size`` is given, and the variants' extra convolutions. Ignores norms, softmax,
    biases and element-wise ops. MFU = tokens/s * this / peak FLOP/s.
    """
    d, f, S, T = cfg.d_model, cfg.ffn_dim, src_len, tgt_len
    h = cfg.n_heads
    dh = d // h
    enc_layer = S * (4 * d * d + 2 * d * f) + 2 * S * S * d
    n_enc = cfg.encoder_layers
    macs = 0
    if cfg.arch in ("byte_ncf", "byte_wsf"):
        n_enc += cfg.lobef.byte_layers
    if cfg.arch == "byte_ncf":
        macs += S * d * d * sum(1 for n in cfg.lobef.ngrams if n > 1)  # stride-n conv: n*d*d per n tokens
    macs += n_enc * enc_layer
    kernels = [k for k in cfg.conv.kernels]
    n_conv_layers = len([i for i in cfg.conv.layers if 0 <= i < cfg.encoder_layers])
    if cfg.arch == "moce":  # dense experts on q, k and v, every head
        macs += n_conv_layers * 3 * S * h * dh * dh * sum(kernels)
    elif cfg.arch == "msha":  # one kernel per head on q, k and v
        macs += n_conv_layers * 3 * S * dh * dh * sum(kernels)
    elif cfg.arch == "msc":  # one kernel per head-chunk of the layer input
        macs += n_conv_layers * S * dh * dh * sum(kernels)
    dec_layer = T * (4 * d * d + 2 * d * d + 2 * d * f) + S * 2 * d * d + 2 * T * T * d + 2 * T * S * d
    macs += cfg.decoder_layers * dec_layer
    if vocab_size:
        macs += T * d * vocab_size
    return 6.0 * macs / T
