"""Host tensors bound for a device: one non-blocking copy, decided once and sent once.

A GPU pass that decides on the host (the repair's rows, layouts and scopes) needs index tensors on
the device. Copying each from pageable memory synchronizes the stream (a host sync); pinning each
costs a page-locked allocation. :class:`HostStage` follows plan/run: every tensor the pass will
need is :meth:`~HostStage.put` while the pass is planned, :meth:`~HostStage.send` packs them into
one pinned buffer (each at an 8-byte-aligned offset) and copies it to the device in one
non-blocking copy, and each handle's :meth:`~Staged.get` is then a view of the device copy. On a
CPU nothing is copied: the handles give the host tensors back.

:func:`to_device` is the single-tensor form (through pinned memory, non-blocking), for what is
decided once per pass outside a stage (RoPE's frequencies); :func:`pinned_host` puts host
tensors that a device call copies itself (FlashInfer's ``plan`` arguments) in one page-locked buffer.

Torch only.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["HostStage", "Staged", "pinned_host", "to_device"]

_ALIGN = 8  # bytes: every staged tensor starts at a multiple (int64's alignment)


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device``; on CUDA through pinned memory without blocking (a plain
    copy from pageable memory synchronizes the stream: a host sync)."""
    device = torch.device(device)
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def pinned_host(tensors: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Host tensors a device call reads on the host and copies itself (FlashInfer's ``plan``
    indptrs), in one page-locked buffer when ``device`` is CUDA (one allocation, copies that do not
    block); as they are otherwise. All of one dtype; returns views, in order."""
    if torch.device(device).type != "cuda" or not tensors:
        return list(tensors)
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, pin_memory=True)
    views, at = [], 0
    for t in tensors:
        view = flat[at:at + t.numel()].view(t.shape)
        view.copy_(t)
        views.append(view)
        at += t.numel()
    return views


class Staged:
    """One tensor put on a :class:`HostStage`: ``get()`` is it on the stage's device (after
    ``send``), ``host`` the tensor as put."""

    __slots__ = ("host", "_stage", "_offset")

    def __init__(self, stage: "HostStage", host: torch.Tensor, offset: int) -> None:
        self.host, self._stage, self._offset = host, stage, offset

    def get(self) -> torch.Tensor:
        """The tensor on the device (dtype and shape as put)."""
        return self._stage._view(self)


class HostStage:
    """Host tensors for one device, sent in one copy (module doc).

    Args:
        device: where the tensors go.
    
    Example (on a CPU nothing is copied; on CUDA ``get`` is a view of the one device copy):

    >>> import torch
    >>> stage = HostStage("cpu")
    >>> rows, pos = stage.put(torch.tensor([3, 1, 2])), stage.put(torch.tensor([0.5, 1.5]))
    >>> stage.send()
    >>> rows.get().tolist(), pos.get().tolist()
    ([3, 1, 2], [0.5, 1.5])
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._items: list[Staged] = []
        self._size = 0
        self._buffer: Optional[torch.Tensor] = None  # uint8 [size] on the device, after send

    @property
    def copies(self) -> bool:
        """Whether put tensors travel (the device is not the host)."""
        return self.device.type != "cpu"

    def put(self, x: torch.Tensor) -> Staged:
        """Stage a host tensor (any dtype, any shape; made contiguous). Before :meth:`send`."""
        if self._buffer is not None:
            raise RuntimeError("HostStage.put after send")
        if x.device.type != "cpu":
            raise ValueError(f"HostStage stages host tensors, got one on {x.device}")
        x = x.contiguous()
        item = Staged(self, x, self._size)
        if self.copies:
            self._items.append(item)
            self._size += -(-x.numel() * x.element_size() // _ALIGN) * _ALIGN
        return item

    def send(self) -> None:
        """Pack every put tensor into one pinned buffer and copy it to the device, non-blocking."""
        if self._buffer is not None:
            raise RuntimeError("HostStage.send twice")
        if not self.copies:
            self._buffer = torch.empty(0, dtype=torch.uint8)
            return
        # page-locked only for CUDA (the copy must not block); elsewhere (``meta``) a plain buffer
        pinned = torch.empty(max(self._size, _ALIGN), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        for item in self._items:
            n = item.host.numel() * item.host.element_size()
            pinned[item._offset:item._offset + n] = item.host.reshape(-1).view(torch.uint8)
        # The caching host allocator keeps ``pinned`` from reuse until this copy has run.
        self._buffer = pinned.to(self.device, non_blocking=True)

    def _view(self, item: Staged) -> torch.Tensor:
        if self._buffer is None:
            raise RuntimeError("Staged.get before HostStage.send")
        if not self.copies:
            return item.host
        x = item.host
        n = x.numel() * x.element_size()
        return self._buffer[item._offset:item._offset + n].view(x.dtype).view(x.shape)
