"""What one folded forward carries into SGLang's forward, each held by :func:`attached` on the object that
reads it for that forward only: the folded batch (``ForwardBatch.init_new``), the rows (the attention
backend), the repair (the decoder stack)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from relaxkv_sglang.attention.extend_rows import FoldedRows
from relaxkv_sglang.forward.repair_stage import RepairStage
from relaxkv_sglang.runtime import records

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.managers.schedule_batch import ScheduleBatch


@dataclasses.dataclass(frozen=True)
class PendingForward:
    """The ``ScheduleBatch``'s record while its forward runs: the folded batch (a shallow copy with fewer rows) and
    its ``positions`` int64 [n_rows] that ``ForwardBatch.init_new`` builds from, the ``rows`` the attention backend
    reads, the ``repair`` run after SGLang's layers (None if no request is repaired)."""

    batch: "ScheduleBatch"
    positions: torch.Tensor
    rows: FoldedRows
    repair: Optional[RepairStage] = None


@contextlib.contextmanager
def attached(schedule_batch: "ScheduleBatch", attn_backend: "AttentionBackend",
             decoder_stack: Optional[torch.nn.Module], pending: PendingForward) -> Iterator[None]:
    """For one forward: the folded batch on ``schedule_batch``, its rows on ``attn_backend``, its repair on
    ``decoder_stack`` (the module whose ``forward`` the repair hook wraps); removed afterwards."""
    readers = [(schedule_batch, pending), (attn_backend, pending.rows)]
    if decoder_stack is not None and pending.repair is not None:
        readers.append((decoder_stack, pending.repair))
    for obj, held in readers:
        records.attach(obj, held)
    try:
        yield
    finally:
        for obj, held in readers:
            records.detach(obj, type(held))


def pending_forward(schedule_batch: "ScheduleBatch") -> Optional[PendingForward]:
    """The folded batch attached to a ``ScheduleBatch``, if any."""
    return records.record(schedule_batch, PendingForward, create=False)
