"""Count the operations of a forward/backward that read device data on the host, on any device.

On an accelerator such a read is a device sync: the host waits until the queue has drained, so the
next kernels launch late, and a CUDA graph cannot contain it. ``torch.cuda.set_sync_debug_mode``
reports them on CUDA only; this counter sees the same operations on the CPU too, so tests can hold
the models to "no host read per dense layer, at most one per routed layer" without a GPU.

Counted (``HostReads.events`` names each one):

- ``aten._local_scalar_dense``: ``item()``, ``int(t)``, ``float(t)``, ``bool(t)``, a tensor in an ``if``;
- ops whose output *shape* depends on the data (``torch.Tag.dynamic_output_shape``: ``nonzero``,
  ``masked_select``, ``unique``, ``bincount``, ...), except ``repeat_interleave`` given its
  ``output_size``;
- indexing or index assignment with a boolean mask (a ``nonzero`` inside);
- copies from a non-CPU device to the CPU;
- ``Tensor.tolist()`` (no aten op: the method is wrapped while the counter is active).

    with HostReads() as reads:
        loss = model(src, tgt_in).sum(); loss.backward()
    reads.count, reads.events

A ``TorchDispatchMode`` written here because PyTorch has no device-independent sync counter; the
autograd engine carries the mode into the backward, so backward reads are counted as well.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR = torch.ops.aten._local_scalar_dense.default
_REPEAT = torch.ops.aten.repeat_interleave.Tensor
_BOOL_INDEX = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
               torch.ops.aten._index_put_impl_.default)
_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _to_host(func, args, kwargs) -> bool:
    if func is torch.ops.aten._to_copy.default:
        dev = kwargs.get("device")
        return dev is not None and torch.device(dev).type == "cpu" and args[0].device.type != "cpu"
    dst, src = args[0], args[1]
    return torch.is_tensor(src) and dst.device.type == "cpu" and src.device.type != "cpu"


class HostReads(TorchDispatchMode):
    """Context manager counting host reads of device data (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.events: list[str] = []
        self._tolist = None

    @property
    def count(self) -> int:
        return len(self.events)

    def _is_read(self, func, args, kwargs) -> bool:
        if func is _SCALAR:
            return True
        if func is _REPEAT:
            return kwargs.get("output_size") is None
        if func in _BOOL_INDEX:
            return _bool_index(args)
        if func in _COPIES:
            return _to_host(func, args, kwargs)
        return torch.Tag.dynamic_output_shape in func.tags

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._is_read(func, args, kwargs):
            self.events.append(str(func.overloadpacket.__name__) if func is not _SCALAR else "item")
        return func(*args, **kwargs)

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        original, events = self._tolist, self.events

        def tolist(t, *a, **kw):
            events.append("tolist")
            return original(t, *a, **kw)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)
