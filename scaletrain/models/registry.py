"""Model registry: ``cfg.arch`` -> builder ``(cfg, vocab_size, pieces) -> nn.Module``, plus config checks."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from torch import nn

from scaletrain.errors import ScaletrainError
from scaletrain.models.config import KERNEL_MODES, ModelConfig

# (config, vocabulary size, the surface string of every id or None) -> model; the config is
# checked before the builder runs (check_config)
Builder = Callable[[ModelConfig, int, Optional[Sequence[str]]], nn.Module]
_REGISTRY: dict[str, Builder] = {}


def register_model(name: str) -> Callable[[Builder], Builder]:
    """Decorator: ``@register_model("moce") def build(cfg, vocab_size, pieces): ...``"""

    def deco(fn: Builder) -> Builder:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ScaletrainError(f"model architecture {name!r} is registered twice")
        _REGISTRY[name] = fn
        return fn

    return deco


def available_models() -> list[str]:
    return sorted(_REGISTRY)


def builder(arch: str) -> Builder:
    """The builder registered under ``arch``; ScaletrainError naming ``model.arch`` otherwise."""
    if arch not in _REGISTRY:
        raise ScaletrainError(
            f"model.arch: unknown architecture {arch!r}; choose one of: {', '.join(available_models())}"
        )
    return _REGISTRY[arch]


def _fail(key: str, msg: str) -> None:
    raise ScaletrainError(f"model.{key}: {msg}")


def check_config(cfg: ModelConfig, vocab_size: int) -> None:
    """Validate the fields every architecture uses; raises ScaletrainError naming the key."""
    if not isinstance(vocab_size, int) or vocab_size < 5:
        raise ScaletrainError(f"vocabulary size must be an int >= 5 (specials + bytes), got {vocab_size!r}")
    for key in ("d_model", "n_heads", "ffn_dim", "max_positions"):
        v = getattr(cfg, key)
        if not isinstance(v, int) or v <= 0:
            _fail(key, f"must be a positive integer, got {v!r}")
    for key in ("encoder_layers", "decoder_layers"):
        v = getattr(cfg, key)
        if not isinstance(v, int) or v < 0:
            _fail(key, f"must be a non-negative integer, got {v!r}")
    if cfg.decoder_layers < 1:
        _fail("decoder_layers", "must be at least 1")
    if cfg.d_model % cfg.n_heads:
        _fail("n_heads", f"d_model={cfg.d_model} is not divisible by n_heads={cfg.n_heads}")
    for key in ("dropout", "attention_dropout", "activation_dropout"):
        v = getattr(cfg, key)
        if not isinstance(v, (int, float)) or not 0.0 <= v < 1.0:
            _fail(key, f"must be a probability in [0, 1), got {v!r}")
    if cfg.activation not in ("relu", "gelu"):
        _fail("activation", f"must be 'relu' or 'gelu', got {cfg.activation!r}")
    if cfg.kernels not in KERNEL_MODES:
        _fail("kernels", f"must be 'auto' or 'torch', got {cfg.kernels!r}")
    if cfg.embedding not in ("learned", "onehot", "charaware"):
        _fail("embedding", f"must be 'learned', 'onehot' or 'charaware', got {cfg.embedding!r}")
    if cfg.embedding == "onehot" and vocab_size > cfg.d_model:
        _fail("embedding", f"onehot needs vocabulary size <= d_model, got {vocab_size} > {cfg.d_model}")
    for key in (
        "pre_ln",
        "share_embeddings",
        "scale_embeddings",
        "encoder_input_dropout",
        "decoder_input_dropout",
        "decoder_last_layer_dropout",
        "onehot_learnable_scales",
    ):
        if not isinstance(getattr(cfg, key), bool):
            _fail(key, f"must be true or false, got {getattr(cfg, key)!r}")
    _check_charaware(cfg)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_charaware(cfg: ModelConfig) -> None:
    """The character-aware embedding fields (checked whatever ``embedding`` is, so a typo shows early)."""
    for key, low in (("char_dim", 1), ("char_filters", 0), ("char_highway_layers", 0), ("char_max_len", 1)):
        v = getattr(cfg, key)
        if not _is_int(v) or v < low:
            what = "a positive integer" if low else "a non-negative integer"
            extra = " (0 = d_model / len(char_kernels))" if key == "char_filters" else ""
            _fail(key, f"must be {what}{extra}, got {v!r}")
    ks = cfg.char_kernels
    if (
        not isinstance(ks, (list, tuple))
        or not ks
        or any(not _is_int(k) or k < 1 for k in ks)
        or len(set(ks)) != len(ks)
    ):
        _fail("char_kernels", f"need a non-empty list of distinct positive widths (paper: [3, 4, 5, 6]), got {ks!r}")
    if cfg.char_gate not in ("vector", "scalar"):
        _fail("char_gate", f"must be 'vector' (one gate vector per type, the paper) or 'scalar', got {cfg.char_gate!r}")
