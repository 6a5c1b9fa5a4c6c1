"""``data.max_tokens: auto``: a token budget per micro-batch that fits the accelerator, from the model and
the precision; resolved once at start-up and recorded in the resolved config (``data.max_tokens`` becomes
the number, ``data.max_tokens_auto`` says how), as ``engine.precision: auto`` is.

    tokens, reason = auto_max_tokens(cfg.model, vocab_size, "bf16", total_memory=80 * 2**30, moe=cfg.moe)

The estimate (``training_memory``), in bytes:

* fixed: every parameter's weight, gradient and AdamW state: 16 bytes in fp32 (4 + 4 + 8), 18 with
  mixed precision (an fp32 master or autocast's fp32 weights, plus the 16-bit copy); MoE experts
  all count (no sharding assumed: ZeRO and expert parallelism only make the estimate safer).
* per padded token: the activations a training step keeps for its backward, per layer and token,
  in the activation precision (2 bytes for bf16/fp16, 4 for fp32), with one byte per element for
  each dropout mask: attention ~6d (input, q, k, v, output; fused SDPA keeps no score matrix, only
  a log-sum-exp per head), the cross-attention of a decoder layer ~4d and its K/V 2d per source
  token, a feed-forward block 2d + 2f (MoE: k times the expert width, plus the routed copies),
  LayerNorm inputs, MoCE's stacked q/k/v and expert outputs; and per target token the logits in
  the model precision plus the fp32 log-softmax of the loss (V (e + 8) bytes).
  The budget counts source + target tokens, so a token is charged the larger of the source-side and
  target-side costs: any split of the budget between the sides fits. The count is charged 8% more
  (``ACTIVATION_MARGIN``): kernels differ in what they keep (measured 1.09-1.25x what autograd keeps on
  CPU, ``tests/unit/test_models_memory.py``).

A resumed run keeps the budget its checkpoint was written with (``trainer_state.json``'s ``max_tokens``,
:func:`reuse_max_tokens`): the data stream resumes exactly only with the batches it planned, so a resume
on other GPUs (another memory size or precision) keeps the old number, with one line where this device's
estimate is lower.

The budget is (usable - fixed) / per token with usable = 75% of the device memory less 1 GiB (CUDA
context, cuBLAS/cuDNN workspaces, allocator fragmentation), rounded down to a multiple of 256. On a
CPU ``auto`` is a fixed 4096 tokens: host memory is not the limit there, step time is. It is an
estimate, not a measurement: ``benchmarks/gpu_suite.py`` (check ``max-tokens-auto``) runs a step at
the resolved budget and reports the peak memory it used.
"""
from __future__ import annotations

from scaletrain.errors import ScaletrainError
from scaletrain.models.config import ModelConfig

CPU_AUTO_TOKENS = 4096
USABLE_FRACTION = 0.75
RESERVED_BYTES = 1 << 30
# the count below is of the tensors the model's own code keeps; the kernels a device picks may keep a little
# more (an embeddingless bf16 step on one CPU kept 1.04x the count, 1.01x on another), so it is charged 8% more
ACTIVATION_MARGIN = 1.08
_ROUND = 256


def _act_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _ffn_bytes(cfg: ModelConfig, moe, e: int, layer: int) -> float:
    """Activations per token of the feed-forward block of encoder/decoder layer ``layer``."""
    d, f = cfg.d_model, cfg.ffn_dim
    mask = lambda n, p: n if p > 0 else 0  # noqa: E731  one byte per element of a dropout mask
    if moe is not None and moe.enabled() and moe.moe_layer(layer):
        fe, k = moe.expert_ffn_dim(cfg), moe.top_k
        routed = k * (e * (2 * d + 2 * fe) + mask(fe, cfg.activation_dropout)) + 3 * k * d * e  # + permuted copies
        shared = e * (2 * d + 2 * f) if moe.shared_expert else 0
        return routed + shared + 4 * moe.num_experts + e * d
    return e * (2 * d + 2 * f) + mask(f, cfg.activation_dropout)


def _moce_bytes(cfg: ModelConfig, e: int) -> float:
    """Extra activations per source token of an Ada-MSHA layer (dense path): the stacked q/k/v, every conv
    expert's output, the picked top-k outputs and the mixture."""
    n_conv = sum(1 for k in cfg.conv.kernels if k > 0)
    return 3 * cfg.d_model * e * (2 + n_conv + cfg.moce.top_k)


def training_memory(cfg: ModelConfig, vocab_size: int, precision: str, moe=None,
                    n_params: int | None = None) -> tuple[float, float]:
    """(fixed bytes, bytes per padded token) of a training step; see the module docstring."""
    e = _act_bytes(precision)
    d, h, p = cfg.d_model, cfg.n_heads, cfg.dropout
    drop = d if p > 0 else 0
    attn = e * 6 * d + 4 * h + drop + e * d + 8  # q/k/v/in/out + lse, residual mask, LayerNorm input + stats
    n_enc = cfg.encoder_layers + (cfg.lobef.byte_layers if cfg.arch in ("byte_ncf", "byte_wsf") else 0)
    enc = 2 * d * e  # embeddings + positions
    for i in range(n_enc):
        enc += attn + _ffn_bytes(cfg, moe, i, i) + drop + e * d + 8
        if cfg.arch == "moce" and i in cfg.conv.layers:
            enc += _moce_bytes(cfg, e)
        elif cfg.arch in ("msc", "msha") and i in cfg.conv.layers:
            enc += 3 * d * e
    enc += cfg.decoder_layers * 2 * d * e  # cross-attention K/V of every decoder layer, per source token
    dec = 2 * d * e + vocab_size * (e + 8)  # embeddings; logits + the loss's fp32 log-softmax
    for i in range(cfg.decoder_layers):
        dec += 2 * attn - 2 * d * e + _ffn_bytes(cfg, moe, i, i) + drop + e * d + 8
    if n_params is None:
        n_params = _count(cfg, vocab_size, moe)
    per_param = 16 if precision == "fp32" else 18
    return float(n_params * per_param), ACTIVATION_MARGIN * float(max(enc, dec))


