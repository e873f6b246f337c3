"""What one folded forward pass carries from the fold to the attention backend and the model.

The fold's decision (which rows the batch keeps, how each attends, the repair to run) is a
:class:`ForwardContext`, read during the forward by the ``relaxkv`` attention backend (rows at
explicit positions and scopes; the query's scores, :class:`QueryScores`) and by the model hook
(the repair). Neither imports the fold: :func:`attached` puts the folded batch on the
``ScheduleBatch`` and the context on the backend and the decoder stack for the length of the
forward; the ``ForwardBatch.init_new`` hook builds from :func:`pending_forward`; readers call
:func:`forward_context`. No module-level state: a context lives as long as its forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional, Protocol, Sequence

import torch

from relaxkv_sglang.attention.staging import to_device
from relaxkv_sglang.repair.selection import query_attention_scores
from relaxkv_sglang.server.failures import InvariantError
from relaxkv_sglang.server import state


@dataclasses.dataclass
class ExtendRows:
    """One request's rows in an extend batch.

    Attributes:
        req_pool_idx: the request's row in ``req_to_token``.
        row_start: first row of this request in the batch's q/k/v.
        positions: int64 [n_rows] absolute position of each row.
        scope_start: int64 [n_rows] first key position each row may attend to.
        scores: for a request to be repaired by a policy that scores, the recorder of its
            query's attention that the backend fills at every layer (None otherwise).
    """

    req_pool_idx: int
    row_start: int
    positions: torch.Tensor
    scope_start: torch.Tensor
    scores: Optional["QueryScores"] = None

    @property
    def n_rows(self) -> int:
        """Rows of this request in the batch."""
        return int(self.positions.shape[0])


@dataclasses.dataclass
class QueryScores:
    """The query's attention mass on the context at each layer (``s_l``), recorded during the
    forward that computes a request's rows over the stale KV (the repair's query pass).

    Attributes:
        n_context: positions ``< n_context`` are the context (the query starts here).
        query_end: one past the query's last position (the prompt's end; a retracted request's
            generated tokens, prefilled again, come after it and are not the query).
        slots: int64 [>= query_end] the request's KV-pool slot of every position.
        layers: per layer so far, float32 [n_context] s_l.
    """

    n_context: int
    query_end: int
    slots: torch.Tensor
    layers: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def record(self, q: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, scale: float) -> None:
        """One layer: q [n_rows, H, d] the request's rows' queries (post-RoPE) at ``positions``
        (int64 [n_rows], on the host: the query's rows are found there, so a GPU is not read back);
        k_cache [pool, Hkv, d] the layer's keys, the rows' own already written."""
        is_query = (positions >= self.n_context) & (positions < self.query_end)
        if int(is_query.sum()) != self.query_end - self.n_context:
            raise InvariantError("relaxkv: the query pass does not hold the whole query")
        keys = k_cache[self.slots[: self.query_end].to(k_cache.device)]
        rows = to_device(is_query.nonzero().flatten(), q.device)
        self.layers.append(query_attention_scores(q.index_select(0, rows), keys, self.n_context, scale))

    def stacked(self, n_layers: int) -> torch.Tensor:
        """float32 [n_layers, n_context], on the CPU (the planner's device)."""
        if len(self.layers) != n_layers:
            raise InvariantError(f"relaxkv: the query pass recorded scores at {len(self.layers)} of {n_layers} layers")
        return torch.stack(self.layers).cpu()


def record_query_scores(rows: Sequence[ExtendRows], q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> None:
    """The attention backend's share of the query pass: for every request that records scores,
    its query's attention mass at this layer. q [n_batch_rows, H, d]; k_cache [pool, Hkv, d]."""
    for r in rows:
        if r.scores is not None:
            r.scores.record(q[r.row_start: r.row_start + r.n_rows], r.positions, k_cache, scale)


class Repair(Protocol):
    """What the model hook runs after SGLang's forward (``repair.RepairStage``)."""

    def run(self, model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n_rows, hidden]: SGLang's final-normed output of the folded rows -> the same
        rows with the repaired requests' glue and query rows replaced by the repair's."""


@dataclasses.dataclass
class ForwardContext:
    """The fold's decision for one forward pass.

    Attributes:
        positions: int64 [n_rows] absolute position of every row of the folded batch.
        extend_rows: per request, its rows (positions and scopes) for the attention backend,
            and the query scores it records for a request to be repaired.
        repair: the repair the model hook runs once SGLang's forward has computed the rows
            (anchors, glue and query of the repaired requests, :mod:`relaxkv_sglang.repair.sglang.repair_stage`); None when no
            request of the batch is repaired.
    """

    positions: torch.Tensor
    extend_rows: list[ExtendRows]
    repair: Optional[Repair] = None

    @property
    def records_scores(self) -> bool:
        """Some request's query scores are recorded by the attention backend in this forward."""
        return any(r.scores is not None for r in self.extend_rows)


@dataclasses.dataclass
class PendingForward:
    """A folded batch waiting for ``ForwardBatch.init_new``: the rows to build it from."""

    batch: Any  # the folded ScheduleBatch (a shallow copy with fewer rows)
    context: ForwardContext


@contextlib.contextmanager
def attached(schedule_batch: Any, readers: Sequence[Any], pending: PendingForward) -> Iterator[None]:
    """For the duration of one forward: the folded batch on the scheduled ``ScheduleBatch``, its
    context on each object that reads it (the worker's attention backend, the decoder stack);
    removed afterwards, whatever happened."""
    state.attach(schedule_batch, state.BatchState(pending))
    for reader in readers:
        attach_context(reader, pending.context)
    try:
        yield
    finally:
        state.detach(schedule_batch)
        for reader in readers:
            attach_context(reader, None)


def pending_forward(schedule_batch: Any) -> Optional[PendingForward]:
    """The folded batch attached to a ``ScheduleBatch``, if any."""
    held = state.record(schedule_batch, state.BatchState, create=False)
    return held.pending if held is not None else None


def attach_context(reader: Any, context: Optional[ForwardContext]) -> None:
    """Attach (or, with None, remove) the fold's decision on an object that reads it during
    one forward (the worker's attention backend, the model's decoder stack)."""
    if context is None:
        state.detach(reader)
    else:
        state.attach(reader, state.ReaderState(context))


def forward_context(reader: Any) -> Optional[ForwardContext]:
    """The fold's decision for the forward running now on this object, if any."""
    held = state.record(reader, state.ReaderState, create=False)
    return held.context if held is not None else None
