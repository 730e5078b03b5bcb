"""A guard that fails on anything inside the executor's hot path that would make the host wait
for a CUDA device, checked on the CPU: what `torch.cuda.set_sync_debug_mode("error")` would
catch on a GPU, and the host-made tensors that would become blocking copies there.

Inside `no_host_sync()`, on this thread:
- a device value read by the host: `.item()`, `.tolist()`, `.numpy()`, `.cpu()`, `bool(t)`,
  `int(t)`, `float(t)` (each `aten._local_scalar_dense` too);
- an op whose output size depends on the values (`nonzero`, boolean-mask indexing,
  `masked_select`, `unique`, `repeat_interleave` without its output size): on CUDA it waits
  for the data;
- a tensor made from host data (`torch.tensor`, `torch.from_numpy`, `t[idx] = 0` which
  wraps its 0 in a host tensor): on CUDA, a copy from pageable memory;
- a factory call without an explicit device (`torch.arange(n)`): on CUDA it makes a host
  tensor;
- a copy into or out of the given host buffers without `non_blocking=True`.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostSync(AssertionError):
    """The hot path did something that makes the host wait for the device."""


_HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu,
               torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
               torch.Tensor.__index__}
_FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.empty, torch.full, torch.rand,
              torch.randn, torch.randint, torch.eye, torch.linspace, torch.tensor,
              torch.as_tensor}
_DATA_DEPENDENT = {aten._local_scalar_dense.default, aten.nonzero.default,
                   aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
                   aten.unique_consecutive.default, aten.repeat_interleave.Tensor,
                   aten.equal.default, aten.is_nonzero.default}
_COPIES = {aten.copy_.default, aten._to_copy.default}


def _where() -> str:
    """The innermost frame of this project's code (not torch's, not this file's)."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and not frame.filename.endswith("sync_guard.py"):
            return f"{frame.filename}:{frame.lineno} ({frame.line})"
    return "?"


def _tensors(args: Any) -> Iterator[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, list | tuple):
            yield from _tensors(a)


class _FunctionGuard(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise HostSync(f"{func.__name__} reads a device value on the host at {_where()}")
        if func in _FACTORIES and kwargs.get("device") is None:
            raise HostSync(f"torch.{func.__name__} without a device makes a host tensor at "
                           f"{_where()}")
        return func(*args, **kwargs)


class _DispatchGuard(TorchDispatchMode):
    def __init__(self, host_buffers: list[torch.Tensor]) -> None:
        super().__init__()
        self.host = {t.untyped_storage().data_ptr() for t in host_buffers}

    def _is_host(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.host

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func in _DATA_DEPENDENT:
            raise HostSync(f"{func} waits for the device's data at {_where()}")
        if func is aten.lift_fresh.default:
            raise HostSync(f"a tensor made from host data at {_where()}")
        if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
            if any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1])):
                raise HostSync(f"boolean-mask indexing ({func}) waits for the device at "
                               f"{_where()}")
        if func in _COPIES and any(self._is_host(t) for t in _tensors(args)):
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if blocking:
                raise HostSync(f"a blocking copy to or from host memory at {_where()}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_sync(host_buffers: list[torch.Tensor] | None = None) -> Iterator[None]:
    """Raise HostSync at the first thing in the block that would wait for a CUDA device."""
    with _FunctionGuard(), _DispatchGuard(host_buffers or []):
        yield
