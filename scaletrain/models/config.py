"""Typed model configuration (the ``model:`` section of a recipe) and every rule it must satisfy.

Core keys sit directly under ``model``. Each variant's options sit in a section of their own, used
only when ``model.arch`` (or ``model.embedding``) selects that variant:

    section            used by                       keys
    model.lobef        arch byte_ncf, byte_wsf       byte_layers; ngrams (byte_ncf); separators (byte_wsf)
    model.conv         arch msc, msha, moce          kernels, layers
    model.moce         arch moce                     top_k, lid, route_scaled_q, dispatch
    model.onehot       embedding onehot              learnable_scales
    model.charaware    embedding charaware           dim, kernels, filters, highway_layers, max_len, gate

A config file or override that sets a key the chosen variant does not use is an error
(``ModelConfig.check_keys_set``, applied by the config loader to the keys as written); the resolved
config (``scaletrain.config.to_dict``) lists only the keys in use (``ModelConfig.used_keys``). A
``ModelConfig`` built in Python always holds every section; builders read only the ones in use. The flat names of earlier versions (``moce_top_k``, ...)
are rejected with their new name (``RENAMED``).

Each rule is checked in one place: ``ModelConfig.validate`` for the core keys, each section's
``validate`` for its own keys (config loading and ``build_model`` both call them).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping, Optional

from scaletrain.errors import ScaletrainError
from scaletrain.vocab import LANG_OFFSET

KERNEL_MODES = ("auto", "torch")  # model.kernels, see scaletrain.models.kernels


def _fail(key: str, msg: str) -> None:
    raise ScaletrainError(f"model.{key}: {msg}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_bool(key: str, v: Any) -> None:
    if not isinstance(v, bool):
        _fail(key, f"must be true or false, got {v!r}")


def _check_int(key: str, v: Any, low: int, hint: str = "") -> None:
    if not _is_int(v) or v < low:
        what = "a positive integer" if low > 0 else "a non-negative integer"
        _fail(key, f"must be {what}{hint}, got {v!r}")


def _int_list(v: Any) -> Optional[list]:
    """``v`` as a list when it is a list/tuple of ints (no bools), else None."""
    if not isinstance(v, (list, tuple)) or any(not _is_int(x) for x in v):
        return None
    return list(v)


# ---------------------------------------------------------------------------------------
# variant sections
# ---------------------------------------------------------------------------------------
class _Section:
    """Which values of the core key ``SELECTOR`` use this section (``USERS``), or one of its keys
    (``KEY_USERS``, narrower than the section)."""

    SELECTOR: ClassVar[str] = "arch"
    USERS: ClassVar[tuple[str, ...]] = ()
    KEY_USERS: ClassVar[dict[str, tuple[str, ...]]] = {}

    @classmethod
    def users(cls, key: str) -> tuple[str, ...]:
        return cls.KEY_USERS.get(key, cls.USERS)


@dataclass
class LobefConfig(_Section):
    """LOBEF byte front-ends: byte layers replace the first encoder layers (scaletrain.models.lobef)."""

    USERS = ("byte_ncf", "byte_wsf")
    KEY_USERS = {"ngrams": ("byte_ncf",), "separators": ("byte_wsf",)}

    byte_layers: int = 4
    """Layers inside the front-end (>= 0; nCF paper: 4, WSF paper: 2)."""
    ngrams: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    """byte_ncf: the n-gram widths combined, distinct positive integers; 1 = the identity stream."""
    separators: list[int] = field(default_factory=lambda: [32])
    """byte_wsf: byte values (0-255) that end a word (32 = space)."""

    def validate(self, model: "ModelConfig", vocab_size: Optional[int]) -> None:
        _check_int("lobef.byte_layers", self.byte_layers, 0)
        ng = _int_list(self.ngrams)
        if not ng or any(n < 1 for n in ng) or len(set(ng)) != len(ng):
            _fail("lobef.ngrams", f"need distinct positive integers (1 = identity stream), got {self.ngrams!r}")
        seps = _int_list(self.separators)
        if not seps or any(not 0 <= b < 256 for b in seps):
            _fail("lobef.separators", f"need byte values in [0, 255] (32 = space), got {self.separators!r}")


@dataclass
class ConvConfig(_Section):
    """Convolutional attention in chosen encoder layers (scaletrain.models.convattn)."""

    USERS = ("msc", "msha", "moce")

    kernels: list[int] = field(default_factory=lambda: [0, 1, 3, 5, 7, 9])
    """Kernel size per head (msc, msha: one per ``model.n_heads``) or per expert (moce); 0 = identity, else odd."""
    layers: list[int] = field(default_factory=lambda: [0])
    """Encoder layer indices (0-based, distinct) with the variant attention."""

    def validate(self, model: "ModelConfig", vocab_size: Optional[int]) -> None:
        ks = list(self.kernels) if isinstance(self.kernels, (list, tuple)) else None
        if not ks:
            _fail("conv.kernels", f"give a list of at least one kernel size (0 = identity), got {self.kernels!r}")
        for k in ks:
            if not _is_int(k) or k < 0 or (k > 0 and k % 2 == 0):
                _fail("conv.kernels", f"kernel sizes must be 0 (identity) or odd positive integers, got {k!r} in {ks}")
        if model.arch in ("msc", "msha") and len(ks) != model.n_heads:
            _fail("conv.kernels", f"{model.arch} needs one kernel per head ({model.n_heads}), got {len(ks)}: {ks}")
        layers = list(self.layers) if isinstance(self.layers, (list, tuple)) else None
        if not layers:
            _fail("conv.layers", f"list at least one encoder layer index (e.g. [0]), got {self.layers!r}")
        for i in layers:
            if not _is_int(i) or not 0 <= i < model.encoder_layers:
                _fail("conv.layers", f"{i!r} is not an encoder layer index in [0, {model.encoder_layers - 1}]")
        if len(set(layers)) != len(layers):
            _fail("conv.layers", f"duplicate layer index in {layers}")


@dataclass
class MoCEConfig(_Section):
    """MoCE / Ada-MSHA routing (arch moce; the experts are ``model.conv.kernels``)."""

    USERS = ("moce",)

    top_k: int = 2
    """Conv experts each position is routed to (>= 1)."""
    lid: bool = False
    """The router also sees the source-tag embedding (tag at source position 0; needs language tags)."""
    route_scaled_q: bool = True
    """As the paper's code: q is scaled by d_h^-1/2 before routing and the experts."""
    dispatch: str = "auto"
    """How the experts are evaluated (same results): ``auto`` = only the routed (slot, expert) pairs on CPU
    (with ``model.kernels: auto``), all experts in one conv elsewhere; ``dense`` | ``routed`` force one."""

    def validate(self, model: "ModelConfig", vocab_size: Optional[int]) -> None:
        _check_int("moce.top_k", self.top_k, 1)
        _check_bool("moce.lid", self.lid)
        _check_bool("moce.route_scaled_q", self.route_scaled_q)
        if self.dispatch not in ("auto", "dense", "routed"):
            _fail("moce.dispatch", f"expected auto, dense or routed, got {self.dispatch!r}")
        if self.lid and vocab_size is not None and vocab_size <= LANG_OFFSET:
            _fail("moce.lid", "needs language tags in the vocabulary (source tag at src position 0)")


