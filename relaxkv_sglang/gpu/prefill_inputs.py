"""The plugin's rows as FlashInfer paged-prefill batches over SGLang's KV pool (plain torch).

Both kinds of rows become one call of FlashInfer 0.7.2's ``BatchPrefillWithPagedKVCacheWrapper``,
page size 1 (a page is one pool slot), ``causal=True``. Its causal rule is bottom-right aligned:
with ``qo_len`` queries and ``kv_len`` keys, query ``i`` sees keys ``0 .. i + kv_len - qo_len``. So a
*segment* whose queries sit at consecutive positions ``t_lo .. t_hi`` and whose key list ends with
positions ``t_lo+1 .. t_hi`` (everything before them ``<= t_lo``) gives each query its keys ``<= t``.

* **Chunk-scoped rows** (:func:`scoped_prefill_inputs`): a segment is a run of one request's rows
  with one scope start ``s`` and positions ``p0 .. p1``; keys ``req_to_token[req, s:p1+1]``, so query
  ``p`` sees ``s .. p`` (:func:`~relaxkv_sglang.core.attention.scoped_causal_attention`).
* **Anchors** (:func:`anchor_prefill_inputs`): a segment is a row block of a
  :class:`~relaxkv_sglang.core.layout.BlockSparseLayout`, queries padded to ``t_lo .. t_hi`` (at
  most ``page_size``; padding rows zero and dropped), keys the block's listed keys ``j <= t_hi``.
  Exact when every position in ``(t_lo, t_hi]`` is listed and the first anchor sees a key (always
  for relaxed and full layouts); any other block is split into one segment per row, and a row that
  sees no key gets none (output 0, as in the torch executor).

Work: each block's keys are read once for all its anchors, straight from the pool slots.
:func:`anchor_prefill_inputs` builds every layer's host metadata (``qo_indptr``/``kv_indptr``,
compact key runs) in one vectorised pass from the planner's CPU layouts;
:meth:`AnchorLayerInputs.kv_indices` expands a layer's runs on the pool's device
(``repeat_interleave`` with the size known on the host: no device-to-host copy). Figures:
docs/experiments/INDEX.md#gpu-anchor-inputs. Torch model of the call:
:func:`~relaxkv_sglang.gpu.torch_models.paged_prefill_attention`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from relaxkv_sglang.core.staging import HostStage, to_device
from relaxkv_sglang.core.layout import BlockSparseLayout

__all__ = [
    "AnchorLayerInputs",
    "ScopedPrefillInputs",
    "anchor_prefill_inputs",
    "scoped_prefill_inputs",
    "expand_runs",
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


def _starts(lengths: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum: the offset of each segment of ``lengths`` laid end to end."""
    return torch.cumsum(lengths, 0) - lengths


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    """int32 [n + 1] offsets of ``lengths`` (host tensor)."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(lengths.cpu(), 0)
    return out


def _last_page_len(kv_indptr: torch.Tensor) -> torch.Tensor:
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

    @property
    def last_page_len(self) -> torch.Tensor:
        """int32 [n_seg] host: FlashInfer reads ``clamp(pages - 1, 0) + last_page_len`` keys, so a
        segment listing no key says 0 (or it reads one past its end: ``torch_models.keys_read``)."""
        return _last_page_len(self.kv_indptr)

    @property
    def executed_pairs(self) -> int:
        """(query, key) pairs of the call: each segment's queries (padding included) times its keys."""
        return int((self.qo_indptr.diff().long() * self.kv_indptr.diff().long()).sum())

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


@dataclass
class _AnchorRows:
    """All layers' layout rows of one request, laid end to end (row blocks in layer order).

    Attributes:
        q_pos: int64 [R] each row's position.
        rows_per_block: int64 [B] rows of each row block.
        layer_of_block: int64 [B] the layer of each block.
        rows_per_layer: [L] rows of each layer's layout.
    """

    q_pos: torch.Tensor
    rows_per_block: torch.Tensor
    layer_of_block: torch.Tensor
    rows_per_layer: list[int]

    @classmethod
    def of(cls, layouts: Sequence[BlockSparseLayout]) -> "_AnchorRows":
        device = layouts[0].q_pos.device  # the planner's layouts are on the CPU: no device reads
        layer_of_block = torch.repeat_interleave(
            torch.arange(len(layouts), device=device),
            torch.tensor([lay.n_row_blocks for lay in layouts], device=device))
        return cls(torch.cat([lay.q_pos for lay in layouts]).long(),
                   torch.cat([lay.row_indptr.diff() for lay in layouts]).long(),
                   layer_of_block, [lay.n_rows for lay in layouts])

    @property
    def n_blocks(self) -> int:
        return int(self.rows_per_block.numel())

    @property
    def n_rows(self) -> int:
        return int(self.q_pos.numel())