def _count(cfg: ModelConfig, vocab_size: int, moe) -> int:
    import torch

    from scaletrain.models.build import build_model

    with torch.device("meta"):
        model = build_model(cfg, vocab_size, moe=moe)
    return sum(p.numel() for p in model.parameters())


def auto_max_tokens(cfg: ModelConfig, vocab_size: int, precision: str, total_memory: int | None, moe=None,
                    min_tokens: int = 0, n_params: int | None = None) -> tuple[int, str]:
    """(budget, reason) for a device with ``total_memory`` bytes (None: a CPU, the fixed
    ``CPU_AUTO_TOKENS``). Raises ScaletrainError when not even ``min_tokens`` fit."""
    if total_memory is None:
        return max(CPU_AUTO_TOKENS, min_tokens), f"CPU: fixed {CPU_AUTO_TOKENS} tokens (step time, not memory, limits)"
    fixed, per_token = training_memory(cfg, vocab_size, precision, moe, n_params)
    usable = USABLE_FRACTION * total_memory - RESERVED_BYTES
    tokens = int((usable - fixed) // per_token) // _ROUND * _ROUND
    gib = 2.0**30
    why = (f"{total_memory / gib:.1f} GiB device, {precision}: {fixed / gib:.2f} GiB for parameters, gradients "
           f"and AdamW state, {per_token / 1024:.1f} KiB of activations per token, 75% of the memory less 1 GiB")
    if tokens < max(min_tokens, 1):
        raise ScaletrainError(
            f"data.max_tokens=auto: the model does not fit this device ({why}: room for {max(tokens, 0)} tokens, "
            f"one example needs {min_tokens}); set data.max_tokens by hand, lower data.max_bytes or the model size, "
            "or shard the optimizer state (ZeRO)")
    return tokens, why


def device_memory(device) -> int | None:
    """The total memory of a CUDA ``device`` in bytes; None for a CPU (or no device)."""
    if device is None or getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    return torch.cuda.get_device_properties(device).total_memory


def apply_max_tokens(cfg, vocab_size: int, device=None, total_memory: int | None = None) -> int:
    """Resolve ``cfg.data.max_tokens: auto`` in place (once; an int is left as it is) and return the budget.

    ``device``: the training device (its total memory is read for CUDA); ``total_memory`` injects it
    (tests). Records ``cfg.data.max_tokens_auto = "<tokens>: <reason>"``, so a checkpoint's config.yaml
    and the tracking parameters show how auto decided."""
    from scaletrain.data.example import max_example_tokens

    if cfg.data.max_tokens != "auto":
        return int(cfg.data.max_tokens)
    if total_memory is None:
        total_memory = device_memory(device)
    precision = cfg.engine.precision if cfg.engine.precision != "auto" else ("bf16" if total_memory else "fp32")
    need = max_example_tokens(cfg.data.max_bytes, cfg.data.pad_to_multiple)
    tokens, why = auto_max_tokens(cfg.model, vocab_size, precision, total_memory, cfg.moe, min_tokens=need)
    cfg.data.max_tokens, cfg.data.max_tokens_auto = tokens, f"{tokens}: {why}"
    return tokens


def reuse_max_tokens(cfg, saved: int) -> tuple[str, bool] | None:
    """A resume of a run whose checkpoint was written with ``saved`` tokens per micro-batch, after
    :func:`apply_max_tokens` resolved ``data.max_tokens: auto`` for this device: the checkpoint's budget is put in
    ``cfg`` (the data stream resumes exactly only with it) and recorded in ``data.max_tokens_auto``. Returns None
    where the two agree, else (the line to log, whether ``saved`` fits this device's estimate)."""
    estimate, saved = int(cfg.data.max_tokens), int(saved)
    if saved == estimate:
        return None
    why = cfg.data.max_tokens_auto.split(": ", 1)[-1]
    cfg.data.max_tokens = saved
    cfg.data.max_tokens_auto = f"{saved}: the resumed checkpoint's budget (this device's estimate {estimate}: {why})"
    if saved < estimate:
        return (f"data.max_tokens=auto: resuming with the checkpoint's {saved} tokens per micro-batch (this device's "
                f"estimate is {estimate}), so the data stream continues exactly", True)
    return (f"data.max_tokens=auto: the checkpoint's {saved} tokens per micro-batch exceed this device's estimate of "
            f"{estimate} ({why}); resuming with {saved}, the only budget the data stream resumes exactly with: if a "
            "step runs out of memory, set engine.activation_checkpointing=true or shard the optimizer state "
            "(engine.ds_config=zero1.json or zero2.json)", False)