@dataclass
class OneHotConfig(_Section):
    """Embeddingless frozen one-hot rows (embedding onehot, scaletrain.models.onehot)."""

    SELECTOR = "embedding"
    USERS = ("onehot",)

    learnable_scales: bool = True
    """3 learnable scalars (encoder, decoder, output) initialised to sqrt(d_model); false: constant."""

    def validate(self, model: "ModelConfig", vocab_size: Optional[int]) -> None:
        _check_bool("onehot.learnable_scales", self.learnable_scales)
        if vocab_size is not None and vocab_size > model.d_model:
            _fail("embedding", f"onehot needs vocabulary size <= d_model, got {vocab_size} > {model.d_model}; "
                  "raise model.d_model or use model.embedding=learned")


@dataclass
class CharAwareConfig(_Section):
    """Character-aware gated target embeddings (embedding charaware, Renduchintala et al. 2018; needs
    the subword pieces, see scaletrain.models.charaware). Paper values: char embeddings 50, kernels
    3-6, each conv's output 1/4 of the embedding size, 2 highway layers, one gate vector per type."""

    SELECTOR = "embedding"
    USERS = ("charaware",)

    dim: int = 50
    """Character embedding size (>= 1)."""
    kernels: list[int] = field(default_factory=lambda: [3, 4, 5, 6])
    """Conv widths over characters: distinct positive integers."""
    filters: int = 0
    """Output channels per width (>= 0); 0 = d_model / len(kernels)."""
    highway_layers: int = 2
    """Highway layers after the convolutions (>= 0)."""
    max_len: int = 20
    """Characters kept per piece (>= 1; longer pieces keep their first max_len)."""
    gate: str = "vector"
    """``vector``: g in [0,1]^d per type (paper eq. 8) | ``scalar``: one gate per type."""

    def validate(self, model: "ModelConfig", vocab_size: Optional[int]) -> None:
        _check_int("charaware.dim", self.dim, 1)
        _check_int("charaware.filters", self.filters, 0, " (0 = d_model / len(kernels))")
        _check_int("charaware.highway_layers", self.highway_layers, 0)
        _check_int("charaware.max_len", self.max_len, 1)
        ks = _int_list(self.kernels)
        if not ks or any(k < 1 for k in ks) or len(set(ks)) != len(ks):
            _fail("charaware.kernels",
                  f"need a non-empty list of distinct positive widths (paper: [3, 4, 5, 6]), got {self.kernels!r}")
        if self.gate not in ("vector", "scalar"):
            _fail("charaware.gate",
                  f"must be 'vector' (one gate vector per type, the paper) or 'scalar', got {self.gate!r}")


