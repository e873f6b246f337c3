"""Host tensors bound for a device: one non-blocking copy, decided once and sent once.

A GPU pass decided on the host (the repair's rows, layouts, scopes) needs index tensors on the device;
copying each from pageable memory is a host sync, pinning each a page-locked allocation. So every tensor
is :meth:`~HostStage.put` while the pass is planned and :meth:`~HostStage.send` packs them into one pinned
buffer (8-byte-aligned) copied in one non-blocking copy; each :meth:`~Staged.get` is a view of the
device copy.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["HostStage", "Staged", "pinned_host", "to_device"]

_ALIGN = 8  # bytes: every staged tensor starts at a multiple (int64's alignment)


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """On CUDA through pinned memory, non-blocking (RoPE's frequencies)."""
    device = torch.device(device)
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def pinned_host(tensors: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Tensors a device call copies itself (FlashInfer's ``plan`` arguments), all of one dtype: views of
    one page-locked buffer on CUDA (as they are otherwise)."""
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
    """``get()``: on the stage's device after ``send``; ``host``: as put."""

    __slots__ = ("host", "_stage", "_offset")

    def __init__(self, stage: "HostStage", host: torch.Tensor, offset: int) -> None:
        self.host, self._stage, self._offset = host, stage, offset

    def get(self) -> torch.Tensor:
        return self._stage._view(self)


class HostStage:
    """Host tensors for one device, sent in one copy (module doc); on a CPU nothing is copied:

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
        return self.device.type != "cpu"

    def put(self, x: torch.Tensor) -> Staged:
        """Any dtype and shape, before :meth:`send`."""
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
        if self._buffer is not None:
            raise RuntimeError("HostStage.send twice")
        if not self.copies:
            self._buffer = torch.empty(0, dtype=torch.uint8)
            return
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
