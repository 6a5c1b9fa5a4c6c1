"""Attention and dropout kernels, with faster formulations for CPU training.

Two measured problems of stock PyTorch (2.13) on CPU, both in the training step of the base model
(d 512, 6+6 layers, batch 16x128; ``benchmarks/bench_engine_throughput.py``):

- ``F.scaled_dot_product_attention`` in bf16 picks the fused flash kernel; its forward is fast but its
  backward runs about 4x slower than the plain formulation (``softmax(q k^T) v`` as two batched
  matmuls): 61 ms vs 19 ms forward+backward per call at [16, 8, 128, 64] on 2 cores. In fp32, and in
  any precision without gradients, SDPA is as fast or faster, so it stays the default there, except
  for a single query per row (incremental decoding: one new position attends to the cache), where the
  two matmuls take 0.65-0.8x the time of SDPA's flash kernel (fp32, [64, 4, 1, 64] x 8-48 keys, 1 thread),
  and for up to 8 queries without gradients (beam search: a sentence's beams attend to its encoder
  states and to their self-attention slots together, ``EncoderOut.expand_beams``), where they take 0.8x
  in the decoder (268 vs 343 us per cross-attention call at [16, 4, 4, 64] x 42 keys, 1 thread,
  benchmarks/bench_generate.py's workload).
- ``F.dropout`` draws one Bernoulli sample per element (~15 ms per 1M elements on this CPU, 13% of
  the step). Drawing 64 random bits at a time and cutting them into 16-bit lanes gives the same
  distribution (keep probability quantised to 1/32768) about 3x faster.

``model.kernels`` chooses: ``auto`` (default) uses the fast formulations where they win (CPU only;
CUDA always uses PyTorch's fused kernels) and ``torch`` always uses ``F.scaled_dot_product_attention``
and ``F.dropout``. Both draw their randomness from the default generator, so seeds and exact resume
behave the same way with either.

There is no process-wide mode: every function takes ``mode``, and each module that calls them keeps
its own in a ``kernel_mode`` attribute, set from ``model.kernels`` when the model is built
(``set_mode`` changes it for a built model). Models built with different modes coexist.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.config import KERNEL_MODES


def set_mode(model: nn.Module, mode: str) -> None:
    """Switch every module of ``model`` that calls these kernels (``kernel_mode``) to ``mode``."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernel mode {mode!r}: expected one of {', '.join(KERNEL_MODES)}")
    for m in model.modules():
        if hasattr(m, "kernel_mode"):
            m.kernel_mode = mode


_FEW_QUERIES = 8


def _use_bmm_attention(q: torch.Tensor, mode: str) -> bool:
    if mode != "auto" or q.device.type != "cpu":
        return False
    if q.size(-2) == 1:  # one query per row (incremental decoding)
        return True
    if q.size(-2) <= _FEW_QUERIES and not torch.is_grad_enabled():  # the beams of a sentence (beam search)
        return True
    return q.dtype in (torch.bfloat16, torch.float16) and torch.is_grad_enabled() and q.requires_grad