SECTIONS = ("lobef", "conv", "moce", "onehot", "charaware")


# ---------------------------------------------------------------------------------------
# the model section
# ---------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    """``model:`` the network; core keys here, each variant's in a section of its own (module docstring)."""

    arch: str = "transformer"
    """The architecture, a registry key (scaletrain.models.registry): ``transformer`` | ``byte_ncf`` |
    ``byte_wsf`` | ``msc`` | ``msha`` | ``moce``."""
    d_model: int = 512
    """Model width (>= 1, divisible by ``n_heads``)."""
    n_heads: int = 8
    """Attention heads per layer (>= 1)."""
    encoder_layers: int = 6
    """Encoder layers (>= 0), the LOBEF front-end's byte layers included."""
    decoder_layers: int = 6
    """Decoder layers (>= 1)."""
    ffn_dim: int = 2048
    """Hidden size of the feed-forward blocks (>= 1)."""
    dropout: float = 0.1
    """Residual dropout probability, in [0, 1)."""
    attention_dropout: float = 0.0
    """Dropout on the attention weights, in [0, 1)."""
    activation_dropout: float = 0.0
    """Dropout after the feed-forward activation, in [0, 1)."""
    activation: str = "relu"
    """Feed-forward activation: ``relu`` | ``gelu``."""
    pre_ln: bool = False
    """Layer norm before each sub-layer; false = post-LN as in the papers."""
    max_positions: int = 1024
    """Longest sequence the position table holds, in tokens (>= 1; >= ``data.max_bytes + 2``)."""
    share_embeddings: bool = True
    """Tie the encoder/decoder input embeddings and the output projection."""
    scale_embeddings: bool = True
    """Multiply embeddings by sqrt(d_model)."""
    kernels: str = "auto"
    """``auto``: faster attention backward / dropout masks on CPU (scaletrain.models.kernels) | ``torch``: stock
    ops. Stored on the modules of each model built (two models may use different kernels)."""
    encoder_input_dropout: bool = True
    """Dropout on the embedded source (+ positions); Embeddingless turns it off."""
    decoder_input_dropout: bool = True
    """Dropout on the embedded decoder input ("token dropout" with one-hot embeddings)."""
    decoder_last_layer_dropout: bool = True
    """Residual dropout inside the last decoder layer; Embeddingless turns it off."""
    embedding: str = "learned"
    """Input/output representation: ``learned`` | ``onehot`` (frozen one-hot rows, Shaham & Levy 2021) |
    ``charaware`` (character-aware target embeddings; subword tokenizer)."""

    # ---- variant sections (see the module docstring) ----------------------------------
    lobef: LobefConfig = field(default_factory=LobefConfig)
    """LOBEF byte front-ends (arch byte_ncf, byte_wsf)."""
    conv: ConvConfig = field(default_factory=ConvConfig)
    """Convolutional attention (arch msc, msha, moce)."""
    moce: MoCEConfig = field(default_factory=MoCEConfig)
    """MoCE routing (arch moce)."""
    onehot: OneHotConfig = field(default_factory=OneHotConfig)
    """One-hot embeddings (embedding onehot)."""
    charaware: CharAwareConfig = field(default_factory=CharAwareConfig)
    """Character-aware embeddings (embedding charaware)."""

    # the flat key names of earlier versions -> their place now
    RENAMED: ClassVar[dict[str, str]] = {
        "byte_encoder_layers": "lobef.byte_layers", "ncf_ngrams": "lobef.ngrams",
        "wsf_separators": "lobef.separators", "conv_kernels": "conv.kernels", "conv_layers": "conv.layers",
        "moce_top_k": "moce.top_k", "moce_lid": "moce.lid", "moce_route_scaled_q": "moce.route_scaled_q",
        "moce_dispatch": "moce.dispatch", "onehot_learnable_scales": "onehot.learnable_scales",
        "char_dim": "charaware.dim", "char_kernels": "charaware.kernels", "char_filters": "charaware.filters",
        "char_highway_layers": "charaware.highway_layers", "char_max_len": "charaware.max_len",
        "char_gate": "charaware.gate",
    }

    # ---- which variant keys apply ------------------------------------------------------
    def uses(self, section: str, key: str) -> bool:
        """Whether this config's arch / embedding uses ``model.<section>.<key>``."""
        cls = type(getattr(self, section))
        return getattr(self, cls.SELECTOR) in cls.users(key)

    def used_keys(self) -> dict[str, list[str]]:
        """Per variant section, the keys this config's arch / embedding uses ([] = section unused)."""
        return {s: [f.name for f in fields(getattr(self, s)) if self.uses(s, f.name)] for s in SECTIONS}

    def check_keys_set(self, given: Mapping) -> None:
        """Raise if ``given`` (the ``model`` mapping as written: recipe + overrides) sets a key of a
        variant that this config's arch / embedding does not use."""
        for section in SECTIONS:
            keys = given.get(section)
            if not isinstance(keys, Mapping):
                continue
            cls = type(getattr(self, section))
            chosen = getattr(self, cls.SELECTOR)
            for key in keys:
                if not self.uses(section, key):
                    raise ScaletrainError(
                        f"model.{section}.{key} is set but model.{cls.SELECTOR} is {chosen!r}; it applies only to "
                        f"{cls.SELECTOR} {', '.join(cls.users(key))}"
                    )

    # ---- rules -------------------------------------------------------------------------
    def validate(self, vocab_size: Optional[int] = None) -> None:
        """Check every model rule; ``vocab_size`` adds the rules that depend on the vocabulary.
        Raises ScaletrainError naming the key."""
        if vocab_size is not None and (not _is_int(vocab_size) or vocab_size < 5):
            raise ScaletrainError(f"vocabulary size must be an int >= 5 (specials + bytes), got {vocab_size!r}")
        self._validate_core()
        for section, keys in self.used_keys().items():
            if keys:
                getattr(self, section).validate(self, vocab_size)

    def _validate_core(self) -> None:
        for key in ("d_model", "n_heads", "ffn_dim", "max_positions"):
            _check_int(key, getattr(self, key), 1)
        _check_int("encoder_layers", self.encoder_layers, 0)
        _check_int("decoder_layers", self.decoder_layers, 1)
        if self.d_model % self.n_heads:
            _fail("n_heads", f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        for key in ("dropout", "attention_dropout", "activation_dropout"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or not 0.0 <= v < 1.0:
                _fail(key, f"must be a probability in [0, 1), got {v!r}")
        if self.activation not in ("relu", "gelu"):
            _fail("activation", f"must be 'relu' or 'gelu', got {self.activation!r}")
        if self.kernels not in KERNEL_MODES:
            _fail("kernels", f"must be 'auto' or 'torch', got {self.kernels!r}")
        if self.embedding not in ("learned", "onehot", "charaware"):
            _fail("embedding", f"must be 'learned', 'onehot' or 'charaware', got {self.embedding!r}")
        for key in ("pre_ln", "share_embeddings", "scale_embeddings", "encoder_input_dropout",
                    "decoder_input_dropout", "decoder_last_layer_dropout"):
            _check_bool(key, getattr(self, key))


# ---------------------------------------------------------------------------------------
# the top-level moe section (sparse MoE feed-forward layers and expert parallelism)
# ---------------------------------------------------------------------------------------
@dataclass
class MoEConfig:
    """``moe:`` (a top-level section of the run config, beside ``model``): sparse MoE feed-forward
    layers (scaletrain.models.moe) and how their experts are spread over ranks. ``num_experts: 0``
    (the default) = no MoE layer, the dense model is unchanged."""

    num_experts: int = 0
    """Experts per MoE layer (>= 0); 0 = no MoE layer."""
    top_k: int = 2
    """Experts per token (token choice; 1 <= top_k <= num_experts)."""
    every: int = 2
    """Every N-th feed-forward block of the encoder and of the decoder is MoE (1-based: N, 2N, ...; >= 1)."""
    ffn_dim: int = 0
    """Hidden size of each expert (>= 0); 0 = ``model.ffn_dim``."""
    capacity_factor: float = 0.0
    """0 = dropless; c > 0: each expert takes at most ceil(c * tokens * top_k / E) pairs per rank."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss E * sum_e f_e * P_e (Switch / GShard), >= 0."""
    shared_expert: bool = False
    """A dense expert (``moe.ffn_dim`` wide) every token also goes through; its output is added."""
    ep_size: int = 1
    """Expert-parallel group size (>= 1, dividing ``num_experts``): each MoE layer's FFN experts are split over
    this many ranks (Accelerate DDP; DeepSpeed ZeRO-0 fp32/bf16, ZeRO-1/2; docs/EXPERT_PARALLEL.md)."""
    moce_partition: bool = False
    """MoCE (arch moce) with ``ep_size`` > 1: also spread each Ada-MSHA layer's conv experts over the EP group
    (scaletrain.models.moce_ep). Off by default: they are small, moving a window costs more than computing
    it (docs/EXPERT_PARALLEL.md, "Expert-parallel MoCE"), so they stay replicated like every other dense weight."""

    def enabled(self) -> bool:
        return self.num_experts > 0

    def moe_layer(self, index: int) -> bool:
        """Whether encoder/decoder layer ``index`` (0-based) gets a MoE feed-forward block."""
        return self.enabled() and (index + 1) % self.every == 0

    def expert_ffn_dim(self, model: ModelConfig) -> int:
        return self.ffn_dim or model.ffn_dim

    def validate(self, model: ModelConfig) -> None:
        def bad(key: str, msg: str) -> None:
            raise ScaletrainError(f"moe.{key}: {msg}")

        for key, low in (("num_experts", 0), ("top_k", 1), ("every", 1), ("ffn_dim", 0), ("ep_size", 1)):
            v = getattr(self, key)
            if not _is_int(v) or v < low:
                bad(key, f"must be an integer >= {low}, got {v!r}")
        for key in ("capacity_factor", "aux_loss_coef"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                bad(key, f"must be a number >= 0, got {v!r}")
        for key in ("shared_expert", "moce_partition"):
            if not isinstance(getattr(self, key), bool):
                bad(key, f"must be true or false, got {getattr(self, key)!r}")
        if self.moce_partition:
            if model.arch != "moce":
                bad("moce_partition", f"is true but model.arch is {model.arch!r}: only MoCE has conv experts")
            n_conv = sum(1 for k in model.conv.kernels if k > 0)
            if self.ep_size > n_conv:
                bad("ep_size", f"{self.ep_size} is more than the {n_conv} conv experts of a MoCE layer "
                    "(moe.moce_partition puts each on one rank)")
        if not self.enabled():
            if self.ep_size > 1 and not self.moce_partition:
                bad("ep_size", f"is {self.ep_size} but moe.num_experts is 0 and moe.moce_partition is false: "
                    "there are no experts to split")
            return
        if self.top_k > self.num_experts:
            bad("top_k", f"{self.top_k} is more than moe.num_experts={self.num_experts}")
        if self.num_experts % self.ep_size:
            bad("num_experts", f"{self.num_experts} experts cannot be split evenly over moe.ep_size={self.ep_size} ranks")
        if self.every > max(model.encoder_layers, model.decoder_layers):
            bad("every", f"{self.every} is more than the number of layers "
                f"({model.encoder_layers} encoder, {model.decoder_layers} decoder): no layer would be MoE")
