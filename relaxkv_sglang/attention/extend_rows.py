"""The rows a folded forward hands the attention: each request's rows at explicit positions and scopes,
and the recorder a repair's query pass fills at every layer."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from relaxkv_sglang.attention.query_scores import query_attention_scores
from relaxkv_sglang.attention.staging import to_device
from relaxkv_sglang.runtime.failures import InvariantError


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


@dataclasses.dataclass(frozen=True)
class FoldedRows:
    """The attention backend's record during one folded forward: every request's rows (batch order), and
    whether a repair runs after SGLang's layers (then SGLang's CUDA graph must not replay)."""

    extend_rows: list[ExtendRows]
    repairs: bool = False

    @property
    def records_scores(self) -> bool:
        """Some request's query scores are recorded by the attention backend in this forward."""
        return any(r.scores is not None for r in self.extend_rows)



def record_query_scores(rows: Sequence[ExtendRows], q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> None:
    """Each scored request's share of ``q`` [n_batch_rows, H, d] recorded against k_cache [pool, Hkv, d]."""
    for r in rows:
        if r.scores is not None:
            r.scores.record(q[r.row_start: r.row_start + r.n_rows], r.positions, k_cache, scale)