def attention(q, k, v, mask: Optional[torch.Tensor] = None, is_causal: bool = False,
              scale: Optional[float] = None, dropout_p: float = 0.0, impl: Optional[str] = None,
              mode: str = "auto") -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` over [B, H, T, Dh]; ``mask`` is bool, True = may attend.

    ``impl``: ``"sdpa"``, ``"bmm"`` or None (decide from ``mode``, i.e. ``model.kernels``, and the tensors).
    Rows whose keys are all masked (only padding queries of some variants) give a uniform average
    on the bmm path instead of NaN; real positions are identical between the two paths up to round-off.
    """
    if impl is None:
        impl = "bmm" if _use_bmm_attention(q, mode) else "sdpa"
    if impl == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale)
    if impl != "bmm":
        raise ValueError(f"attention impl {impl!r}: expected 'sdpa' or 'bmm'")
    scale = q.size(-1) ** -0.5 if scale is None else scale
    s = torch.matmul(q * scale, k.transpose(-1, -2))
    if is_causal:
        causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        mask = causal if mask is None else mask & causal
    if mask is not None:  # in place: matmul's backward does not need its output
        s.masked_fill_(~mask, torch.finfo(s.dtype).min)
    p = torch.softmax(s, dim=-1)
    if dropout_p > 0.0:
        p = dropout(p, dropout_p, True, mode)
    return torch.matmul(p, v)


_LANES = 1 << 15  # 15 uniform bits per 16-bit lane


def _lane_p(p: float) -> float:
    """The drop probability the 15-bit lanes realise: p rounded to a multiple of 1/2^15."""
    return int(round(p * _LANES)) / _LANES


def keep_mask(shape, p: float, device=None) -> torch.Tensor:
    """Bool mask, each element True with probability 1 - round(p * 2^15) / 2^15, independent.

    ``random_()`` on int64 gives 63 uniform bits per draw (the sign bit is always 0); viewed as four
    int16 lanes and masked to 15 bits, every lane is uniform on [0, 2^15).
    """
    n = 1
    for s in shape:
        n *= s
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_()
    lanes = words.view(torch.int16)[:n].bitwise_and_(_LANES - 1)
    return lanes.ge(int(_lane_p(p) * _LANES)).view(shape)


def dropout(x: torch.Tensor, p: float, training: bool, mode: str = "auto") -> torch.Tensor:
    """``F.dropout`` (inverted scaling); on CPU under mode ``auto`` with a faster mask."""
    if not training or p == 0.0:
        return x
    if mode != "auto" or x.device.type != "cpu" or p >= 1.0:
        return F.dropout(x, p, True)
    q = _lane_p(p)
    if q >= 1.0:
        return torch.zeros_like(x)
    return x * keep_mask(x.shape, p) * (1.0 / (1.0 - q))


def residual_dropout(x: torch.Tensor, y: torch.Tensor, p: float, training: bool, mode: str = "auto") -> torch.Tensor:
    """``x + dropout(y)``; on CPU under mode ``auto`` one fused ``addcmul`` with the 0/1 mask
    (the 1/(1-p) scale is applied in fp32 inside the op, so bf16 keeps it exact). Under autocast the
    residual ``x`` is fp32 and the branch ``y`` bf16: the sum is fp32 as ``x + F.dropout(y)``'s, without the
    bf16 rounding of the dropped-out branch (and without ``F.dropout``'s Bernoulli draw per element, 4.5%
    of a base bf16 step)."""
    if not training or p == 0.0:
        return x + y
    if mode != "auto" or y.device.type != "cpu" or p >= 1.0 or not (x.is_floating_point() and y.is_floating_point()):
        return x + F.dropout(y, p, True)
    q = _lane_p(p)
    if q >= 1.0:
        return x + torch.zeros_like(y)
    return torch.addcmul(x, y, keep_mask(y.shape, p).to(y.dtype), value=1.0 / (1.0 - q))


# ---------------------------------------------------------------------------------------
# which attention kernel runs
# ---------------------------------------------------------------------------------------
_SDPA_OPS = {  # the fused aten op each SDPA backend runs (the math backend runs plain matmuls: no op of its own)
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash-cpu",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
_SDP_CHOICE = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def sdpa_backend(q, k, v, mask: Optional[torch.Tensor] = None, is_causal: bool = False, dropout_p: float = 0.0,
                 scale: Optional[float] = None) -> str:
    """The backend ``F.scaled_dot_product_attention`` picks for these inputs under the current
    ``sdpa_kernel`` settings: "flash", "efficient", "cudnn", "math" or "overrideable" (PyTorch's own
    choice function; on a CPU "flash" is its CPU flash kernel, which also takes masks)."""
    choice = int(torch._fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale=scale))
    return _SDP_CHOICE.get(choice, f"backend {choice}")


class SdpaKernels:
    """Context manager recording the fused attention kernel of every SDPA forward call that runs inside
    it: ``(kernel, masked)`` per call, kernel one of "flash", "flash-cpu",
    "efficient", "cudnn", "overrideable", ``masked`` whether a mask was passed. SDPA's math fallback
    and the CPU bmm path of ``attention`` run plain matmuls and leave no entry. For the benchmarks and
    the GPU suite: ``Counter(calls)`` says which kernels a training step used."""

    def __init__(self):
        self.calls: list[tuple[str, bool]] = []
        self._mode = None

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        calls = self.calls

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = func.overloadpacket.__name__
                if name in _SDPA_OPS:
                    mask = kwargs.get("attn_mask", kwargs.get("attn_bias"))
                    if mask is None and len(args) > 3 and torch.is_tensor(args[3]):
                        mask = args[3]  # efficient / cudnn / cpu-flash take the mask (bias) positionally
                    calls.append((_SDPA_OPS[name], mask is not None))
                return func(*args, **kwargs)

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)
