"""The plugin's rows as FlashInfer paged-prefill batches over SGLang's KV pool (plain torch).

Both kinds of rows the plugin attends on a GPU become one call of FlashInfer 0.7.2's
``BatchPrefillWithPagedKVCacheWrapper`` with page size 1 (SGLang's KV pool: a "page" is one pool
slot) and ``causal=True``.  FlashInfer's causal rule is bottom-right aligned: in a request with
``qo_len`` queries and ``kv_len`` keys, query ``i`` sees keys ``0 .. i + kv_len - qo_len``.  So a
request whose queries sit at the *consecutive* positions ``t_lo .. t_hi`` and whose key list
ends with the positions ``t_lo+1 .. t_hi`` (ascending, everything before them ``<= t_lo``) gives
each query exactly its keys ``<= t``.  This module builds such requests ("segments"):

* **Chunk-scoped rows** (:func:`scoped_prefill_inputs`, the batches the fold changed): a segment
  is a run of consecutive rows of one request with one scope start ``s`` and consecutive
  positions ``p0 .. p1``; its keys are the request's slots at positions ``s .. p1``
  (``req_to_token[req, s:p1+1]``).  Query ``p`` then sees ``s .. p``: the scoped causal rule of
  :func:`~relaxkv_sglang.core.attention.scoped_causal_attention`.  Rows come in batch order, so
  the call's queries are the batch's rows as they are (no copy).
* **Anchors** (:func:`anchor_prefill_inputs`, the repair pass): a segment is a row block of a
  :class:`~relaxkv_sglang.core.layout.BlockSparseLayout` (anchors sharing one key-page list;
  in relaxed layouts a block's anchors lie on one page), its queries padded to the consecutive
  positions ``t_lo .. t_hi`` of its first and last anchor (at most ``page_size`` queries; the
  padding queries are zeros and their outputs are dropped), its keys the block's listed keys
  ``j <= t_hi`` in ascending order.  The bottom-right rule then gives each anchor ``t`` exactly
  the layout's keys ``j <= t`` **when every position in** ``(t_lo, t_hi]`` **is listed** and the
  first anchor sees a key; relaxed and full layouts always satisfy this (a block's own page is
  listed).  Any other block (possible in an arbitrary CSR layout) is split into one segment per
  row, and a row that sees no key gets no segment (its output is 0, as in the torch executor).

Work and memory: the anchors' call reads ``sum over segments of kv_len`` keys (each block's
keys once for all its anchors: 224K per layer for a 6K-token request at 15% anchors and 25%
context, against 747K visible (anchor, key) pairs) from the pool slots directly (no gather of the
context's K/V); the padded queries cost at most ``page_size`` rows per block.

What runs where: :func:`anchor_prefill_inputs` takes all layers' layouts of a request (CPU
tensors, as the planner builds them) and computes, in one vectorised pass with no per-row Python,
every layer's host-side metadata (``qo_indptr``/``kv_indptr``, what FlashInfer's ``plan`` needs
on the host) and compact key runs; :meth:`AnchorLayerInputs.kv_indices` expands one layer's runs
into pool slots on the KV pool's device (``repeat_interleave`` with the size known on the host:
no device-to-host copy).  The code is device-agnostic torch: given CUDA layouts it runs as is,
but then reading the host metadata back costs device syncs, so the server hands it the planner's
CPU layouts.  The tests and the benchmark (``bench_scaling``'s ``gpu inputs ms``) run it on CPU.
The torch model of the FlashInfer call is :func:`~relaxkv_sglang.gpu.torch_models.paged_prefill_attention`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from relaxkv_sglang.core.layout import BlockSparseLayout

__all__ = [
    "AnchorLayerInputs",
    "ScopedPrefillInputs",
    "anchor_prefill_inputs",
    "scoped_prefill_inputs",
    "expand_runs",
    "single_threaded",
    "to_device",
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


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; on CUDA through pinned memory without blocking (a plain
    copy from pageable memory synchronizes the stream: a host sync)."""
    device = torch.device(device)
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def _starts(lengths: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum: the offset of each segment of ``lengths`` laid end to end."""
    return torch.cumsum(lengths, 0) - lengths


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    """int32 [n + 1] offsets of ``lengths`` (host tensor)."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(lengths.cpu(), 0)
    return out


def expand_runs(run_start: torch.Tensor, run_len: torch.Tensor, total: int) -> torch.Tensor:
    """int64 [total]: ``run_start[i] .. run_start[i] + run_len[i] - 1`` for every run, laid end to end.

    ``total`` (= ``run_len.sum()``) comes from the host, so on a GPU this neither reads the
    device nor synchronizes.
    """
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=run_start.device)
    run_start, run_len = run_start.long(), run_len.long()
    shift = torch.repeat_interleave(run_start - _starts(run_len), run_len, output_size=total)
    return shift + torch.arange(total, device=run_start.device)


