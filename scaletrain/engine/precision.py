"""``engine.precision: auto``: the precision that is fast on the hardware this process runs on.

    res = resolve_precision("auto")        # Resolution(precision="bf16", reason="...")

Rules (resolved once per process, before an engine starts: see :func:`apply_precision`):

* CUDA: bf16 when the GPU supports it (``torch.cuda.is_bf16_supported()``), else fp32.
* CPU: bf16 only when the CPU has native bf16 matrix units (flag ``amx_bf16`` or ``avx512_bf16``
  in /proc/cpuinfo) AND a short GEMM probe measures bf16 faster than fp32; fp32 otherwise. On a CPU
  without them PyTorch's bf16 GEMM is a generic fallback (measured 2.5 GFLOP/s vs fp32 98 on an
  AVX2-only EPYC: a bf16 training step ~40x slower).
* ``$SCALETRAIN_AUTO_PRECISION`` (fp32|bf16|fp16), when set, is what auto resolves to without
  probing: ``launch.sh`` resolves once and exports it so every rank of a job agrees, and the test
  suite pins it to fp32 so tests run the same on every kind of CPU.

An explicit ``bf16`` on a CPU without native bf16 is kept, with a warning giving the measured slowdown.
The probe is cached per process; tests inject ``flags`` and ``probe`` instead of measuring.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger(__name__)

ENV = "SCALETRAIN_AUTO_PRECISION"
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Probe:
    """GEMM throughput of one square matmul size, GFLOP/s."""

    fp32_gflops: float
    bf16_gflops: float

    @property
    def speedup(self) -> float:
        """bf16 / fp32 throughput (> 1: bf16 is faster)."""
        return self.bf16_gflops / self.fp32_gflops

    def describe(self) -> str:
        return f"GEMM probe bf16 {self.bf16_gflops:.0f} vs fp32 {self.fp32_gflops:.0f} GFLOP/s ({self.speedup:.2f}x)"


@dataclass(frozen=True)
class Resolution:
    requested: str
    precision: str  # fp32 | bf16 | fp16
    reason: str
    warning: str = ""  # set when an explicit choice is slow on this hardware

    def line(self) -> str:
        return f"engine.precision {self.requested} -> {self.precision}: {self.reason}"


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags of the first processor (empty where /proc/cpuinfo is missing)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def native_bf16_flags(flags) -> list[str]:
    return [f for f in NATIVE_BF16_FLAGS if f in flags]


def measure_gemm(n: int = 512, budget_s: float = 0.05) -> Probe:
    """bf16 and fp32 ``n x n @ n x n`` throughput, best of interleaved repeats.

    Short by design: one warm-up and then repeats until ``budget_s`` per dtype (at least 2), so a
    CPU with the generic bf16 fallback (~2.5 GFLOP/s) spends ~0.3 s here and an AMX CPU ~20 ms.
    Interleaving and taking the best time keeps a shared host's load from deciding.
    """
    g = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    mats = {torch.float32: (a32, b32), torch.bfloat16: (a32.bfloat16(), b32.bfloat16())}
    best = {dt: float("inf") for dt in mats}
    spent = {dt: 0.0 for dt in mats}
    for a, b in mats.values():
        a @ b  # warm-up (packing, thread pool)
    reps = 0
    while reps < 2 or min(spent.values()) < budget_s:
        for dt, (a, b) in mats.items():
            t = time.perf_counter()
            a @ b
            dt_s = time.perf_counter() - t
            best[dt] = min(best[dt], dt_s)
            spent[dt] += dt_s
        reps += 1
        if reps >= 50:
            break
    flops = 2.0 * n**3
    return Probe(fp32_gflops=flops / best[torch.float32] / 1e9, bf16_gflops=flops / best[torch.bfloat16] / 1e9)


_PROBE_CACHE: dict[int, Probe] = {}


def cached_probe() -> Probe:
    """:func:`measure_gemm` once per process and thread count."""
    key = torch.get_num_threads()
    if key not in _PROBE_CACHE:
        _PROBE_CACHE[key] = measure_gemm()
    return _PROBE_CACHE[key]


def resolve_precision(
    requested: str,
    *,
    cuda: bool | None = None,
    cuda_bf16: bool | None = None,
    flags=None,
    probe: Callable[[], Probe] | None = None,
    env: dict | None = None,
) -> Resolution:
    """What ``engine.precision=requested`` means here. Every hardware fact is injectable for tests."""
    env = os.environ if env is None else env
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if requested == "auto":
        pinned = env.get(ENV, "")
        if pinned:
            if pinned not in PRECISIONS:
                from scaletrain.errors import ScaletrainError

                raise ScaletrainError(f"${ENV} must be one of {', '.join(PRECISIONS)}, got {pinned!r}")
            return Resolution("auto", pinned, f"${ENV}={pinned}")
        if cuda:
            ok = torch.cuda.is_bf16_supported() if cuda_bf16 is None else cuda_bf16
            if ok:
                return Resolution("auto", "bf16", "CUDA device supports bf16")
            return Resolution("auto", "fp32", "CUDA device without bf16 support")
        flags = cpu_flags() if flags is None else flags
        native = native_bf16_flags(flags)
        if not native:
            return Resolution("auto", "fp32", "CPU has no native bf16 matrix units (no amx_bf16/avx512_bf16 flag)")
        p = (probe or cached_probe)()
        if p.speedup > 1.0:
            return Resolution("auto", "bf16", f"CPU flags {'+'.join(native)}; {p.describe()}")
        return Resolution("auto", "fp32", f"CPU flags {'+'.join(native)} but {p.describe()}: bf16 not faster")
    if requested == "bf16" and not cuda:
        flags = cpu_flags() if flags is None else flags
        native = native_bf16_flags(flags)
        p = (probe or cached_probe)()
        if not native or p.speedup <= 1.0:
            why = "no native bf16 matrix units (no amx_bf16/avx512_bf16 flag)" if not native else "bf16 not faster"
            warning = (f"engine.precision=bf16 on a CPU with {why}: {p.describe()}, bf16 matmuls ~"
                       f"{1 / p.speedup:.1f}x slower than fp32; engine.precision=auto would pick fp32")
            return Resolution("bf16", "bf16", "explicit", warning=warning)
    return Resolution(requested, requested, "explicit")


def apply_precision(cfg, **hw) -> Resolution:
    """Resolve ``cfg.engine.precision`` in place (once: a resolved config is left as it is) and log it.

    ``cfg.engine.precision`` becomes the precision that runs and ``cfg.engine.precision_auto`` keeps
    how auto decided, so checkpoints' config.yaml and the MLflow parameters record both.
    """
    if cfg.engine.precision_auto:  # resolved earlier in this process (or a saved resolved config)
        return Resolution("auto", cfg.engine.precision, cfg.engine.precision_auto)
    res = resolve_precision(cfg.engine.precision, **hw)
    main = os.environ.get("RANK", "0") == "0"
    if cfg.engine.precision == "auto":
        cfg.engine.precision = res.precision
        cfg.engine.precision_auto = f"{res.precision}: {res.reason}"
        if main:
            log.info("%s", res.line())
    if res.warning and main:
        log.warning("%s", res.warning)
    return res
