"""The repair's anchors as FlashInfer paged-prefill calls over SGLang's KV pool (plain torch).

A segment (the causal rule: :mod:`.prefill_inputs`) is a row block of a
:class:`~relaxkv_sglang.attention.layout.BlockSparseLayout`, queries padded to ``t_lo .. t_hi`` (at most
``page_size``; padding rows dropped), keys the block's listed keys ``j <= t_hi``. Exact when every
position in ``(t_lo, t_hi]`` is listed and the first anchor sees a key (always for relaxed and full
layouts); any other block is split into one segment per row, and a row that sees no key gets none
(output 0, as in the torch executor). Each block's keys are read once for all its anchors, from the
pool slots. The host metadata of every layer is built in one vectorised pass from the planner's CPU
layouts; :meth:`AnchorLayerInputs.kv_indices` expands a layer's key runs on the device with the size
known on the host (no device-to-host copy). Figures: docs/experiments/INDEX.md#gpu-anchor-inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from relaxkv_sglang.attention.layout import BlockSparseLayout
from relaxkv_sglang.attention.staging import to_device
from relaxkv_sglang.attention.gpu.prefill_inputs import (
    exclusive_cumsum, expand_runs, indptr_of, last_page_lens, single_threaded,
)

__all__ = ["AnchorLayerInputs", "anchor_prefill_inputs"]


@dataclass
class AnchorLayerInputs:
    """One layer's anchors as one paged-prefill call. qo_indptr, kv_indptr int32 [n_seg + 1] host (padded
    queries included); run_start, run_len int32 [n_runs] (int64 past 2**31): the runs of listed key
    positions, end to end the call's keys; row_to_qo int64 [n_rows]: each layout row's query, -1 for a
    row that sees no key (output 0)."""

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
        return int(self.qo_indptr[-1])

    @property
    def n_kv(self) -> int:
        return int(self.kv_indptr[-1])

    @property
    def last_page_len(self) -> torch.Tensor:
        """int32 [n_seg] host; 0 for a segment of no key (else FlashInfer reads one: ``torch_models.keys_read``)."""
        return last_page_lens(self.kv_indptr)

    @property
    def executed_pairs(self) -> int:
        """Padding included."""
        return int((self.qo_indptr.diff().long() * self.kv_indptr.diff().long()).sum())

    def kv_positions(self, device: Optional[torch.device] = None, run_start: Optional[torch.Tensor] = None,
                     run_len: Optional[torch.Tensor] = None) -> torch.Tensor:
        """int64 [n_kv] prompt positions on ``device``; ``run_start`` / ``run_len``: staged runs, else copied."""
        device = self.run_start.device if device is None else device
        run_start = to_device(self.run_start, device) if run_start is None else run_start
        run_len = to_device(self.run_len, device) if run_len is None else run_len
        return expand_runs(run_start, run_len, self.n_kv)

    def kv_indices(self, key_rows: torch.Tensor, run_start: Optional[torch.Tensor] = None,
                   run_len: Optional[torch.Tensor] = None) -> torch.Tensor:
        """int32 [n_kv] KV-pool slots ``key_rows[position]``, on key_rows' device."""
        return key_rows[self.kv_positions(key_rows.device, run_start, run_len)].to(torch.int32)


def anchor_prefill_inputs(layouts: Sequence[BlockSparseLayout]) -> list[AnchorLayerInputs]:
    """One request's CPU layouts (one ``page_size``), one call per layer, in one vectorised pass."""
    with single_threaded():
        return _anchor_prefill_inputs(layouts)