@dataclass
class _ListedKeys:
    """All blocks' listed pages as ascending keys ``block * n_pages + page``, with their key counts.

    Attributes:
        page_size, n_pages: the layouts' page size and their largest page count (at least 1).
        key: [E] (int32, int64 when wide) ascending block * n_pages + page.
        pages: int32 [E] the page of each entry.
        entries_per_block: int64 [B].
        first_entry: int64 [B] each block's first entry.
        page_start: [E] (key's dtype) first key position of each entry's page.
        entry_len: [E] (key's dtype) keys of the page below the layer's key count.
        cum_len: int64 [E + 1] prefix sums of entry_len.
    """

    page_size: int
    n_pages: int
    key: torch.Tensor
    pages: torch.Tensor
    entries_per_block: torch.Tensor
    first_entry: torch.Tensor
    page_start: torch.Tensor
    entry_len: torch.Tensor
    cum_len: torch.Tensor

    @classmethod
    def of(cls, layouts: Sequence[BlockSparseLayout], rows: _AnchorRows) -> "_ListedKeys":
        ps = layouts[0].page_size
        n_pages = max(max(lay.n_pages for lay in layouts), 1)
        device = rows.q_pos.device
        # Concatenated in the layouts' own dtypes; the per-entry arrays stay int32 (the largest).
        entries_per_block = torch.cat([lay.indptr.diff() for lay in layouts])
        pages = torch.cat([lay.indices for lay in layouts]).int()
        n_blocks, n_entries = rows.n_blocks, int(pages.numel())
        wide = n_blocks * n_pages >= 2**31 or n_pages * ps >= 2**31
        kdt = torch.long if wide else torch.int32
        key = torch.repeat_interleave(torch.arange(n_blocks, dtype=kdt, device=device), entries_per_block,
                                      output_size=n_entries).mul_(n_pages).add_(pages)
        if n_entries > 1 and not bool((key[1:] > key[:-1]).all()):  # outside the contract: normalise
            key = torch.unique(key)
            pages = (key % n_pages).to(pages.dtype)
            entries_per_block = torch.bincount(key // n_pages, minlength=n_blocks)
            n_entries = int(key.numel())
        entries_per_block = entries_per_block.long()
        page_start = pages.to(kdt) * ps
        keys_per_layer = [lay.n_keys for lay in layouts]
        if len(set(keys_per_layer)) == 1:  # one request: every layer has the same keys
            entry_len = torch.sub(keys_per_layer[0], page_start).clamp_(0, ps)
        else:
            block_keys = torch.repeat_interleave(torch.tensor(keys_per_layer, device=device),
                                                 torch.bincount(rows.layer_of_block, minlength=len(layouts)))
            entry_len = (block_keys.index_select(0, (key // n_pages).long()) - page_start).clamp_(0, ps).to(kdt)
        cum_len = torch.zeros(n_entries + 1, dtype=torch.long, device=device)
        torch.cumsum(entry_len, 0, dtype=torch.long, out=cum_len[1:])
        return cls(ps, n_pages, key, pages, entries_per_block, _starts(entries_per_block), page_start,
                   entry_len, cum_len)

    @property
    def n_entries(self) -> int:
        return int(self.key.numel())

    def seen_upto(self, block: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """int64 [n]: keys j <= t listed for ``block`` (elementwise; consecutive equal (block, page)
        searched once)."""
        n_entries, ps, n_pages = self.n_entries, self.page_size, self.n_pages
        if n_entries == 0:
            return torch.zeros_like(t)
        page = (t // ps).clamp(max=n_pages - 1)
        target = block * n_pages + page
        uniq, inverse = torch.unique_consecutive(target, return_inverse=True)
        at = torch.searchsorted(self.key, uniq.to(self.key.dtype)).index_select(0, inverse)  # first listed page >= page(t)
        count = self.cum_len.index_select(0, at) - self.cum_len.index_select(0, self.first_entry.index_select(0, block))
        at_c = at.clamp(max=n_entries - 1)
        on_page = (at < n_entries) & (self.key.index_select(0, at_c) == target)
        part = torch.minimum(t - page * ps + 1, self.entry_len.index_select(0, at_c).long())
        return count + torch.where(on_page, part, torch.zeros_like(part))


@dataclass
class _Segments:
    """The call's segments (module doc), all layers together, and where each row's query lands.

    Attributes:
        block: int64 [S] the row block of each segment.
        layer: int64 [S] its layer.
        qo_len: int64 [S] its queries (t_hi - t_lo + 1, padding included).
        kv_len: int64 [S] its keys (the listed keys <= t_hi).
        hi: int64 [S] the position of its last query.
        whole_block: bool [B] a block that is one segment.
        block_hi: int64 [B] the position of each block's last row.
        row_to_qo: int64 [R] each row's query in its layer's call, -1 for a row that sees no key.
    """

    block: torch.Tensor
    layer: torch.Tensor
    qo_len: torch.Tensor
    kv_len: torch.Tensor
    hi: torch.Tensor
    whole_block: torch.Tensor
    block_hi: torch.Tensor
    row_to_qo: torch.Tensor

    @classmethod
    def of(cls, rows: _AnchorRows, keys: _ListedKeys) -> "_Segments":
        q_pos, rows_per_block = rows.q_pos, rows.rows_per_block
        n_blocks, n_rows, device = rows.n_blocks, rows.n_rows, q_pos.device
        block_of_row = torch.repeat_interleave(torch.arange(n_blocks, device=device), rows_per_block,
                                               output_size=n_rows)
        first_row = _starts(rows_per_block)  # [B] (= next block's start for an empty block)
        last_row = (first_row + rows_per_block - 1).clamp(min=0)
        has_rows = rows_per_block > 0
        is_first = torch.zeros(n_rows, dtype=torch.bool, device=device)
        is_first[first_row[has_rows]] = True
        seen = keys.seen_upto(block_of_row, q_pos)  # [R] keys each row sees

        # One segment per block when its rows are strictly increasing, the first sees a key and
        # every position between its first and last row is listed (module doc).
        not_rising = torch.zeros(n_rows, dtype=torch.bool, device=device)
        if n_rows > 1:
            not_rising[1:] = q_pos[1:] <= q_pos[:-1]
        broken = torch.zeros(n_blocks, dtype=torch.long, device=device).index_add_(
            0, block_of_row, (not_rising & ~is_first).long()) > 0
        lo_row = first_row.clamp(max=max(n_rows - 1, 0))
        if n_rows:
            t_lo, t_hi = q_pos.index_select(0, lo_row), q_pos.index_select(0, last_row)
            seen_lo, seen_hi = seen.index_select(0, lo_row), seen.index_select(0, last_row)
            whole = has_rows & ~broken & (seen_lo >= 1) & (seen_hi - seen_lo == t_hi - t_lo)
        else:
            t_hi = torch.zeros(n_blocks, dtype=torch.long, device=device)
            whole = torch.zeros(n_blocks, dtype=torch.bool, device=device)

        row_whole = whole.index_select(0, block_of_row)
        kept = row_whole | (seen > 0)
        starts_seg = kept & (is_first | ~row_whole)
        seg_row = starts_seg.nonzero().squeeze(1)  # first row of each segment
        seg_block = block_of_row.index_select(0, seg_row)
        seg_end_row = torch.where(whole.index_select(0, seg_block), last_row.index_select(0, seg_block), seg_row)
        seg_lo = q_pos.index_select(0, seg_row)
        seg_hi = q_pos.index_select(0, seg_end_row)
        seg_qo = seg_hi - seg_lo + 1
        seg_layer = rows.layer_of_block.index_select(0, seg_block)
        row_to_qo = _row_to_qo(q_pos, kept, starts_seg, seg_lo, seg_qo, seg_layer, len(rows.rows_per_layer))
        return cls(seg_block, seg_layer, seg_qo, seen.index_select(0, seg_end_row), seg_hi, whole, t_hi,
                   row_to_qo)


def _row_to_qo(q_pos: torch.Tensor, kept: torch.Tensor, starts_seg: torch.Tensor, seg_lo: torch.Tensor,
               seg_qo: torch.Tensor, seg_layer: torch.Tensor, n_layers: int) -> torch.Tensor:
    """int64 [R]: each kept row's query in its layer's call (its segment's first query +
    (t - t_lo)), -1 for the others. ``kept``/``starts_seg`` bool [R]; ``seg_*`` int64 [S]."""
    seg_of_row = torch.cumsum(starts_seg.long(), 0) - 1
    layer_qo = torch.zeros(n_layers, dtype=torch.long, device=q_pos.device).index_add_(0, seg_layer, seg_qo)
    qo_local = _starts(seg_qo) - _starts(layer_qo).index_select(0, seg_layer)
    seg_c = seg_of_row.clamp(min=0)
    row_to_qo = qo_local.index_select(0, seg_c) + q_pos - seg_lo.index_select(0, seg_c) if seg_lo.numel() else seg_of_row
    return torch.where(kept, row_to_qo, torch.full_like(row_to_qo, -1))


def _key_runs(layouts: Sequence[BlockSparseLayout], keys: _ListedKeys,
              segs: _Segments) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(run_start, run_len, runs per layer): each segment takes its block's listed pages, clipped
    to positions <= its last query. Runs in ``keys.key``'s dtype."""
    first_entry, entries_per_block = keys.first_entry, keys.entries_per_block
    page_start, entry_len = keys.page_start, keys.entry_len
    last_entry = (first_entry + entries_per_block - 1).clamp(min=0)
    with_entries = entries_per_block > 0
    t_hi = segs.block_hi
    one_to_one = bool((segs.whole_block | ~with_entries).all())  # every block one segment (or nothing listed)
    if one_to_one and keys.n_entries and bool((keys.pages.index_select(0, last_entry[with_entries])
                                               <= t_hi[with_entries] // keys.page_size).all()):
        # The usual case (relaxed and full layouts): runs are the listed pages in place, only
        # each block's last page (its diagonal page) clipped at t_hi.
        run_start, run_len = page_start, entry_len.clone()
        le = last_entry[with_entries]
        run_len[le] = torch.minimum(entry_len[le].long(),
                                    t_hi[with_entries] - page_start[le] + 1).clamp(min=0).to(run_len.dtype)
        return run_start, run_len, [lay.nnz for lay in layouts]
    device = segs.block.device
    runs_per_seg = entries_per_block.index_select(0, segs.block)
    n_runs = int(runs_per_seg.sum())
    run_seg = torch.repeat_interleave(torch.arange(int(segs.block.numel()), device=device), runs_per_seg,
                                      output_size=n_runs)
    run_entry = (first_entry.index_select(0, segs.block) - _starts(runs_per_seg)).index_select(0, run_seg) \
        + torch.arange(n_runs, device=device)
    run_start = page_start.index_select(0, run_entry)
    run_len = torch.minimum(entry_len.index_select(0, run_entry),
                            segs.hi.index_select(0, run_seg) - run_start + 1).clamp(min=0)
    return run_start, run_len, torch.bincount(segs.layer.index_select(0, run_seg), minlength=len(layouts)).tolist()


def _anchor_prefill_inputs(layouts: Sequence[BlockSparseLayout]) -> list[AnchorLayerInputs]:
    """rows -> listed keys -> segments -> key runs -> one :class:`AnchorLayerInputs` per layer."""
    if not layouts:
        return []
    if any(lay.page_size != layouts[0].page_size for lay in layouts):
        raise ValueError("anchor_prefill_inputs: the layouts of one request share one page size")
    rows = _AnchorRows.of(layouts)
    keys = _ListedKeys.of(layouts, rows)
    segs = _Segments.of(rows, keys)
    run_start, run_len, runs_per_layer = _key_runs(layouts, keys, segs)
    segs_per_layer = torch.bincount(segs.layer, minlength=len(layouts)).tolist()
    return [AnchorLayerInputs(_indptr(qo), _indptr(kv), starts, lengths, r2q, n_rows)
            for qo, kv, starts, lengths, r2q, n_rows in zip(
                segs.qo_len.split(segs_per_layer), segs.kv_len.split(segs_per_layer),
                run_start.split(runs_per_layer), run_len.split(runs_per_layer),
                segs.row_to_qo.split(rows.rows_per_layer), rows.rows_per_layer)]


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
        """int32 [n_seg] host (:attr:`AnchorLayerInputs.last_page_len`)."""
        return _last_page_len(self.kv_indptr)

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
    return ScopedPrefillInputs(_indptr(rows), _indptr(seg_len), req_of_row.index_select(0, first), scope, seg_len)
