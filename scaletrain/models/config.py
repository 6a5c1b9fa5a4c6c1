"""Typed model configuration (the ``model:`` section of a recipe)."""
from __future__ import annotations

from dataclasses import dataclass, field

KERNEL_MODES = ("auto", "torch")  # model.kernels, see scaletrain.models.kernels


@dataclass
class ModelConfig:
    arch: str = "transformer"  # registry key, see scaletrain.models.build_model
    d_model: int = 512
    n_heads: int = 8
    encoder_layers: int = 6
    decoder_layers: int = 6
    ffn_dim: int = 2048
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    activation: str = "relu"  # relu | gelu
    pre_ln: bool = False  # False = post-LN as in the papers
    max_positions: int = 1024
    share_embeddings: bool = True  # tie encoder/decoder input embeddings and output projection
    scale_embeddings: bool = True  # multiply embeddings by sqrt(d_model)
    # auto: faster attention backward / dropout masks on CPU (see scaletrain.models.kernels); torch: stock
    # ops. Stored on the modules of each model built (two models may use different kernels).
    kernels: str = "auto"

    # ---- added by the model package (all optional; defaults = plain Transformer) ----------
    # explicit dropout switches (Embeddingless removes encoder-input and last-decoder-layer dropout)
    encoder_input_dropout: bool = True  # dropout on embedded source (+positions)
    decoder_input_dropout: bool = True  # dropout on embedded decoder input ("token dropout" with one-hot)
    decoder_last_layer_dropout: bool = True  # residual dropout inside the last decoder layer
    # input/output representation
    embedding: str = "learned"  # learned | onehot (frozen one-hot rows, Shaham & Levy 2021) | charaware
    onehot_learnable_scales: bool = True  # onehot: 3 learnable scalars (enc, dec, out) init sqrt(d); else constant
    # LOBEF front-ends (arch byte_ncf / byte_wsf): byte layers replace the first encoder layers
    byte_encoder_layers: int = 4  # layers inside the front-end (nCF paper: 4, WSF paper: 2)
    ncf_ngrams: list[int] = field(default_factory=lambda: [1, 2, 3, 4])  # 1 = identity stream
    wsf_separators: list[int] = field(default_factory=lambda: [32])  # byte VALUES that end a word (32 = space)
    # convolutional attention (arch msc / msha / moce)
    conv_kernels: list[int] = field(default_factory=lambda: [0, 1, 3, 5, 7, 9])  # 0 = identity; odd sizes
    conv_layers: list[int] = field(default_factory=lambda: [0])  # encoder layers with the variant attention
    moce_top_k: int = 2
    moce_lid: bool = False  # router also sees the source-tag embedding (tag at src position 0)
    moce_route_scaled_q: bool = True  # as the paper's code: q is scaled by d_h^-1/2 before routing/experts
    # how the experts are evaluated (same results): auto = only the routed (slot, expert) pairs on CPU
    # (with model.kernels auto), all experts in one conv elsewhere; dense | routed force one
    moce_dispatch: str = "auto"
    # character-aware gated target embeddings (embedding=charaware, Renduchintala et al. 2018; needs the
    # subword pieces, see scaletrain.models.charaware). Paper values: char embeddings 50, kernels 3-6,
    # each conv's output 1/4 of the embedding size, 2 highway layers, one gate vector per type.
    char_dim: int = 50  # character embedding size
    char_kernels: list[int] = field(default_factory=lambda: [3, 4, 5, 6])  # conv widths over characters
    char_filters: int = 0  # output channels per width; 0 = d_model / len(char_kernels)
    char_highway_layers: int = 2
    char_max_len: int = 20  # characters kept per piece (longer pieces keep their first char_max_len)
    char_gate: str = "vector"  # vector: g in [0,1]^d per type (paper eq. 8) | scalar: one gate per type