# --- anchors ------------------------------------------------------------------------------------


@dataclass
class AnchorLayerInputs:
    """One layer's anchors as one paged-prefill call (module doc).

    Attributes:
        qo_indptr: int32 [n_seg + 1] host: the call's query offsets (padded queries included).
        kv_indptr: int32 [n_seg + 1] host: the call's key offsets.
        run_start: int32 [n_runs] (int64 past 2**31) first key position of each run of listed keys.
        run_len: same dtype [n_runs] its length; the runs laid end to end are the call's keys.
        row_to_qo: int64 [n_rows] the call's query that computes each layout row, -1 for a row
            that sees no key (its output is 0).
        n_rows: rows of the layout (the anchors of the layer).
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    run_start: torch.Tensor
    run_len: torch.Tensor
    row_to_qo: torch.Tensor
    n_rows: int

    @property
    def n_segments(self) -> int:
        return int(self.qo_indptr.numel()) - 1

    @property
    def n_qo(self) -> int:
        """Queries of the call (rows plus padding)."""
        return int(self.qo_indptr[-1])

    @property
    def n_kv(self) -> int:
        """Keys the call reads (``kv_indptr[-1]``)."""
        return int(self.kv_indptr[-1])

    def kv_positions(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """int64 [n_kv] the call's keys as prompt positions, expanded on ``device``."""
        device = self.run_start.device if device is None else device
        return expand_runs(to_device(self.run_start, device), to_device(self.run_len, device), self.n_kv)

    def kv_indices(self, key_rows: torch.Tensor) -> torch.Tensor:
        """int32 [n_kv] the call's keys as KV-pool slots (``key_rows[position]``), on key_rows' device."""
        return key_rows[self.kv_positions(key_rows.device)].to(torch.int32)


def anchor_prefill_inputs(layouts: Sequence[BlockSparseLayout]) -> list[AnchorLayerInputs]:
    """Every layer's anchors of one request as paged-prefill calls, in one vectorised pass.

    Args:
        layouts: per layer, the anchors' layout (same ``page_size``; CPU tensors).
    Returns:
        per layer, :class:`AnchorLayerInputs` (module doc for the segments).
    """
    with single_threaded():
        return _anchor_prefill_inputs(layouts)


