"""What one folded forward pass carries from the fold to the attention backend and the model.

The fold (:mod:`.fold`) decides, before SGLang builds its ``ForwardBatch``, which rows the
batch keeps and how each attends. Two readers need that decision during the forward: the
``relaxkv`` attention backend (rows at explicit positions and scopes) and the model hook (the
repair pass's layer loop). Neither imports the fold: the decision travels as a
:class:`ForwardContext` object attached to the objects SGLang already passes around.

1. :func:`attach_pending` puts the folded batch and its context on the ``ScheduleBatch`` the
   scheduler hands to ``TpModelWorker.forward_batch_generation``;
2. the ``ForwardBatch.init_new`` hook (:mod:`.forward`) builds the ``ForwardBatch`` from the
   folded batch; the context is attached to the worker's attention backend and the model's
   decoder stack for the duration of the forward (:func:`attach_context`);
3. the backend (on itself) and the model hook (on the decoder stack) read it back with
   :func:`forward_context`.

Nothing here is module-level state: a context lives exactly as long as the forward it is for.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from relaxkv_sglang.srt.layer_loop import LoopRows

# Attribute names on SGLang's objects; one place, so a reader can grep for them.
_CONTEXT_ATTR = "relaxkv_context"
_PENDING_ATTR = "relaxkv_pending"


@dataclasses.dataclass
class ExtendRows:
    """One request's rows in an extend batch.

    Attributes:
        req_pool_idx: the request's row in ``req_to_token``.
        row_start: first row of this request in the batch's q/k/v.
        positions: int64 [n_rows] absolute position of each row.
        scope_start: int64 [n_rows] first key position each row may attend to.
    """

    req_pool_idx: int
    row_start: int
    positions: torch.Tensor
    scope_start: torch.Tensor

    @property
    def n_rows(self) -> int:
        """Rows of this request in the batch."""
        return int(self.positions.shape[0])


@dataclasses.dataclass
class ForwardContext:
    """The fold's decision for one forward pass.

    Attributes:
        positions: int64 [n_rows] absolute position of every row of the folded batch.
        extend_rows: per request, its rows (positions and scopes) for the attention backend.
        repair_pass: per request, the repair pass's rows, when the model's layer loop is
            replaced by the repair pass; None for an ordinary (possibly folded) forward.
        kv_pool: SGLang's KV pool the repair pass reads and writes.
        anchor_attention: the worker's anchor attention executor
            (:class:`~relaxkv_sglang.srt.layer_loop.AnchorAttention`).
    """

    positions: torch.Tensor
    extend_rows: list[ExtendRows]
    repair_pass: Optional[list["LoopRows"]] = None
    kv_pool: Any = None
    anchor_attention: Any = None


@dataclasses.dataclass
class PendingForward:
    """A folded batch waiting for ``ForwardBatch.init_new``: the rows to build it from."""

    batch: Any  # the folded ScheduleBatch (a shallow copy with fewer rows)
    context: ForwardContext


def attach_pending(schedule_batch: Any, pending: Optional[PendingForward]) -> None:
    """Put (or, with None, remove) the folded batch on the scheduled ``ScheduleBatch``."""
    if pending is None:
        schedule_batch.__dict__.pop(_PENDING_ATTR, None)
    else:
        setattr(schedule_batch, _PENDING_ATTR, pending)


def pending_forward(schedule_batch: Any) -> Optional[PendingForward]:
    """The folded batch attached to a ``ScheduleBatch``, if any."""
    return getattr(schedule_batch, _PENDING_ATTR, None)


def attach_context(reader: Any, context: Optional[ForwardContext]) -> None:
    """Attach (or, with None, remove) the fold's decision on an object that reads it during
    one forward (the worker's attention backend, the model's decoder stack)."""
    setattr(reader, _CONTEXT_ATTR, context)


def forward_context(reader: Any) -> Optional[ForwardContext]:
    """The fold's decision for the forward running now on this object, if any."""
    return getattr(reader, _CONTEXT_ATTR, None)
