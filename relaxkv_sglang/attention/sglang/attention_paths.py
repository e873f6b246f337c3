"""Which attention a batch gets, decided on fake-able batch descriptions (pure; no SGLang import).

The decisions of the backend :mod:`.attention_backend` describes, and what both its classes carry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from relaxkv_sglang.attention.extend_rows import ExtendRows, FoldedRows
from relaxkv_sglang.attention.gpu.prefill_inputs import ScopedPrefillInputs, scoped_prefill_inputs
from relaxkv_sglang.runtime import records
from relaxkv_sglang.runtime.failures import InvariantError

SGLANG, SCOPED = "sglang", "scoped"

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


def contiguous_rows(forward_batch: "ForwardBatch") -> list[ExtendRows]:
    """Rows of an ordinary extend batch: each request's tail, scope start 0."""
    rows, start = [], 0
    pool_idx = forward_batch.req_pool_indices.tolist()
    prefix = forward_batch.extend_prefix_lens_cpu
    lens = forward_batch.extend_seq_lens_cpu
    for rp, pre, n in zip(pool_idx, prefix, lens):
        pos = torch.arange(pre, pre + n, dtype=torch.int64)
        rows.append(ExtendRows(rp, start, pos, torch.zeros(n, dtype=torch.int64)))
        start += n
    return rows


def rows_are_contiguous_tails(rows: Sequence[ExtendRows], prefix_lens: Sequence[int],
                              extend_lens: Sequence[int]) -> bool:
    """Whether the fold's rows are exactly the batch's ordinary rows (:func:`contiguous_rows`), in batch order."""
    if len(rows) != len(prefix_lens) or len(rows) != len(extend_lens):
        return False
    start = 0
    for r, pre, n in zip(rows, prefix_lens, extend_lens):
        if r.row_start != start or r.n_rows != n:
            return False
        if n and not (torch.equal(r.positions, torch.arange(pre, pre + n, dtype=r.positions.dtype))
                      and not bool(r.scope_start.any())):
            return False
        start += n
    return True


def folded_rows(backend: AttentionBackend) -> Optional[FoldedRows]:
    """The rows of the folded forward running now on ``backend``; None for SGLang's own batches."""
    return records.record(backend, FoldedRows, create=False)


def attention_path(is_extend: bool, rows: Optional[FoldedRows], ordinary_rows: Callable[[], bool]) -> str:
    """``"scoped"`` for an extend whose ``rows`` record scores or are not ``ordinary_rows()`` (evaluated last);
    else ``"sglang"``. ``rows`` is None for SGLang's own batches (every decode and capture)."""
    if rows is None or not is_extend:
        return SGLANG
    if rows.records_scores:
        return SCOPED
    return SGLANG if ordinary_rows() else SCOPED


def may_replay_graph(path: str, rows: Optional[FoldedRows]) -> bool:
    """Only SGLang's own batches without a repair may replay SGLang's prefill CUDA graph: the replay swaps the
    decoder stack's ``forward`` for the captured body (an instance attribute shadowing the plugin's class-level
    model hook), so a repair would silently not run."""
    return path == SGLANG and not (rows is not None and rows.repairs)


def unsupported_settings(model: Optional[torch.nn.Module]) -> list[str]:
    """Per ``RadixAttention`` layer of ``model``, what the plugin's attention does not apply: a sliding window,
    a logit soft cap, K/V scales (FP8). Empty when every layer is plain causal."""
    found = []
    for module in model.modules() if model is not None else ():
        if not (hasattr(module, "sliding_window_size") and hasattr(module, "layer_id")):
            continue
        where = f"layer {module.layer_id}"
        if module.sliding_window_size not in (None, -1):
            found.append(f"{where}: a sliding window of {module.sliding_window_size} tokens")
        if getattr(module, "logit_cap", 0):
            found.append(f"{where}: a logit soft cap of {module.logit_cap}")
        for kind in ("k", "v"):
            scale = getattr(module, f"{kind}_scale_float", None)
            if scale not in (None, 1.0):
                found.append(f"{where}: a {kind.upper()} scale of {scale}")
    return found


def check_attention_settings(model: Optional[torch.nn.Module]) -> None:
    """Refuse, in one line, a model with :func:`unsupported_settings`: the plugin would silently drop them."""
    found = unsupported_settings(model)
    if found:
        more = f" (and {len(found) - 2} more)" if len(found) > 2 else ""
        raise RuntimeError(f"relaxkv: the relaxkv attention backend does not apply {'; '.join(found[:2])}{more}; "
                           "serve this model with another --attention-backend and without the relaxkv tree cache")


def batch_path(backend: AttentionBackend, forward_batch: "ForwardBatch") -> str:
    """:func:`attention_path` of a live ``ForwardBatch`` on the backend it runs on."""
    rows = folded_rows(backend)
    return attention_path(
        forward_batch.forward_mode.is_extend(), rows,
        lambda: rows_are_contiguous_tails(rows.extend_rows, forward_batch.extend_prefix_lens_cpu,
                                          forward_batch.extend_seq_lens_cpu))


def scoped_inputs(rows: Sequence[ExtendRows]) -> ScopedPrefillInputs:
    """The fold's rows (batch order) as one paged-prefill call's segments."""
    start = 0
    for r in rows:
        if r.row_start != start:
            raise InvariantError("relaxkv: the fold's rows do not tile the batch")
        start += r.n_rows
    req = torch.cat([torch.full((r.n_rows,), r.req_pool_idx, dtype=torch.int64) for r in rows])
    return scoped_prefill_inputs(req, torch.cat([r.positions for r in rows]), torch.cat([r.scope_start for r in rows]))
