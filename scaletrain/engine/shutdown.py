"""The end of a training process: every thread, process group and pending collective is finished, in
order, while the interpreter is still whole.

Why this exists: torch's gloo backend runs each collective on a worker thread (``pt_gloo_runloop``) that
drops its reference to the finished work object *after* the caller has moved on. Where that is the last
reference to tensors Python made, dropping it takes the GIL; if the interpreter has begun finalizing by
then, CPython ends the thread (``pthread_exit``) inside a C++ frame that must not unwind, and a job that
trained, saved and printed its summary dies with ``terminate called without an active exception``
(SIGABRT; the launcher exits non-zero). About 1 run in 8 of a 2-rank CPU job ended so; the core dump:
``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` -> ``TensorImpl::decref_pyobject`` ->
``take_gil`` -> ``PyThread_exit_thread`` -> ``std::terminate``. A group's threads are joined only when
the group is destructed, i.e. when nothing references it any more; ``destroy_process_group`` drops
torch's own references, but DeepSpeed's communication backend and group caches and the engines' objects
(the DDP wrapper, the DeepSpeed engine, the host group) keep theirs, and ``torch.distributed.nn``, which
DDP imports after the group is up, holds it as the default argument of ten functions.

:func:`finish_distributed` is the one shutdown path (``scaletrain train`` runs training inside
:func:`finishing_distributed`, which calls it when training returns and when it raises, on both engines and
under every launcher):

1. our own threads (``scaletrain-*``: the MLflow senders, the system-metrics sampler, the launcher watch;
   by then told to stop) are joined;
2. a barrier: no rank tears down a group a peer still has a collective in flight on;
3. every process group is destroyed (torch shuts them down newest first, the default group last), DeepSpeed's
   cached backend and groups are dropped, functions that captured a group as a default argument forget
   it, and a garbage collection frees the cycles that still hold a group, so the groups' destructors join
   their worker threads now, with the GIL free for them.

After a failure (the block raised) steps 1 and 2 are skipped (our threads may be stuck on what failed, a
peer may never reach a barrier) and the exception's frames are cleared first, so the objects they hold
(the trainer, its engine) can be freed. Step 3 runs within a bound (``timeout``; ``FAILED_WAIT`` after a
failure): a group whose worker is blocked on a hung peer cannot be joined (gloo cannot interrupt it before
``engine.collective_timeout_minutes``), and the process then exits without waiting for it, with one
warning line, instead of hanging.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import sys
import threading
import time
import traceback
import types

log = logging.getLogger("scaletrain")

OUR_THREADS = "scaletrain-"  # the name prefix of every thread scaletrain starts
FAILED_WAIT = 3.0  # seconds a failed rank gives its groups to shut down before it exits anyway


def release_process_groups() -> None:
    """Destroy every process group and drop every reference this process keeps to one (torch's maps,
    DeepSpeed's communication backend and group caches), then collect garbage so the groups' destructors
    run (and join their threads) now. Safe without a process group, and to call again."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # all groups: torch shuts them down newest first, the default last
    _forget_default_arguments()
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None:
        ds_comm.cdb = None  # DeepSpeed's backend object holds the world group
    groups = sys.modules.get("deepspeed.utils.groups")
    for name, value in list(vars(groups).items()) if groups is not None else ():
        if name.startswith("_") and (name.endswith("_GROUP") or name.endswith("_GROUP_RANKS")):
            if isinstance(value, dict):
                value.clear()
            else:
                setattr(groups, name, None)
    gc.collect()


def _forget_default_arguments() -> None:
    """Functions defined while a group existed may hold it as a default argument: ``torch.distributed.nn``
    declares ``group=group.WORLD`` ten times, and DDP imports it lazily, after the group is up. Reset
    such defaults of every loaded module's functions (and its classes' methods) to None (the default
    group, which is what they meant)."""
    from torch._C._distributed_c10d import ProcessGroup

    def fix(fn) -> None:
        if type(fn) in (staticmethod, classmethod):
            fn = fn.__func__
        if type(fn) is not types.FunctionType:  # type(), not isinstance(): no deprecated object's warning
            return
        if fn.__defaults__ and any(issubclass(type(d), ProcessGroup) for d in fn.__defaults__):
            fn.__defaults__ = tuple(None if issubclass(type(d), ProcessGroup) else d for d in fn.__defaults__)
        kw = fn.__kwdefaults__ or {}
        kw.update({k: None for k, v in kw.items() if issubclass(type(v), ProcessGroup)})

    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            if issubclass(type(value), type):
                for attr in list(vars(value).values()):
                    fix(attr)
            else:
                fix(value)


def _join_our_threads(deadline: float) -> list[str]:
    """Join the threads scaletrain started (told to stop before this); the names of those still running at
    ``deadline``."""
    late = []
    for t in threading.enumerate():
        if t is threading.current_thread() or not t.name.startswith(OUR_THREADS):
            continue
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            late.append(t.name)
    return late


def _clear_frames(exc: BaseException | None) -> None:
    """Free the locals of the frames a failed run's traceback holds (the trainer, its engine, their
    groups), keeping the traceback's text; chained exceptions too."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def finish_distributed(clean: bool, timeout: float = 30.0) -> None:
    """The last thing a training process does with torch.distributed (see the module docstring).
    ``clean``: every rank got here the same way (training returned, or was preempted): our threads are
    joined and a barrier is safe. False after an exception: neither (our threads may be stuck on what
    failed, a peer may never arrive); the exception being handled, if any, has its frames cleared, and the
    groups get at most ``FAILED_WAIT`` seconds."""
    deadline = time.monotonic() + (timeout if clean else min(timeout, FAILED_WAIT))
    late = _join_our_threads(deadline) if clean else []
    if late:
        log.warning("exit: thread(s) %s still running after %.0f s; exiting without them", ", ".join(late), timeout)
    dist = sys.modules.get("torch.distributed")  # never imported: nothing distributed to finish
    if dist is None or not dist.is_available():
        return
    if clean and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if not clean:
        _clear_frames(sys.exc_info()[1])
    worker = threading.Thread(target=release_process_groups, name=f"{OUR_THREADS}shutdown", daemon=True)
    worker.start()
    worker.join(max(1.0, deadline - time.monotonic()))
    if worker.is_alive():
        log.warning("exit: the process groups did not shut down in time (a peer is still in a collective); "
                    "exiting without waiting for them")


@contextlib.contextmanager
def finishing_distributed(timeout: float = 30.0):
    """``with finishing_distributed(): <train>``: :func:`finish_distributed` after the block, clean when it
    returned, not clean when it raised (the exception then goes on)."""
    try:
        yield
    except BaseException:
        finish_distributed(clean=False, timeout=timeout)
        raise
    finish_distributed(clean=True, timeout=timeout)
