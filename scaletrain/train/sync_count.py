"""Count host synchronisations per training step from a ``torch.profiler`` trace.

The trainer wraps each iteration of its loop (fetching the batches, the step, the components after it)
in ``torch.profiler.record_function("scaletrain.step#N")`` (:func:`step_range`; N = the update number
the iteration produces). A host read of a device value runs ``aten::_local_scalar_dense`` (``.item()``,
``float(t)``, ``bool(t)``, ``if t:``), which on a GPU waits for every kernel queued before it: the
GPU then idles while the host catches up. :func:`host_reads_per_step` attributes those operators to
the step ranges they ran in, leaving out the ones inside torch's own optimizer ``step`` (ranges
``Optimizer.step#<torch optimizer>.step``), which are the optimizer's business.

On CPU this sees every ``.item()``-style read but not ``.cpu()``/``.tolist()``/``.numpy()`` of a
tensor (a no-op there); ``benchmarks/bench_gpu_step.py`` checks those on a GPU with
``torch.cuda.set_sync_debug_mode``.

Written here rather than taken from a library: the profiler gives the events, the attribution to our
steps is ours.
"""
from __future__ import annotations

import contextlib
import re
from collections import Counter

import torch

STEP_PREFIX = "scaletrain.step#"
READ_OPS = ("aten::_local_scalar_dense",)  # the operator every host read of a device scalar runs
# CUDA runtime calls that block the host until the GPU is done (a blocking copy to the host runs one too)
CUDA_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
TORCH_OPTIMIZERS = ("Adam", "AdamW", "SGD")  # Optimizer.step#<name>.step ranges left out
_OPT_RANGE = re.compile(r"^Optimizer\.step#(\w+)\.step$")


def step_range(step: int):
    """The profiler range of the loop iteration that produces update ``step`` (cheap when not profiling)."""
    return torch.profiler.record_function(f"{STEP_PREFIX}{step}")


def _ancestors(ev):
    p = ev.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


def host_reads_per_step(events, ops=READ_OPS) -> Counter:
    """{update number: host reads} over ``events`` (``prof.events()``); reads outside any step range are
    counted under step 0, reads inside torch's own optimizer step are left out."""
    out: Counter = Counter()
    for ev in events:
        if ev.name not in ops:
            continue
        step, in_opt = 0, False
        for a in _ancestors(ev):
            m = _OPT_RANGE.match(a.name)
            if m and m.group(1) in TORCH_OPTIMIZERS:
                in_opt = True
                break
            if a.name.startswith(STEP_PREFIX):
                step = int(a.name[len(STEP_PREFIX):])
                break
        if not in_opt:
            out[step] += 1
    return out


def host_syncs(events) -> int:
    """Host reads and CUDA synchronisations in ``events`` outside torch's own optimizer step, each counted
    once (a CUDA synchronisation inside a host read is that read)."""
    n = 0
    for ev in events:
        if ev.name not in READ_OPS and ev.name not in CUDA_SYNCS:
            continue
        outer = [a.name for a in _ancestors(ev)]
        in_opt = any((m := _OPT_RANGE.match(a)) and m.group(1) in TORCH_OPTIMIZERS for a in outer)
        if not in_opt and not (ev.name in CUDA_SYNCS and any(a in READ_OPS for a in outer)):
            n += 1
    return n


def steps_seen(events) -> list[int]:
    """The update numbers whose step ranges the trace holds."""
    return sorted({int(e.name[len(STEP_PREFIX):]) for e in events if e.name.startswith(STEP_PREFIX)})


@contextlib.contextmanager
def profiled():
    """A CPU profiler around the block; yields the profile (``.events()`` after the block)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield prof
