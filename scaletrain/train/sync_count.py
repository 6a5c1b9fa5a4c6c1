"""Count host synchronisations per training step from a ``torch.profiler`` trace.

The trainer wraps each iteration of its loop (fetching the batches, the step, the components after it)
in ``torch.profiler.record_function("scaletrain.step#N")`` (:func:`step_range`; N = the update number
the iteration produces). A host read of a device value runs ``aten::_local_scalar_dense`` (``.item()``,
``float(t)``, ``bool(t)``, ``if t:``), which on a GPU waits for every kernel queued before it: the
GPU then idles while the host catches up. :func:`host_reads_per_step` attributes those operators to
the step ranges they ran in, leaving out the ones inside torch's own optimizer ``step`` (ranges
``Optimizer.step#<torch optimizer>.step``), which are the optimizer's business.

On CUDA the trace also holds the runtime's ``cudaStreamSynchronize``/``cudaDeviceSynchronize``/
``cudaEventSynchronize`` calls (a blocking copy to the host runs one), counted too. On CPU the profiler
sees every ``.item()``-style read but not ``.cpu()``/``.tolist()`` of a tensor (no operator runs): while a
:class:`StepWatch` is active those calls are counted per update by wrapping the two methods, and on CUDA
the synchronising calls ``torch.cuda.set_sync_debug_mode("warn")`` reports are counted per update.

Written here rather than taken from a library: the profiler gives the events, the attribution to our
steps is ours.
"""
from __future__ import annotations

import contextlib
import re
import warnings
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


def host_reads_per_step(events) -> Counter:
    """{update number: host synchronisations} over ``events`` (``prof.events()``): host reads, and on CUDA
    the stream/device/event synchronisations (one inside a host read is that read, counted once). Those
    outside any step range are counted under step 0; those inside torch's own optimizer step are left out."""
    out: Counter = Counter()
    for ev in events:
        if ev.name not in READ_OPS and ev.name not in CUDA_SYNCS:
            continue
        step, in_opt, in_read = 0, False, False
        for a in _ancestors(ev):
            m = _OPT_RANGE.match(a.name)
            in_opt = in_opt or bool(m and m.group(1) in TORCH_OPTIMIZERS)
            in_read = in_read or a.name in READ_OPS
            if a.name.startswith(STEP_PREFIX):
                step = int(a.name[len(STEP_PREFIX):])
                break
        if not in_opt and not (ev.name in CUDA_SYNCS and in_read):
            out[step] += 1
    return out


def host_syncs(events) -> int:
    """All of :func:`host_reads_per_step`, step ranges or not."""
    return sum(host_reads_per_step(events).values())


def steps_seen(events) -> list[int]:
    """The update numbers whose step ranges the trace holds."""
    return sorted({int(e.name[len(STEP_PREFIX):]) for e in events if e.name.startswith(STEP_PREFIX)})


@contextlib.contextmanager
def profiled():
    """A profiler around the block (CPU, and CUDA where there is one); yields the profile (``.events()``)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        yield prof


class StepWatch:
    """Per update, while active (``with StepWatch(scaletrain.train.trainer) as w: trainer.fit()``; the module
    whose ``step_range`` the loop calls): ``w.copies`` counts the calls of
    ``Tensor.tolist``/``Tensor.cpu`` (host tensors are read with ``.numpy()``, which a device tensor refuses),
    ``w.sync_warnings`` the synchronising CUDA calls ``torch.cuda.set_sync_debug_mode("warn")`` reports (on
    CUDA). The update is the one whose loop iteration runs (the trainer's :func:`step_range`, wrapped here);
    calls outside the loop count under 0."""

    def __init__(self, loop_module):
        self.loop_module = loop_module
        self.copies: Counter = Counter()
        self.sync_warnings: Counter = Counter()
        self._step = 0
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "StepWatch":
        trainer_mod = self.loop_module
        real_range, caught = trainer_mod.step_range, None
        if torch.cuda.is_available():
            caught = self._stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            self._stack.callback(torch.cuda.set_sync_debug_mode, 0)

        @contextlib.contextmanager
        def watched_range(step):
            before, self._step = len(caught or ()), step
            try:
                with real_range(step):
                    yield
            finally:
                self.sync_warnings[step] += sum("synchroniz" in str(w.message).lower() for w in (caught or ())[before:])
                self._step = 0

        self._patch(trainer_mod, "step_range", watched_range)
        for name in ("tolist", "cpu"):
            def counted(t, *a, _real=getattr(torch.Tensor, name), **k):
                self.copies[self._step] += 1
                return _real(t, *a, **k)
            self._patch(torch.Tensor, name, counted)
        return self

    def _patch(self, owner, name, value) -> None:
        old = getattr(owner, name)
        setattr(owner, name, value)
        self._stack.callback(setattr, owner, name, old)

    def __exit__(self, *exc) -> None:
        self._stack.close()
