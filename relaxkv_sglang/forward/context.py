"""What one folded forward pass carries from the fold to the attention backend and the model.

Readers never import the fold: :func:`attached` holds the :class:`ForwardContext` for one forward, the
``ForwardBatch.init_new`` hook builds from :func:`pending_forward`, readers call :func:`forward_context`."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional, Protocol, Sequence

import torch

from relaxkv_sglang.attention.staging import to_device
from relaxkv_sglang.attention.query_scores import query_attention_scores
from relaxkv_sglang.runtime.failures import InvariantError
from relaxkv_sglang.runtime import records


@dataclasses.dataclass
class ExtendRows:
    """One request's extend rows, from ``row_start`` in the batch; ``req_pool_idx``: its ``req_to_token`` row.
    ``positions``/``scope_start``: int64 [n_rows], each row's absolute position and first attended key position;
    ``scores``: the recorder the backend fills per layer, for a request repaired by a scoring policy (else None)."""

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
    """The query's attention mass on the context per layer (``s_l``), recorded in the repair's query pass.

    The query is ``[n_context, query_end)`` (a retracted request's generated tokens, prefilled again, follow it);
    ``slots``: int64 [>= query_end] KV-pool slots; ``layers``: float32 [n_context] per layer so far."""

    n_context: int
    query_end: int
    slots: torch.Tensor
    layers: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def record(self, q: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, scale: float) -> None:
        """One layer: q [n_rows, H, d] post-RoPE at ``positions`` (int64 [n_rows], host: no GPU read-back);
        k_cache [pool, Hkv, d], the rows' own keys already written."""
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
    """The backend's share of the query pass at this layer: q [n_batch_rows, H, d]; k_cache [pool, Hkv, d]."""
    for r in rows:
        if r.scores is not None:
            r.scores.record(q[r.row_start: r.row_start + r.n_rows], r.positions, k_cache, scale)


class Repair(Protocol):
    """What the model hook runs after SGLang's forward (``repair.RepairStage``)."""

    def run(self, model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n_rows, hidden], SGLang's final-normed folded rows -> the same, repaired glue and query replaced."""


@dataclasses.dataclass
class ForwardContext:
    """The fold's decision for one forward: ``positions`` int64 [n_rows] of the folded batch; ``repair`` run by the
    model hook after SGLang's forward (:mod:`relaxkv_sglang.forward.repair_stage`), None if none is repaired."""

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
    """For one forward: the folded batch on ``schedule_batch``, its context on each reader; removed afterwards."""
    records.attach(schedule_batch, records.BatchState(pending))
    for reader in readers:
        attach_context(reader, pending.context)
    try:
        yield
    finally:
        records.detach(schedule_batch)
        for reader in readers:
            attach_context(reader, None)


def pending_forward(schedule_batch: Any) -> Optional[PendingForward]:
    """The folded batch attached to a ``ScheduleBatch``, if any."""
    held = records.record(schedule_batch, records.BatchState, create=False)
    return held.pending if held is not None else None


def attach_context(reader: Any, context: Optional[ForwardContext]) -> None:
    """Attach (or, with None, remove) the fold's decision on a reader of one forward (:func:`attached`)."""
    if context is None:
        records.detach(reader)
    else:
        records.attach(reader, records.ReaderState(context))


def forward_context(reader: Any) -> Optional[ForwardContext]:
    """The fold's decision for the forward running now on this object, if any."""
    held = records.record(reader, records.ReaderState, create=False)
    return held.context if held is not None else None
