"""The plugin's rows as FlashInfer paged-prefill batches over SGLang's KV pool (plain torch).

Both kinds of rows become one call of FlashInfer 0.7.2's ``BatchPrefillWithPagedKVCacheWrapper``,
page size 1 (a page is one pool slot), ``causal=True``. Its causal rule is bottom-right aligned:
with ``qo_len`` queries and ``kv_len`` keys, query ``i`` sees keys ``0 .. i + kv_len - qo_len``. So a
*segment* whose queries sit at consecutive positions ``t_lo .. t_hi`` and whose key list ends with
positions ``t_lo+1 .. t_hi`` (everything before them ``<= t_lo``) gives each query its keys ``<= t``.

* **Chunk-scoped rows** (here, :func:`scoped_prefill_inputs`): a segment is a run of one request's
  rows with one scope start ``s`` and positions ``p0 .. p1``; keys ``req_to_token[req, s:p1+1]``, so
  query ``p`` sees ``s .. p`` (:func:`~relaxkv_sglang.attention.causal.scoped_causal_attention`).
* **Anchors** (:mod:`.anchor_inputs`): a segment is a row block of a block-sparse layout.

The segment arithmetic both share (offsets, key runs expanded on the device) is here too. Torch
model of the call: :func:`~relaxkv_sglang.attention.gpu.torch_models.paged_prefill_attention`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from relaxkv_sglang.attention.staging import HostStage

__all__ = [
    "ScopedPrefillInputs",
    "scoped_prefill_inputs",
    "exclusive_cumsum",
    "expand_runs",
    "indptr_of",
    "last_page_lens",
    "single_threaded",
]


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run the host build on one intra-op thread, then restore the setting.

    Its ops are small (a few hundred thousand elements); torch would split each over OpenMP
    threads, which gains little and, on cores busy with other work (a shared machine, a server's
    other threads), costs many times the work itself in waits (measured: 8 ms single-threaded,
    50 to 400 ms on two busy cores).
    """
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def exclusive_cumsum(lengths: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum: the offset of each segment of ``lengths`` laid end to end."""
    return torch.cumsum(lengths, 0) - lengths


def indptr_of(lengths: torch.Tensor) -> torch.Tensor:
    """int32 [n + 1] offsets of ``lengths`` (host tensor)."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(lengths.cpu(), 0)
    return out


def last_page_lens(kv_indptr: torch.Tensor) -> torch.Tensor:
    """int32 [n_seg] host: 1 for a segment with keys, 0 without (page size 1)."""
    return (kv_indptr.diff() > 0).to(torch.int32)


def expand_runs(run_start: torch.Tensor, run_len: torch.Tensor, total: int) -> torch.Tensor:
    """int64 [total]: ``run_start[i] .. run_start[i] + run_len[i] - 1`` for every run, laid end to end.

    ``total`` (= ``run_len.sum()``) comes from the host, so on a GPU this neither reads the
    device nor synchronizes.
    """
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=run_start.device)
    run_start, run_len = run_start.long(), run_len.long()
    shift = torch.repeat_interleave(run_start - exclusive_cumsum(run_len), run_len, output_size=total)
    return shift + torch.arange(total, device=run_start.device)


# --- chunk-scoped rows --------------------------------------------------------------------------


@dataclass
class ScopedPrefillInputs:
    """An extend batch's rows as one paged-prefill call, each scope run its own causal segment.

    Attributes:
        qo_indptr: int32 [n_seg + 1] host: segments are runs of consecutive batch rows.
        kv_indptr: int32 [n_seg + 1] host: segment s reads ``seg_len[s]`` keys.
        seg_req: int64 [n_seg] the segment's row of ``req_to_token``.
        seg_scope: int64 [n_seg] its first key position (the scope start).
        seg_len: int64 [n_seg] its keys: positions ``seg_scope .. seg_scope + seg_len - 1``.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    seg_req: torch.Tensor
    seg_scope: torch.Tensor
    seg_len: torch.Tensor

    @property
    def n_segments(self) -> int:
        return int(self.seg_req.numel())

    @property
    def n_kv(self) -> int:
        return int(self.kv_indptr[-1])

    @property
    def last_page_len(self) -> torch.Tensor:
        """int32 [n_seg] host (:attr:`~.anchor_inputs.AnchorLayerInputs.last_page_len`)."""
        return last_page_lens(self.kv_indptr)

    def kv_indices(self, req_to_token: torch.Tensor) -> torch.Tensor:
        """int32 [n_kv] the call's keys as KV-pool slots, on req_to_token's device (one staged copy).

        Args:
            req_to_token: int [n_req_slots, max_context] SGLang's ``req_to_token`` table.
        """
        stage = HostStage(req_to_token.device)
        flat_start = stage.put(self.seg_req * req_to_token.shape[1] + self.seg_scope)
        seg_len = stage.put(self.seg_len)
        stage.send()
        flat = expand_runs(flat_start.get(), seg_len.get(), self.n_kv)
        return req_to_token.reshape(-1)[flat].to(torch.int32)


def scoped_prefill_inputs(req_of_row: torch.Tensor, positions: torch.Tensor,
                          scope_start: torch.Tensor) -> ScopedPrefillInputs:
    """Segments of an extend batch's rows (module doc), vectorised.

    Args:
        req_of_row: int64 [n] each row's ``req_to_token`` row, in batch order.
        positions: int64 [n] each row's position; scope_start: int64 [n] its first key
            position (<= the position).  CPU tensors (the fold's rows).
    Returns:
        ScopedPrefillInputs.
    """
    with single_threaded():
        return _scoped_prefill_inputs(req_of_row.long(), positions.long(), scope_start.long())


def _scoped_prefill_inputs(req_of_row: torch.Tensor, positions: torch.Tensor,
                           scope_start: torch.Tensor) -> ScopedPrefillInputs:
    n = int(positions.numel())
    new = torch.ones(n, dtype=torch.bool, device=positions.device)
    if n > 1:
        new[1:] = ((req_of_row[1:] != req_of_row[:-1]) | (scope_start[1:] != scope_start[:-1])
                   | (positions[1:] != positions[:-1] + 1))
    first = new.nonzero().squeeze(1)
    rows = torch.diff(torch.cat([first, torch.tensor([n], device=first.device)]))
    last_pos = positions.index_select(0, first + rows - 1)
    scope = scope_start.index_select(0, first)
    seg_len = last_pos - scope + 1
    return ScopedPrefillInputs(indptr_of(rows), indptr_of(seg_len), req_of_row.index_select(0, first), scope, seg_len)
