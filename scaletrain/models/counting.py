"""Model size and compute: parameter counts per component and FLOPs per target token (for MFU)."""
from __future__ import annotations

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


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Parameters per component, shared tensors counted once (where first met).

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
        out[group] = out.get(group, 0) + p.numel()
        if ".variant." in name:
            variant += p.numel()
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
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
        n_enc += cfg.byte_encoder_layers
    if cfg.arch == "byte_ncf":
        macs += S * d * d * sum(1 for n in cfg.ncf_ngrams if n > 1)  # stride-n conv: n*d*d per n tokens
    macs += n_enc * enc_layer
    kernels = [k for k in cfg.conv_kernels]
    n_conv_layers = len([i for i in cfg.conv_layers if 0 <= i < cfg.encoder_layers])
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


# ---------------------------------------------------------------------------------------
# model summary (``scaletrain model summary``)

_COMPONENT_ORDER = ("embeddings", "frontend", "encoder", "decoder")


def model_summary(cfg: ModelConfig, vocab_size: int, src_len: int = 100, tgt_len: int = 100, pieces=None) -> dict:
    """Build the model on the meta device (no memory, no init cost) and report its size and compute.

    Returns ``{"arch", "vocab_size", "components": [(name, params)], "variant", "total", "trainable",
    "flops_per_token", "src_len", "tgt_len"}``; ``variant`` (the plug-in's extra weights) is part of
    ``encoder`` (or ``frontend``) and listed separately, not added to the total twice.
    """
    import torch

    from scaletrain.models import build_model

    with torch.device("meta"):
        model = build_model(cfg, vocab_size, pieces=pieces)
    counts = count_parameters(model)
    names = [k for k in _COMPONENT_ORDER] + sorted(
        k for k in counts if k not in _COMPONENT_ORDER and k not in ("variant", "total", "trainable")
    )
    return {
        "arch": cfg.arch,
        "vocab_size": vocab_size,
        "components": [(k, counts[k]) for k in names],
        "variant": counts["variant"],
        "total": counts["total"],
        "trainable": counts["trainable"],
        "flops_per_token": estimate_flops_per_token(cfg, src_len, tgt_len, vocab_size),
        "src_len": src_len,
        "tgt_len": tgt_len,
    }


def format_summary(s: dict, title: str = "") -> str:
    total = max(s["total"], 1)
    lines = []
    if title:
        lines.append(title)
    lines.append(f"arch {s['arch']}, vocabulary {s['vocab_size']} ids")
    lines.append(f"{'component':<22}{'parameters':>14}{'share':>9}")
    for name, n in s["components"]:
        lines.append(f"{name:<22}{n:>14,}{100 * n / total:>8.2f}%")
    if s["variant"]:
        lines.append(f"{'  incl. variant':<22}{s['variant']:>14,}{100 * s['variant'] / total:>8.2f}%")
    lines.append(f"{'total':<22}{s['total']:>14,}  ({s['total'] / 1e6:.2f}M)")
    if s["trainable"] != s["total"]:
        lines.append(f"{'trainable':<22}{s['trainable']:>14,}")
    lines.append(
        f"training FLOPs per target token (fwd+bwd, src {s['src_len']} / tgt {s['tgt_len']} tokens): "
        f"{s['flops_per_token']:.4g} ({s['flops_per_token'] / 1e9:.3f} GFLOP)"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# routing statistics as flat metrics (for the training loop / MLflow)


def routing_metrics(model: nn.Module, langs: list[str] | None = None, reset: bool = True) -> dict[str, float]:
    """Flat ``{name: value}`` metrics from ``model.routing_stats()`` (MoCE); ``{}`` for other models.

    Copies the device-side counters to the host (one sync): call it every N steps, not every step.
    Per routed layer (``L`` = the encoder layer index) and source language (``langs[i]``, or the
    manifest index), over the real tokens routed since the last reset:

    - ``routing/L<L>/<lang>/share_k<kernel>``: fraction of the (q|k|v, head, token) routing choices
      that picked the expert with that kernel size (k0 = identity); sums to 1 over the experts
      (each slot makes ``top_k`` choices, the share divides by them);
    - ``routing/L<L>/<lang>/mean_radius``: routing-weighted receptive radius (k-1)/2, the MoCE paper's
      delta (Fig. 4);
    - ``routing/L<L>/all/...``: the same over all languages, weighted by tokens.
    ``model`` may be wrapped (DeepSpeed/DDP ``.module``).
    """
    inner = getattr(model, "module", model)
    fn = getattr(inner, "routing_stats", None)
    if not callable(fn):
        return {}
    out: dict[str, float] = {}
    for name, st in fn(reset=reset).items():
        sel, radius, tokens = st.get("selection") or [], st.get("mean_radius") or [], st.get("tokens") or []
        if not sel:
            continue
        kernels = list(st["kernels"])
        k_per_slot = float(st.get("top_k") or 1)  # each slot picks top_k experts: rows of selection sum to top_k
        parts = name.split(".")
        layer = next((p for p in parts if p.isdigit()), name)
        prefix = f"routing/L{layer}"
        tot_tok = sum(tokens)
        agg = [0.0] * len(kernels)
        agg_r = 0.0
        for i, n in enumerate(tokens):
            if n <= 0:
                continue
            lang = langs[i] if langs is not None and i < len(langs) else str(i)
            for e, k in enumerate(kernels):
                share = sel[i][e] / k_per_slot
                out[f"{prefix}/{lang}/share_k{k}"] = share
                agg[e] += share * n
            out[f"{prefix}/{lang}/mean_radius"] = radius[i]
            agg_r += radius[i] * n
        if tot_tok > 0:
            for e, k in enumerate(kernels):
                out[f"{prefix}/all/share_k{k}"] = agg[e] / tot_tok
            out[f"{prefix}/all/mean_radius"] = agg_r / tot_tok
    return out
