"""The forward's second stage: the rows one forward computes, and the repair's query pass among them.

For a request the repair decides in this window the forward is its **query pass**: a scoring policy gets a
:class:`~relaxkv_sglang.attention.extend_rows.QueryScores` recorder, and the query's rows from earlier windows
join the batch (negative ``keep``, scope 0) so the query is whole. The folded batch is a shallow copy of the
scheduled one, the pattern of SGLang's ``model_executor/encoder_swa_replay.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
from copy import copy
from typing import TYPE_CHECKING, Optional

import torch

from relaxkv_sglang.repair.policies import Policy
from relaxkv_sglang.attention.extend_rows import ExtendRows, QueryScores
from relaxkv_sglang.runtime.failures import InvariantError, served_as_pic
from relaxkv_sglang.model.sglang.model_layers import supports_repair

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from relaxkv_sglang.forward.fold import Fold, RequestFold
    from relaxkv_sglang.cache.sglang.relaxkv_cache import RelaxKVCache


@dataclasses.dataclass(frozen=True)
class RequestRows:
    """One request's rows in this forward: ``keep`` int64 [n_rows] window offsets of the rows computed, ascending
    (negative: query rows of earlier windows, for a query pass); ``scope_start`` int64 [n_rows] first key position
    each row may attend to; when ``to_repair``, ``slots`` int64 [window_end] its KV-pool slots and ``scores`` the
    query's attention recorder (a scoring policy); ``not_repaired_reason``: why a request due for repair is not."""

    fold: "RequestFold"
    keep: torch.Tensor
    scope_start: torch.Tensor
    to_repair: bool = False
    slots: Optional[torch.Tensor] = None
    scores: Optional[QueryScores] = None
    not_repaired_reason: Optional[str] = None

    @property
    def positions(self) -> torch.Tensor:
        """int64 [n_rows]."""
        return self.keep + self.fold.window_start

    @property
    def n_rows(self) -> int:
        """Rows of this request in the folded batch."""
        return int(self.keep.shape[0])


@dataclasses.dataclass(frozen=True)
class ForwardSetup:
    """What the forward computes, decided once before it: per request (batch order) its rows, first row in the
    folded batch and attention-backend rows; ``targets``: the batch indices the repair runs for; ``batch``:
    ``source`` (the scheduled ScheduleBatch) or its folded copy; ``positions`` int64 [n_rows] of every row."""

    source: "ScheduleBatch"
    requests: tuple[RequestRows, ...]
    row_starts: tuple[int, ...]
    targets: tuple[int, ...]
    batch: "ScheduleBatch"
    positions: torch.Tensor
    extend_rows: tuple[ExtendRows, ...]


def set_up_forward(cache: "RelaxKVCache", model_runner: Optional["ModelRunner"], fold: "Fold") -> ForwardSetup:
    """The rows of every request of the fold; for each request to repair, its query pass (module doc).
    ``model_runner`` is asked only whether its model runs the repair (None: it does not)."""
    model_ok: Optional[bool] = None
    requests = []
    for f in fold.requests:
        if decides_repair(f):
            if model_ok is None:
                model_ok = model_runner is not None and supports_repair(model_runner.model)
            requests.append(_set_up_request(cache, f, model_ok))
        else:
            requests.append(RequestRows(f, f.keep, f.scope_start))
    starts = tuple(itertools.accumulate((r.n_rows for r in requests[:-1]), initial=0))
    extend_rows = tuple(ExtendRows(r.fold.req_pool_idx, start, r.positions, r.scope_start, r.scores)
                        for r, start in zip(requests, starts))
    return ForwardSetup(fold.source, tuple(requests), starts, tuple(i for i, r in enumerate(requests) if r.to_repair),
                        _batch_of(fold.source, requests), torch.cat([r.positions for r in requests]), extend_rows)


def decides_repair(f: "RequestFold") -> bool:
    """A repair-policy request with chunks, in the window that completes its prompt."""
    return f.plan is not None and f.plan.repairs and f.completes_prompt


def not_repaired_reason(f: "RequestFold", model_supports_repair: bool) -> Optional[str]:
    """Why a request that :func:`decides_repair` cannot be repaired in this window; None if it can."""
    if not model_supports_repair:
        return "the model's layer stack does not run through the repair pass (served as pic)"
    if f.logprob_start is not None:
        # The request's own start, not the window's; -1: none asked (SGLang's offset then points past the window).
        asked = getattr(f.req, "logprob_start_len", -1)
        first = asked if isinstance(asked, int) and asked >= 0 else f.window_start + f.logprob_start
        if first < f.plan.query_start:
            return (f"input logprobs were asked from position {first}, before the query (position "
                    f"{f.plan.query_start}): a repair computes only the anchors, glue and query (served as pic)")
    return None