@dataclass
class _AnchorRows:
    """All layers' rows end to end: q_pos int64 [R]; rows_per_block, layer_of_block int64 [B]."""

    q_pos: torch.Tensor
    rows_per_block: torch.Tensor
    layer_of_block: torch.Tensor
    rows_per_layer: list[int]

    @classmethod
    def of(cls, layouts: Sequence[BlockSparseLayout]) -> "_AnchorRows":
        device = layouts[0].q_pos.device
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
    """All blocks' listed pages: ``key`` [E] = ``block * n_pages + page`` ascending (int32; int64 when wide);
    pages int32 [E]; entries_per_block, first_entry int64 [B]; page_start, entry_len [E] in key's dtype
    (a page's first position and its keys); cum_len int64 [E + 1]."""

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
        return cls(ps, n_pages, key, pages, entries_per_block, exclusive_cumsum(entries_per_block), page_start,
                   entry_len, cum_len)

    @property
    def n_entries(self) -> int:
        return int(self.key.numel())

    def seen_upto(self, block: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """int64 [n]: keys j <= t listed for ``block``, elementwise."""
        n_entries, ps, n_pages = self.n_entries, self.page_size, self.n_pages
        if n_entries == 0:
            return torch.zeros_like(t)
        page = (t // ps).clamp(max=n_pages - 1)
        target = block * n_pages + page
        uniq, inverse = torch.unique_consecutive(target, return_inverse=True)
        # the first listed page >= page(t)
        at = torch.searchsorted(self.key, uniq.to(self.key.dtype)).index_select(0, inverse)
        count = self.cum_len.index_select(0, at) - self.cum_len.index_select(0, self.first_entry.index_select(0, block))
        at_c = at.clamp(max=n_entries - 1)
        on_page = (at < n_entries) & (self.key.index_select(0, at_c) == target)
        part = torch.minimum(t - page * ps + 1, self.entry_len.index_select(0, at_c).long())
        return count + torch.where(on_page, part, torch.zeros_like(part))


@dataclass
class _Segments:
    """All layers' segments. block, layer, qo_len (padding included), kv_len, hi (last query's position)
    int64 [S]; whole_block bool [B], block_hi int64 [B]; row_to_qo int64 [R] (-1: sees no key)."""

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
        first_row = exclusive_cumsum(rows_per_block)  # [B] (= next block's start for an empty block)
        last_row = (first_row + rows_per_block - 1).clamp(min=0)
        has_rows = rows_per_block > 0
        is_first = torch.zeros(n_rows, dtype=torch.bool, device=device)
        is_first[first_row[has_rows]] = True
        seen = keys.seen_upto(block_of_row, q_pos)  # [R] keys each row sees

        # One segment per block when its rows rise, the first sees a key and all between are listed.
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
        seg_row = starts_seg.nonzero().squeeze(1)
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
    """int64 [R]: a kept row's query in its layer's call, -1 for the others. kept, starts_seg bool [R]."""
    seg_of_row = torch.cumsum(starts_seg.long(), 0) - 1
    layer_qo = torch.zeros(n_layers, dtype=torch.long, device=q_pos.device).index_add_(0, seg_layer, seg_qo)
    qo_local = exclusive_cumsum(seg_qo) - exclusive_cumsum(layer_qo).index_select(0, seg_layer)
    seg_c = seg_of_row.clamp(min=0)
    row_to_qo = (qo_local.index_select(0, seg_c) + q_pos - seg_lo.index_select(0, seg_c) if seg_lo.numel()
                 else seg_of_row)
    return torch.where(kept, row_to_qo, torch.full_like(row_to_qo, -1))


def _key_runs(layouts: Sequence[BlockSparseLayout], keys: _ListedKeys,
              segs: _Segments) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Each segment's block's listed pages clipped to its last query, in ``keys.key``'s dtype."""
    first_entry, entries_per_block = keys.first_entry, keys.entries_per_block
    page_start, entry_len = keys.page_start, keys.entry_len
    last_entry = (first_entry + entries_per_block - 1).clamp(min=0)
    with_entries = entries_per_block > 0
    t_hi = segs.block_hi
    one_to_one = bool((segs.whole_block | ~with_entries).all())
    if one_to_one and keys.n_entries and bool((keys.pages.index_select(0, last_entry[with_entries])
                                               <= t_hi[with_entries] // keys.page_size).all()):
        # Relaxed and full layouts: the listed pages in place, only the diagonal page clipped.
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
    run_entry = (first_entry.index_select(0, segs.block) - exclusive_cumsum(runs_per_seg)).index_select(0, run_seg) \
        + torch.arange(n_runs, device=device)
    run_start = page_start.index_select(0, run_entry)
    run_len = torch.minimum(entry_len.index_select(0, run_entry),
                            segs.hi.index_select(0, run_seg) - run_start + 1).clamp(min=0)
    return run_start, run_len, torch.bincount(segs.layer.index_select(0, run_seg), minlength=len(layouts)).tolist()


def _anchor_prefill_inputs(layouts: Sequence[BlockSparseLayout]) -> list[AnchorLayerInputs]:
    if not layouts:
        return []
    if any(lay.page_size != layouts[0].page_size for lay in layouts):
        raise ValueError("anchor_prefill_inputs: the layouts of one request share one page size")
    rows = _AnchorRows.of(layouts)
    keys = _ListedKeys.of(layouts, rows)
    segs = _Segments.of(rows, keys)
    run_start, run_len, runs_per_layer = _key_runs(layouts, keys, segs)
    segs_per_layer = torch.bincount(segs.layer, minlength=len(layouts)).tolist()
    return [AnchorLayerInputs(indptr_of(qo), indptr_of(kv), starts, lengths, r2q, n_rows)
            for qo, kv, starts, lengths, r2q, n_rows in zip(
                segs.qo_len.split(segs_per_layer), segs.kv_len.split(segs_per_layer),
                run_start.split(runs_per_layer), run_len.split(runs_per_layer),
                segs.row_to_qo.split(rows.rows_per_layer), rows.rows_per_layer)]
