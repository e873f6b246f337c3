"""A stand-in CUDA device on the CPU that keeps CUDA's rules: the GPU path checked where CI runs.

Inside ``with CudaRules() as rules:`` a tensor made on ``torch.device("cuda")`` is a CPU tensor marked
as on the device (``device == cuda:0``, ``is_cuda``; the CPU's values, so results compare), and every
torch call is checked (a :class:`~torch.overrides.TorchFunctionMode`). Raised as :class:`CudaRuleError`:

* **mixed devices**: an op over device and host tensors (a 0-dim host operand is allowed, as in CUDA;
  a host index or a Python list indexing a device tensor is not: CUDA copies it, blocking);
* **a blocking host-to-device copy**: ``.to(cuda)``, ``.cuda()``, ``copy_`` without ``non_blocking`` or
  from pageable memory, ``torch.tensor(data, device=cuda)``;
* **a read of the device on the host**: ``.item()``, ``.tolist()``, ``bool()``/``int()``/``float()``,
  ``.numpy()``, ``.cpu()``, a ``copy_`` into a host tensor, ``nonzero``, ``unique``, ``equal``,
  ``masked_select``, a boolean-mask index, ``repeat_interleave`` without ``output_size``, printing;
  counted instead within ``rules.host_reads_allowed()`` (a documented exception: CacheBlend's check layer).

Counted (:class:`Traffic`, under ``rules.layer``): host-to-device copies and bytes, pinned allocations,
device reads, host waits on the stand-in ``torch.cuda.Event`` (always behind, so every wait a real
device could need is taken). :func:`device_kernel` (FlashInfer's call, modelled in torch) runs
unchecked, as a kernel on the device. Not modelled: streams, memory limits, kernels' launch rules.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

__all__ = ["CudaRules", "CudaRuleError", "Traffic", "device_kernel"]

CUDA = torch.device("cuda", 0)


class CudaRuleError(RuntimeError):
    """What CUDA would refuse, or a host sync, in code run under :class:`CudaRules`."""


class _DeviceTensor(torch.Tensor):
    """A marker: no behaviour of its own."""

    __torch_function__ = torch._C._disabled_torch_function_impl


@dataclasses.dataclass
class Traffic:
    """Host/device traffic under :class:`CudaRules`, keyed by layer (None: outside layers)."""

    h2d_copies: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    h2d_bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    pinned_allocations: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    device_reads: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    host_waits: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def in_layers(self, counter: str) -> int:
        """The counter's total inside layers (every key but None)."""
        return sum(n for layer, n in getattr(self, counter).items() if layer is not None)


_SYNC_METHODS = frozenset({
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy", "nonzero", "argwhere",
    "unique", "unique_consecutive", "equal", "allclose", "masked_select", "__repr__", "__str__", "__format__",
    "__array__", "__contains__", "bincount", "_unique", "_unique2",
})
_INDEXING = frozenset({"__getitem__", "__setitem__", "index_put_", "index_put"})


def _active() -> Optional["CudaRules"]:
    """The innermost :class:`CudaRules` in force (torch's stack of function modes), or None."""
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, CudaRules):
            return mode
    return None


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _is_device(x: torch.Tensor) -> bool:
    return isinstance(x, _DeviceTensor)


def _mark(x: Any) -> Any:
    """Every tensor in x as a device tensor."""
    if isinstance(x, torch.Tensor):
        return x if _is_device(x) else x.as_subclass(_DeviceTensor)
    if isinstance(x, (list, tuple)):
        items = [_mark(y) for y in x]
        if type(x) in (list, tuple):
            return type(x)(items)
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)  # namedtuple; Size, torch.return_types
    return x