def _set_up_request(cache: "RelaxKVCache", f: "RequestFold", model_supports_repair: bool) -> RequestRows:
    """Its query pass, or else the fold's rows and why it is not repaired (its own failure: served as pic)."""
    reason = not_repaired_reason(f, model_supports_repair)
    if reason is not None:
        return RequestRows(f, f.keep, f.scope_start, not_repaired_reason=reason)
    try:
        return _query_pass_rows(cache, f)
    except InvariantError:
        raise
    except Exception as exc:
        reason = served_as_pic(f.req, f"its query pass could not be set up ({exc})")
        return RequestRows(f, f.keep, f.scope_start, not_repaired_reason=reason)


def _query_pass_rows(cache: "RelaxKVCache", f: "RequestFold") -> RequestRows:
    """The fold's rows, plus, for a scoring policy, the recorder and the query's rows of earlier windows."""
    slots = cache.req_to_token[f.req_pool_idx, : f.window_end].to(torch.int64)
    query_start, query_end = f.plan.query_start, len(f.req.origin_input_ids)
    if not Policy(f.plan.policy).needs_query_scores:
        return RequestRows(f, f.keep, f.scope_start, to_repair=True, slots=slots)
    earlier_query = torch.arange(min(query_start, f.window_start), f.window_start, dtype=torch.int64)
    _check_whole_query(torch.cat([earlier_query, f.keep + f.window_start]), query_start, query_end)
    keep = torch.cat([earlier_query - f.window_start, f.keep])
    scope = torch.cat([torch.zeros_like(earlier_query), f.scope_start])
    return RequestRows(f, keep, scope, to_repair=True, slots=slots, scores=QueryScores(query_start, query_end, slots))


def _check_whole_query(rows: torch.Tensor, query_start: int, query_end: int) -> None:
    """Raise ``ValueError`` unless the rows (int64 positions) hold every query position ``[query_start, query_end)``."""
    held = int(((rows >= query_start) & (rows < query_end)).sum())
    if not query_start < query_end or held != query_end - query_start:
        raise ValueError(f"the pass would hold {held} of the query's rows {query_start}..{query_end - 1}")


def _batch_of(batch: "ScheduleBatch", requests: list[RequestRows]) -> "ScheduleBatch":
    """The scheduled batch when every request keeps exactly its window's rows, else its folded copy."""
    # keep is ascending and distinct: n rows from offset 0 to n - 1 are the window itself.
    unchanged = all(r.n_rows == n and (n == 0 or (int(r.keep[0]) == 0 and int(r.keep[-1]) == n - 1))
                    for r, n in zip(requests, batch.extend_lens))
    return batch if unchanged else _folded_copy(batch, requests)


def _folded_copy(batch: "ScheduleBatch", requests: list[RequestRows]) -> "ScheduleBatch":
    """A shallow copy of the ScheduleBatch holding only the kept rows; query rows of earlier windows (negative
    ``keep``) take their ids from the request and slots from ``RequestRows.slots``, appended after the batch's."""
    if getattr(batch, "global_num_tokens", None) is not None:
        raise InvariantError("relaxkv: data-parallel attention is not supported with chunk reuse")
    offsets, start, total = [], 0, sum(batch.extend_lens)
    extra_ids, extra_locs, n_extra = [], [], 0
    for r, n in zip(requests, batch.extend_lens):
        rows = r.keep + start
        before = r.keep < 0
        if bool(before.any()):
            pos = r.positions[before]
            extra_ids.append(torch.tensor(r.fold.req.origin_input_ids[: r.fold.window_start], dtype=torch.int64)[pos])
            extra_locs.append(r.slots[pos])
            rows = rows.clone()
            rows[before] = total + n_extra + torch.arange(pos.shape[0])
            n_extra += pos.shape[0]
        offsets.append(rows)
        start += n
    rows = torch.cat(offsets)
    input_ids, out_cache_loc, cpu_ids = batch.input_ids, batch.out_cache_loc, batch.prefill_input_ids_cpu
    if extra_ids:
        ids = torch.cat(extra_ids)
        input_ids = torch.cat([input_ids, ids.to(input_ids.device, input_ids.dtype)])
        out_cache_loc = torch.cat([out_cache_loc, torch.cat(extra_locs).to(out_cache_loc.device, out_cache_loc.dtype)])
        if cpu_ids is not None:
            cpu_ids = torch.cat([cpu_ids, ids.to(cpu_ids.dtype)])
    folded = copy(batch)
    folded.input_ids = input_ids[rows.to(input_ids.device)]
    folded.out_cache_loc = out_cache_loc[rows.to(out_cache_loc.device)]
    if cpu_ids is not None:
        folded.prefill_input_ids_cpu = cpu_ids[rows]
    new_lens = [r.n_rows for r in requests]
    if batch.extend_logprob_start_lens is not None:
        # Input-logprob rows were all kept, so their count is unchanged.
        folded.extend_logprob_start_lens = [
            new - (old - start) for new, old, start in zip(new_lens, batch.extend_lens, batch.extend_logprob_start_lens)
        ]
    folded.extend_lens = new_lens
    folded.extend_num_tokens = sum(new_lens)
    return folded
