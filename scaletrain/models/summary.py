"""``scaletrain model summary``: a model's parameters per component and training FLOPs per target token.

Counts come from :mod:`scaletrain.models.counting`; the model is built on the meta device, so
paper-size models cost no memory.
"""
from __future__ import annotations

from scaletrain.models.config import ModelConfig
from scaletrain.models.counting import count_parameters, estimate_flops_per_token

_COMPONENT_ORDER = ("embeddings", "frontend", "encoder", "decoder")


def model_summary(cfg: ModelConfig, vocab_size: int, src_len: int = 100, tgt_len: int = 100, pieces=None,
                  moe=None) -> dict:
    """Build the model on the meta device (no memory, no init cost) and report its size and compute.

    Returns ``{"arch", "vocab_size", "components": [(name, params)], "variant", "total", "trainable",
    "flops_per_token", "src_len", "tgt_len"}``; ``variant`` (the plug-in's extra weights) is part of
    ``encoder`` (or ``frontend``) and listed separately, not added to the total twice.
    """
    import torch

    from scaletrain.models.build import build_model

    with torch.device("meta"):
        model = build_model(cfg, vocab_size, pieces=pieces, moe=moe)
    counts = count_parameters(model)
    experts = sum(p.numel() for p in model.parameters() if getattr(p, "expert", False))
    names = [k for k in _COMPONENT_ORDER] + sorted(
        k for k in counts if k not in _COMPONENT_ORDER and k not in ("variant", "total", "trainable")
    )
    return {
        "arch": cfg.arch,
        "vocab_size": vocab_size,
        "components": [(k, counts[k]) for k in names],
        "variant": counts["variant"],
        "experts": experts,  # MoE expert parameters (all experts of every MoE layer), part of the total
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
    if s.get("experts"):
        lines.append(f"{'  incl. MoE experts':<22}{s['experts']:>14,}{100 * s['experts'] / total:>8.2f}%")
    if s["trainable"] != s["total"]:
        lines.append(f"{'trainable':<22}{s['trainable']:>14,}")
    lines.append(
        f"training FLOPs per target token (fwd+bwd, src {s['src_len']} / tgt {s['tgt_len']} tokens): "
        f"{s['flops_per_token']:.4g} ({s['flops_per_token'] / 1e9:.3f} GFLOP)"
    )
    if s.get("experts"):
        lines.append("(the FLOPs estimate counts the dense feed-forward size: MoE layers are not modelled yet)")
    return "\n".join(lines)