def _anchor_prefill_inputs(layouts: Sequence[BlockSparseLayout]) -> list[AnchorLayerInputs]:
    if not layouts:
        return []
    ps = layouts[0].page_size
    if any(lay.page_size != ps for lay in layouts):
        raise ValueError("anchor_prefill_inputs: the layouts of one request share one page size")
    L = len(layouts)
    P = max(max(lay.n_pages for lay in layouts), 1)
    n_rows_l = [lay.n_rows for lay in layouts]
    dev = layouts[0].q_pos.device  # the planner's layouts are on the CPU: no device reads
    # Concatenated in the layouts' own dtypes; the per-entry arrays stay int32 (the largest).
    q_pos = torch.cat([lay.q_pos for lay in layouts]).long()
    rows_per_block = torch.cat([lay.row_indptr.diff() for lay in layouts]).long()
    entries_per_block = torch.cat([lay.indptr.diff() for lay in layouts])
    pages = torch.cat([lay.indices for lay in layouts]).int()
    n_keys_l = [lay.n_keys for lay in layouts]
    layer_of_block = torch.repeat_interleave(torch.arange(L, device=dev),
                                             torch.tensor([lay.n_row_blocks for lay in layouts], device=dev))
    B, R, E = int(rows_per_block.numel()), int(q_pos.numel()), int(pages.numel())

    # Listed pages as ascending keys block * P + page (the layout lists them ascending per block).
    wide = B * P >= 2**31 or P * ps >= 2**31
    kdt = torch.long if wide else torch.int32
    key = torch.repeat_interleave(torch.arange(B, dtype=kdt, device=dev), entries_per_block,
                                  output_size=E).mul_(P).add_(pages)
    if E > 1 and not bool((key[1:] > key[:-1]).all()):  # outside the contract: normalise
        key = torch.unique(key)
        pages = (key % P).to(pages.dtype)
        entries_per_block = torch.bincount(key // P, minlength=B)
        E = int(key.numel())
    entries_per_block = entries_per_block.long()
    page_start = pages.to(kdt) * ps
    if len(set(n_keys_l)) == 1:  # one request: every layer has the same keys
        entry_len = torch.sub(n_keys_l[0], page_start).clamp_(0, ps)
    else:
        block_keys = torch.repeat_interleave(torch.tensor(n_keys_l, device=dev),
                                             torch.bincount(layer_of_block, minlength=L))
        entry_len = (block_keys.index_select(0, (key // P).long()) - page_start).clamp_(0, ps).to(kdt)
    cum = torch.zeros(E + 1, dtype=torch.long, device=dev)
    torch.cumsum(entry_len, 0, dtype=torch.long, out=cum[1:])
    first_entry = _starts(entries_per_block)

    def listed_upto(block: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Keys j <= t listed for ``block`` (elementwise; consecutive equal (block, page) searched once)."""
        if E == 0:
            return torch.zeros_like(t)
        page = (t // ps).clamp(max=P - 1)
        target = block * P + page
        uniq, inverse = torch.unique_consecutive(target, return_inverse=True)
        at = torch.searchsorted(key, uniq.to(kdt)).index_select(0, inverse)  # first listed page >= page(t)
        count = cum.index_select(0, at) - cum.index_select(0, first_entry.index_select(0, block))
        at_c = at.clamp(max=E - 1)
        on_page = (at < E) & (key.index_select(0, at_c) == target)
        part = torch.minimum(t - page * ps + 1, entry_len.index_select(0, at_c).long())
        return count + torch.where(on_page, part, torch.zeros_like(part))

    block_of_row = torch.repeat_interleave(torch.arange(B, device=dev), rows_per_block, output_size=R)
    first_row = _starts(rows_per_block)  # [B] (= next block's start for an empty block)
    last_row = (first_row + rows_per_block - 1).clamp(min=0)
    has_rows = rows_per_block > 0
    is_first = torch.zeros(R, dtype=torch.bool, device=dev)
    is_first[first_row[has_rows]] = True
    seen = listed_upto(block_of_row, q_pos)  # [R] keys each row sees

    # One segment per block when its rows are strictly increasing, the first sees a key and
    # every position between its first and last row is listed (module doc).
    not_rising = torch.zeros(R, dtype=torch.bool, device=dev)
    if R > 1:
        not_rising[1:] = q_pos[1:] <= q_pos[:-1]
    broken = torch.zeros(B, dtype=torch.long, device=dev).index_add_(
        0, block_of_row, (not_rising & ~is_first).long()) > 0
    lo_row = first_row.clamp(max=max(R - 1, 0))
    if R:
        t_lo, t_hi = q_pos.index_select(0, lo_row), q_pos.index_select(0, last_row)
        seen_lo, seen_hi = seen.index_select(0, lo_row), seen.index_select(0, last_row)
        whole = has_rows & ~broken & (seen_lo >= 1) & (seen_hi - seen_lo == t_hi - t_lo)
    else:
        t_hi = torch.zeros(B, dtype=torch.long, device=dev)
        whole = torch.zeros(B, dtype=torch.bool, device=dev)

    row_whole = whole.index_select(0, block_of_row)
    kept = row_whole | (seen > 0)
    starts_seg = kept & (is_first | ~row_whole)
    seg_row = starts_seg.nonzero().squeeze(1)  # first row of each segment
    seg_block = block_of_row.index_select(0, seg_row)
    seg_whole = whole.index_select(0, seg_block)
    seg_end_row = torch.where(seg_whole, last_row.index_select(0, seg_block), seg_row)
    seg_lo = q_pos.index_select(0, seg_row)
    seg_hi = q_pos.index_select(0, seg_end_row)
    seg_kv = seen.index_select(0, seg_end_row)
    seg_qo = seg_hi - seg_lo + 1
    seg_layer = layer_of_block.index_select(0, seg_block)
    S = int(seg_row.numel())

    # Each row's query in its layer's call: its segment's first query + (t - t_lo).
    seg_of_row = torch.cumsum(starts_seg.long(), 0) - 1
    layer_qo = torch.zeros(L, dtype=torch.long, device=dev).index_add_(0, seg_layer, seg_qo)
    qo_local = _starts(seg_qo) - _starts(layer_qo).index_select(0, seg_layer)
    seg_c = seg_of_row.clamp(min=0)
    row_to_qo = qo_local.index_select(0, seg_c) + q_pos - seg_lo.index_select(0, seg_c) if S else seg_of_row
    row_to_qo = torch.where(kept, row_to_qo, torch.full_like(row_to_qo, -1))

    # Key runs: each segment takes its block's listed pages, clipped to positions <= t_hi.
    last_entry = (first_entry + entries_per_block - 1).clamp(min=0)
    with_entries = entries_per_block > 0
    one_to_one = bool((whole | ~with_entries).all())  # every block one segment (or nothing listed)
    if one_to_one and E and bool((pages.index_select(0, last_entry[with_entries])
                                  <= t_hi[with_entries] // ps).all()):
        # The usual case (relaxed and full layouts): runs are the listed pages in place, only
        # each block's last page (its diagonal page) clipped at t_hi.
        run_start, run_len = page_start, entry_len.clone()
        le = last_entry[with_entries]
        run_len[le] = torch.minimum(entry_len[le].long(), t_hi[with_entries] - page_start[le] + 1).clamp(min=0).to(kdt)
        runs_l = [lay.nnz for lay in layouts]
    else:
        runs_per_seg = entries_per_block.index_select(0, seg_block)
        n_runs = int(runs_per_seg.sum())
        run_seg = torch.repeat_interleave(torch.arange(S, device=dev), runs_per_seg, output_size=n_runs)
        run_entry = (first_entry.index_select(0, seg_block) - _starts(runs_per_seg)).index_select(0, run_seg) \
            + torch.arange(n_runs, device=dev)
        run_start = page_start.index_select(0, run_entry)
        run_len = torch.minimum(entry_len.index_select(0, run_entry),
                                seg_hi.index_select(0, run_seg) - run_start + 1).clamp(min=0)
        runs_l = torch.bincount(seg_layer.index_select(0, run_seg), minlength=L).tolist()

    segs_l = torch.bincount(seg_layer, minlength=L).tolist()
    out = []
    for l, (qo, kv, rs, rl, r2q) in enumerate(zip(
            seg_qo.split(segs_l), seg_kv.split(segs_l), run_start.split(runs_l), run_len.split(runs_l),
            row_to_qo.split(n_rows_l))):
        out.append(AnchorLayerInputs(_indptr(qo), _indptr(kv), rs, rl, r2q, n_rows_l[l]))
    return out


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

    def kv_indices(self, req_to_token: torch.Tensor) -> torch.Tensor:
        """int32 [n_kv] the call's keys as KV-pool slots, on req_to_token's device.

        Args:
            req_to_token: int [n_req_slots, max_context] SGLang's ``req_to_token`` table.
        """
        dev = req_to_token.device
        flat_start = to_device(self.seg_req * req_to_token.shape[1] + self.seg_scope, dev)
        flat = expand_runs(flat_start, to_device(self.seg_len, dev), self.n_kv)
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
    return ScopedPrefillInputs(_indptr(rows), _indptr(seg_len), req_of_row.index_select(0, first), scope, seg_len)
