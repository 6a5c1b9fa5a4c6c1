"""The next step's batches, read and moved to the device while the current step computes.

The loop takes a step's micro-batches (:meth:`Prefetcher.take`), launches the step (the GPU works through
it asynchronously) and then calls :meth:`Prefetcher.fetch`: the next step's batches are read from the
stream on the host meanwhile and copied to the device. On CUDA the copy is from pinned host memory, with
``non_blocking=True``, on a side stream, so it overlaps the step's kernels; the compute stream waits for it
only when the batches are taken (``wait_stream``, on the device, not the host). On CPU there is nothing to
move: :class:`HostCopy` (the CPU twin) hands the batches on as they are, through the same bookkeeping.

Exact resume: reading ahead moves the stream past batches that no update has used yet, so the position a
checkpoint stores is :meth:`Prefetcher.resume_position` (before the first batches not yet trained on), not
the stream's. Each taken step keeps its host batches (for the NaN/inf dumps) and the stream position before
them. Written here: DataLoader's ``pin_memory`` pins in its own thread but does not copy to the device, and
the checkpoint position is ours to keep.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch


@dataclass
class Fetched:
    micro: list  # the step's micro-batches, on the device (once the copy is waited for)
    host: list  # the same batches in host memory (NaN/inf dumps)
    position: Any  # the stream's state before these batches
    wait: float  # seconds the host spent reading them from the stream


def _map_tensors(batch, fn):
    """``batch`` with ``fn`` applied to each tensor field (a dataclass such as ``Batch``), else ``batch.to``."""
    if dataclasses.is_dataclass(batch):
        return dataclasses.replace(batch, **{f.name: fn(getattr(batch, f.name)) for f in dataclasses.fields(batch)
                                             if torch.is_tensor(getattr(batch, f.name))})
    return fn(batch)


class HostCopy:
    """CPU (and the CPU twin of :class:`CudaCopy`): the batches are already where the step runs."""

    def __init__(self, device: torch.device):
        self.device = device

    def start(self, host: list) -> list:
        return [b.to(self.device) for b in host]

    def ready(self, micro: list) -> list:
        return micro


class CudaCopy:
    """Pinned host memory, non-blocking copies on a side stream; the compute stream waits on the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def start(self, host: list) -> list:
        pinned = [_map_tensors(b, lambda t: t.pin_memory()) for b in host]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # memory the copies reuse is free
        with torch.cuda.stream(self.stream):
            return [_map_tensors(b, lambda t: t.to(self.device, non_blocking=True)) for b in pinned]

    def ready(self, micro: list) -> list:
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        for b in micro:  # the caching allocator must not reuse these before the compute stream is done
            _map_tensors(b, lambda t: (t.record_stream(current), t)[1])
        return micro


def copier(device: torch.device):
    return CudaCopy(device) if device.type == "cuda" else HostCopy(device)


class Prefetcher:
    """``n`` micro-batches per step from ``stream`` (its iterator ``batches``), one step ahead."""

    def __init__(self, stream, batches: Iterator, n: int, device: torch.device, copy=None):
        self.stream, self.batches, self.n = stream, batches, n
        self.copy = copy if copy is not None else copier(device)
        self._next: Fetched | None = None

    def fetch(self) -> None:
        """Read the next step's batches and start moving them (no-op when one is already fetched)."""
        if self._next is not None:
            return
        t = time.perf_counter()
        position = self.stream.state_dict()
        host = [next(self.batches) for _ in range(self.n)]
        wait = time.perf_counter() - t
        self._next = Fetched(self.copy.start(host), host, position, wait)

    def take(self) -> Fetched:
        """The next step's batches, ready on the device (read now if :meth:`fetch` was not called)."""
        self.fetch()
        got, self._next = self._next, None
        got.micro = self.copy.ready(got.micro)
        return got

    def close(self) -> None:
        """Stop reading: the stream's iterator is closed, so DataLoader workers exit now, not whenever the
        iterator is garbage-collected (a job that failed mid-fit kept them until then)."""
        self._next = None
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()

    def resume_position(self):
        """The stream position a checkpoint stores: before the first batches no update has used."""
        return self._next.position if self._next is not None else self.stream.state_dict()
