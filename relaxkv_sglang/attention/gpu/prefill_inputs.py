"""The plugin's rows as FlashInfer paged-prefill batches over SGLang's KV pool (plain torch).

One call of FlashInfer 0.7.2's ``BatchPrefillWithPagedKVCacheWrapper``, page size 1 (a page is a pool
slot), ``causal=True``, whose causal rule is bottom-right aligned: query ``i`` of ``qo_len`` sees keys
``0 .. i + kv_len - qo_len``. So a *segment* of queries at ``t_lo .. t_hi`` whose key list ends with
``t_lo+1 .. t_hi`` (all before ``<= t_lo``) gives each query its keys ``<= t``. Chunk-scoped rows
(:func:`scoped_prefill_inputs`): a run of one request's rows with one scope start ``s``, keys
``req_to_token[req, s:p1+1]`` (:func:`~relaxkv_sglang.attention.causal.scoped_causal_attention`).
Anchors (:mod:`.anchor_inputs`): a row block of a block-sparse layout. Torch model of the call:
:func:`~relaxkv_sglang.attention.gpu.torch_models.paged_prefill_attention`.
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
    """One intra-op thread for the host build: its ops are small, and split over OpenMP threads on busy
    cores they wait many times their work (docs/experiments/INDEX.md#gpu-anchor-inputs)."""
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
    return torch.cumsum(lengths, 0) - lengths


def indptr_of(lengths: torch.Tensor) -> torch.Tensor:
    """int32 [n + 1] host."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(lengths.cpu(), 0)
    return out


def last_page_lens(kv_indptr: torch.Tensor) -> torch.Tensor:
    """int32 [n_seg] host: 1 for a segment with keys, 0 without (page size 1)."""
    return (kv_indptr.diff() > 0).to(torch.int32)


def expand_runs(run_start: torch.Tensor, run_len: torch.Tensor, total: int) -> torch.Tensor:
    """int64 [total], the runs end to end; ``total`` from the host, so no device read."""
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=run_start.device)
    run_start, run_len = run_start.long(), run_len.long()
    shift = torch.repeat_interleave(run_start - exclusive_cumsum(run_len), run_len, output_size=total)
    return shift + torch.arange(total, device=run_start.device)



@dataclass
class ScopedPrefillInputs:
    """An extend batch as one call, each scope run a segment. qo_indptr, kv_indptr int32 [n_seg + 1]
    host; seg_req (its ``req_to_token`` row), seg_scope (first key position), seg_len int64 [n_seg]."""

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
        """int32 [n_seg] host."""
        return last_page_lens(self.kv_indptr)

    def kv_indices(self, req_to_token: torch.Tensor) -> torch.Tensor:
        """int32 [n_kv] pool slots via req_to_token int [n_req_slots, max_context], one staged copy."""
        stage = HostStage(req_to_token.device)
        flat_start = stage.put(self.seg_req * req_to_token.shape[1] + self.seg_scope)
        seg_len = stage.put(self.seg_len)
        stage.send()
        flat = expand_runs(flat_start.get(), seg_len.get(), self.n_kv)
        return req_to_token.reshape(-1)[flat].to(torch.int32)


def scoped_prefill_inputs(req_of_row: torch.Tensor, positions: torch.Tensor,
                          scope_start: torch.Tensor) -> ScopedPrefillInputs:
    """The fold's CPU rows in batch order: req_of_row, positions, scope_start int64 [n]."""
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