def _plain(x: Any) -> Any:
    """Every tensor in x as a plain CPU tensor (sharing its values)."""
    if isinstance(x, torch.Tensor):
        return x.as_subclass(torch.Tensor) if _is_device(x) else x
    if type(x) in (list, tuple):
        return type(x)(_plain(y) for y in x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _is_cuda_device(d: Any) -> bool:
    if isinstance(d, torch.Tensor) or d is None:
        return False
    try:
        return torch.device(d).type == "cuda"
    except (RuntimeError, TypeError):
        return False


class _Event:
    """Always behind: every ``synchronize`` a real run might need is taken, and counted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        rules = _active()
        if rules is not None:
            rules.traffic.host_waits[rules.layer] += 1


class CudaRules(TorchFunctionMode):
    """The stand-in device and its rules (module doc); ``layer``: set by the caller, counts go under it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer: Optional[int] = None
        self.traffic = Traffic()
        self._pinned: list[torch.Tensor] = []  # kept alive: their storages stay pinned
        self._pinned_ptrs: set[int] = set()
        self._reads_allowed = 0
        self._patch = contextlib.ExitStack()

    # --- context ------------------------------------------------------------------------------

    def __enter__(self) -> "CudaRules":
        self._patch.enter_context(_patched(torch.cuda, "Event", _Event))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._patch.close()

    @contextlib.contextmanager
    def host_reads_allowed(self) -> Iterator[None]:
        """Device reads inside are counted (``traffic.device_reads``), not raised."""
        self._reads_allowed += 1
        try:
            yield
        finally:
            self._reads_allowed -= 1

    # --- setup and results (uncounted) ---------------------------------------------------------

    @staticmethod
    def put(x: torch.Tensor) -> torch.Tensor:
        """A copy of host tensor x on the stand-in device, uncounted (a test's setup)."""
        with torch._C.DisableTorchFunction():
            return x.detach().clone().as_subclass(_DeviceTensor)

    @staticmethod
    def take(x: torch.Tensor) -> torch.Tensor:
        """A host copy of x, uncounted (a test reading its results)."""
        with torch._C.DisableTorchFunction():
            return x.as_subclass(torch.Tensor).clone()

    # --- the rules -----------------------------------------------------------------------------

    def _refuse(self, what: str) -> None:
        raise CudaRuleError(f"cuda rules: {what}")

    def _read(self, what: str) -> None:
        if self._reads_allowed:
            self.traffic.device_reads[self.layer] += 1
            return
        self._refuse(f"{what} reads the device on the host (a host sync)")

    def _h2d(self, src: torch.Tensor, non_blocking: bool, what: str) -> None:
        if not non_blocking:
            self._refuse(f"{what}: a blocking host-to-device copy (a host sync)")
        if not self._pinned_storage(src):
            self._refuse(f"{what}: a host-to-device copy from pageable memory (staged synchronously)")
        self.traffic.h2d_copies[self.layer] += 1
        self.traffic.h2d_bytes[self.layer] += src.numel() * src.element_size()

    def _pinned_storage(self, x: torch.Tensor) -> bool:
        return x.untyped_storage().data_ptr() in self._pinned_ptrs

    def _pin(self, x: torch.Tensor) -> torch.Tensor:
        self.traffic.pinned_allocations[self.layer] += 1
        self._pinned.append(x)
        self._pinned_ptrs.add(x.untyped_storage().data_ptr())
        return x

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        owner = getattr(func, "__self__", None)
        if owner is torch._C.TensorBase.device:
            return CUDA if _is_device(args[0]) else torch.device("cpu")
        if owner is torch._C.TensorBase.is_cuda:
            return _is_device(args[0])
        if owner is torch._C.TensorBase.is_cpu:
            return not _is_device(args[0])
        name = getattr(func, "__name__", "")
        tensors = list(_tensors(args)) + list(_tensors(kwargs))
        on_device = [t for t in tensors if _is_device(t)]
        if name in ("to", "cuda", "cpu", "copy_", "pin_memory", "is_pinned", "tensor", "as_tensor", "new_tensor"):
            handled = self._movement(name, func, args, kwargs, bool(on_device))
            if handled is not NotImplemented:
                return handled
        if on_device:
            self._check_device_call(name, func, args, kwargs, tensors)
        device_out = bool(on_device)
        if "device" in kwargs:
            if _is_cuda_device(kwargs["device"]):
                kwargs["device"], device_out = "cpu", True
            elif kwargs["device"] is not None:
                device_out = False
        pin = bool(kwargs.pop("pin_memory", False))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if pin:
            self._pin(out)
        return _mark(out) if device_out else out

    def _check_device_call(self, name: str, func: Callable, args: tuple, kwargs: dict,
                           tensors: list[torch.Tensor]) -> None:
        if name in _SYNC_METHODS:
            self._read(f"{name}() of a device tensor")
            return
        host = [t for t in tensors if not _is_device(t)]
        if name in _INDEXING:
            index = args[1] if len(args) > 1 else None
            for t in _tensors(index):
                if not _is_device(t):
                    self._refuse(f"{name}: a device tensor indexed by a host tensor (copied over, blocking)")
                if t.dtype == torch.bool:
                    self._read(f"{name} with a boolean mask")
            if isinstance(index, list) or isinstance(index, tuple) and any(isinstance(i, list) for i in index):
                self._refuse(f"{name}: a device tensor indexed by a Python list (copied over, blocking)")
            host = [t for t in host if t.dim() > 0 and t is not index and not any(t is i for i in _tensors(index))]
        if name == "repeat_interleave" and kwargs.get("output_size") is None and (
                len(args) < 4 or args[3] is None) and any(isinstance(a, torch.Tensor) for a in args[1:2]):
            self._read("repeat_interleave without output_size")
        if name == "where" and len(args) + len(kwargs) == 1:
            self._read("where(condition)")
        if any(t.dim() > 0 for t in host):
            self._refuse(f"{name}: device and host tensors in one op "
                         f"({', '.join(str(tuple(t.shape)) for t in host if t.dim() > 0)} on the host)")

    def _movement(self, name: str, func: Callable, args: tuple, kwargs: dict, any_device: bool) -> Any:
        """Copies between host and device (NotImplemented: an ordinary call)."""
        if name == "pin_memory":
            src = args[0]
            if _is_device(src):
                self._refuse("pin_memory() of a device tensor")
            with torch._C.DisableTorchFunction():
                return self._pin(src.clone())
        if name == "is_pinned":
            return not _is_device(args[0]) and self._pinned_storage(args[0])
        if name in ("tensor", "as_tensor") and _is_cuda_device(kwargs.get("device")):
            data = args[0] if args else kwargs.get("data")
            if isinstance(data, torch.Tensor):
                if _is_device(data):
                    return NotImplemented
                return self._to(data, kwargs.get("dtype"), False, f"torch.{name}")
            self._refuse(f"torch.{name}(data, device=cuda): a blocking copy from pageable memory")
        if name == "new_tensor" and _is_device(args[0]):
            self._refuse("new_tensor on a device tensor: a blocking copy from pageable memory")
        if name == "cpu":
            if _is_device(args[0]):
                self._read(".cpu()")
                return self.take(args[0])
            return NotImplemented
        if name == "cuda":
            src = args[0]
            if _is_device(src):
                return src
            return self._to(src, None, bool(kwargs.get("non_blocking", False)), ".cuda()")
        if name == "copy_":
            dst, src = args[0], args[1]
            non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            if _is_device(dst) and isinstance(src, torch.Tensor) and not _is_device(src) and src.dim() > 0:
                self._h2d(src, non_blocking, "copy_ into a device tensor")
            elif not _is_device(dst) and isinstance(src, torch.Tensor) and _is_device(src):
                self._read("copy_ of a device tensor into a host one")
            else:
                return NotImplemented
            with torch._C.DisableTorchFunction():
                dst.as_subclass(torch.Tensor).copy_(src.as_subclass(torch.Tensor))
            return dst
        if name == "to":
            return self._to_call(args, kwargs)
        return NotImplemented

    def _to_call(self, args: tuple, kwargs: dict) -> Any:
        src, rest = args[0], list(args[1:])
        target_dev: Any = kwargs.get("device")
        dtype = kwargs.get("dtype")
        non_blocking = bool(kwargs.get("non_blocking", False))
        copy = bool(kwargs.get("copy", False))
        for a in rest:
            if isinstance(a, torch.Tensor):
                target_dev, dtype = (CUDA if _is_device(a) else torch.device("cpu")), a.dtype
            elif isinstance(a, torch.dtype):
                dtype = a
            elif isinstance(a, bool):
                non_blocking = a  # .to(device, dtype, non_blocking, copy): the first bool
            elif isinstance(a, (str, torch.device, int)):
                target_dev = a
        if target_dev is None:
            return NotImplemented
        to_cuda = _is_cuda_device(target_dev)
        if to_cuda and not _is_device(src):
            return self._to(src, dtype, non_blocking, ".to(cuda)")
        if not to_cuda and _is_device(src):
            self._read(".to(cpu)")
            out = self.take(src)
            return out.to(dtype) if dtype is not None else out
        # no move: the same device, maybe another dtype
        plain = _plain(src)
        with torch._C.DisableTorchFunctionSubclass():
            out = plain.to(dtype=dtype if dtype is not None else plain.dtype, copy=copy)
        return _mark(out) if _is_device(src) else out

    def _to(self, src: torch.Tensor, dtype: Optional[torch.dtype], non_blocking: bool, what: str) -> torch.Tensor:
        """A host tensor copied to the stand-in device (``dtype``: converted too), if CUDA would copy it
        without a host sync."""
        self._h2d(src, non_blocking, what)
        with torch._C.DisableTorchFunction():
            out = src.to(dtype=dtype if dtype is not None else src.dtype, copy=True)
            return out.as_subclass(_DeviceTensor)


def device_kernel(fn: Callable) -> Callable:
    """fn as a device kernel: under :class:`CudaRules` it runs on the stand-in's values with no
    rule applied (a kernel reads the device freely) and its tensors come back on the device;
    otherwise fn itself."""

    @functools.wraps(fn)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        if _active() is None or not any(_is_device(t) for t in list(_tensors(args)) + list(_tensors(kwargs))):
            return fn(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            out = fn(*_plain(args), **_plain(kwargs))
            return _mark(out)

    return kernel


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)
