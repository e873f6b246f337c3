"""The GPU path checked on the CPU: the plugin's rows as FlashInfer paged-prefill calls.

FlashInfer runs only on a GPU (``python -m relaxkv_sglang.gpu_check`` there). Here the inputs
built by ``attention/gpu/anchor_inputs.py`` and ``attention/gpu/prefill_inputs.py`` (vectorised, every layer of a
request at once) are checked on
random layouts and rows: the pairs the call reads (in pool-slot space) equal the layout's visible
pairs / the scoped causal masks exactly, and the call's torch model
(``attention/gpu/torch_models.py::paged_prefill_attention``, FlashInfer's bottom-right causal rule) gives
the torch executors' outputs. FlashInfer's wrapper is then replaced by that model, with its
conventions (host indptrs, an NHD paged cache with page size 1, base-2 log-sum-exp), so what the
thin layer itself does (padding queries, slot mapping, one plan per layer, one wrapper per
planned call of a pass) is checked against ``block_sparse_attention`` and
``scoped_causal_attention``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import sys
import types

import pytest
import torch

from relaxkv_sglang.attention.causal import scoped_causal_attention
from relaxkv_sglang.attention.block_sparse import block_sparse_attention
from relaxkv_sglang.attention.layout import BlockSparseLayout, RelaxedContextSpec, build_relaxed_layout, full_causal_layout
from relaxkv_sglang.repair.selection import select_anchors
from relaxkv_sglang.gpu_check import bundle
from relaxkv_sglang.attention.gpu import flashinfer_attention
from relaxkv_sglang.attention.gpu.flashinfer_attention import (
    FLASHINFER_VERSION,
    RING_SIZE,
    FlashInferAnchorAttention,
    FlashInferScopedPrefill,
)
from relaxkv_sglang.attention.gpu.anchor_inputs import anchor_prefill_inputs
from relaxkv_sglang.attention.gpu.prefill_inputs import expand_runs, scoped_prefill_inputs
from relaxkv_sglang.attention.gpu.torch_models import (
    PagedPrefillWrapperModel,
    flashinfer_stand_in,
    paged_prefill_attention,
    paged_prefill_mask,
)

LOG2E = 1 / torch.log(torch.tensor(2.0)).item()


# --- random layouts -------------------------------------------------------------------------


def _random_spans(n: int, g: torch.Generator) -> list[tuple[int, int]]:
    """Sorted disjoint chunk spans inside [0, n), with gaps (prefix, glue) between some."""
    cuts = sorted(set(torch.randint(0, n + 1, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()))
    bounds = sorted({0, n} | set(cuts))
    spans = [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    return [sp for i, sp in enumerate(spans) if not (i == 0 and bool(torch.rand(1, generator=g) < 0.5))]


def _random_layouts(seed: int) -> list[tuple[str, BlockSparseLayout]]:
    """Relaxed, full, random-mode, select_anchors-driven, empty and arbitrary CSR layouts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for page_size in (1, 4, 16, 64):
        n = int(torch.randint(1, 400, (1,), generator=g))
        spans = _random_spans(n, g)
        scores = torch.rand(n, generator=g) ** 3
        k = int(torch.randint(0, n + 1, (1,), generator=g))
        anchors = torch.sort(torch.randperm(n, generator=g)[:k]).values
        ratio = [0.0, 0.1, 0.25, 0.5, 1.0][int(torch.randint(0, 5, (1,), generator=g))]
        sink = int(torch.randint(0, 9, (1,), generator=g))
        out.append((f"topk ps={page_size} n={n} k={k} r={ratio}",
                    build_relaxed_layout(anchors, scores, RelaxedContextSpec(spans, n, ratio, page_size, sink))))
        out.append((f"random ps={page_size} n={n}", build_relaxed_layout(
            anchors, None, RelaxedContextSpec(spans, n, ratio, page_size, mode="random"), generator=g)))
        out.append((f"full ps={page_size} n={n}", full_causal_layout(anchors, spans, n, page_size)))
        out.append((f"empty ps={page_size} n={n}", build_relaxed_layout(
            torch.zeros(0, dtype=torch.long), scores, RelaxedContextSpec(spans, n, ratio, page_size))))
        # The server's anchors: relaxkv's per-layer sets on random query scores.
        layer_scores = torch.rand(3, n, generator=g) ** 4
        context = RelaxedContextSpec(spans, n, 0.25, page_size)
        for l, a in enumerate(select_anchors("relaxkv", layer_scores, spans, n, 0.15)):
            out.append((f"relaxkv layer {l} ps={page_size} n={n}", build_relaxed_layout(a, layer_scores[l], context)))
        # Arbitrary CSR: empty row blocks, rows with no fully visible page, pages after rows,
        # several partially visible pages per block.
        n_rows = int(torch.randint(0, 30, (1,), generator=g))
        q_pos = torch.sort(torch.randint(0, n, (n_rows,), generator=g)).values
        n_rb = int(torch.randint(1, 8, (1,), generator=g))
        cuts = torch.sort(torch.randint(0, n_rows + 1, (n_rb - 1,), generator=g)).values
        row_indptr = torch.cat([torch.tensor([0]), cuts, torch.tensor([n_rows])])
        n_pages = (n + page_size - 1) // page_size
        density = float(torch.rand(1, generator=g))
        page_mask = torch.rand(n_rb, n_pages, generator=g) < density
        out.append((f"csr ps={page_size} n={n} rows={n_rows} blocks={n_rb}",
                    BlockSparseLayout.from_page_mask(q_pos, row_indptr, page_mask, page_size, n)))
    return out




def _edge_layouts() -> list[tuple[str, BlockSparseLayout]]:
    """No rows at all; rows only on the first page; one page larger than the context; pages listed
    out of order and repeated positions (beyond the layout's contract); holes on the diagonal."""
    empty = BlockSparseLayout.from_page_mask(torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.int32),
                                             torch.zeros(0, 3, dtype=torch.bool), 4, 10)
    first_page = build_relaxed_layout(torch.tensor([1, 3, 6]), torch.linspace(0, 1, 40),
                                      RelaxedContextSpec([(0, 40)], 40, 0.5, 8, sink_tokens=1))
    big_page = full_causal_layout(torch.tensor([0, 5, 9]), [(2, 10)], 10, 64)
    shuffled = BlockSparseLayout(q_pos=torch.tensor([9, 12, 30, 31]),
                                 row_indptr=torch.tensor([0, 2, 4], dtype=torch.int32),
                                 indptr=torch.tensor([0, 3, 5], dtype=torch.int32),
                                 indices=torch.tensor([3, 0, 2, 7, 1], dtype=torch.int32), page_size=4, n_keys=33)
    repeated = BlockSparseLayout(q_pos=torch.tensor([5, 5, 7, 20]),
                                 row_indptr=torch.tensor([0, 3, 4], dtype=torch.int32),
                                 indptr=torch.tensor([0, 2, 4], dtype=torch.int32),
                                 indices=torch.tensor([0, 1, 2, 5], dtype=torch.int32), page_size=4, n_keys=24)
    # Block 0: rows 9 and 14 with page 2 (8..11) listed but page 3 (12..15) not: a hole between them.
    hole = BlockSparseLayout(q_pos=torch.tensor([9, 14, 2]), row_indptr=torch.tensor([0, 2, 3], dtype=torch.int32),
                             indptr=torch.tensor([0, 2, 3], dtype=torch.int32),
                             indices=torch.tensor([0, 2, 1], dtype=torch.int32), page_size=4, n_keys=16)
    return [("empty", empty), ("first page", first_page), ("big page", big_page), ("shuffled", shuffled),
            ("repeated", repeated), ("hole", hole)]


def _slot_case(layout: BlockSparseLayout, seed: int):
    g = torch.Generator().manual_seed(seed)
    pool = 2 * layout.n_keys + 5
    key_rows = torch.randperm(pool, generator=g)[:layout.n_keys]
    k_cache, v_cache = torch.randn(pool, 2, 8, generator=g), torch.randn(pool, 2, 8, generator=g)
    q = torch.randn(layout.n_rows, 4, 8, generator=g)
    return key_rows, q, k_cache, v_cache


def _through_model(inputs, key_rows, q, k_cache, v_cache, scale=None):
    """The layer's padding and mapping around the torch model of FlashInfer's call."""
    kept = inputs.row_to_qo >= 0
    q_call = q.new_zeros(inputs.n_qo, q.shape[1], q.shape[2])
    q_call[inputs.row_to_qo[kept]] = q[kept]
    o, lse = paged_prefill_attention(q_call, k_cache, v_cache, inputs.qo_indptr, inputs.kv_indptr,
                                     inputs.kv_indices(key_rows), scale=scale, return_lse=True)
    out = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
    out_lse = torch.full((q.shape[0], q.shape[1]), float("-inf"))
    out[kept], out_lse[kept] = o[inputs.row_to_qo[kept]], lse[inputs.row_to_qo[kept]]
    return out, out_lse


def _check_layout(name: str, layout: BlockSparseLayout, inputs, seed: int, lse: bool = False) -> None:
    key_rows, q, k_cache, v_cache = _slot_case(layout, seed)
    n_slots = k_cache.shape[0]
    # The pairs the call reads, mapped back to layout rows, are exactly the layout's visible pairs.
    kvi = inputs.kv_indices(key_rows)
    assert kvi.dtype == torch.int32 and kvi.numel() == inputs.n_kv == int(inputs.run_len.sum()), name
    assert inputs.qo_indptr.dtype == torch.int32 and inputs.kv_indptr.dtype == torch.int32, name
    call_mask = paged_prefill_mask(inputs.qo_indptr, inputs.kv_indptr, kvi, n_slots)
    kept = inputs.row_to_qo >= 0
    got = torch.zeros(layout.n_rows, n_slots, dtype=torch.bool)
    got[kept] = call_mask[inputs.row_to_qo[kept]]
    want = torch.zeros(layout.n_rows, n_slots, dtype=torch.bool)
    want[:, key_rows] = layout.to_dense_mask()
    assert torch.equal(got, want), name
    # Every request satisfies FlashInfer's causal precondition kv_len >= qo_len; rows without a
    # key have no query; each row its own query.
    assert bool((inputs.kv_indptr.diff() >= inputs.qo_indptr.diff()).all()), name
    assert torch.equal(kept, want.any(dim=1)), name
    assert inputs.row_to_qo[kept].unique().numel() == int(kept.sum()), name
    out, out_lse = _through_model(inputs, key_rows, q, k_cache, v_cache)
    if lse:  # the per-block reference (slow): the edge layouts
        ref, ref_lse = block_sparse_attention(q, k_cache, v_cache, layout, return_lse=True, key_rows=key_rows)
        torch.testing.assert_close(out_lse, ref_lse, atol=1e-5, rtol=1e-5, msg=name)
    else:
        ref = block_sparse_attention(q, k_cache, v_cache, layout, key_rows=key_rows)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("seed", range(6))
def test_anchor_inputs_read_exactly_the_layout(seed):
    """Every page size's layouts built together (as one request's layers) and each alone."""
    layouts = _random_layouts(seed)
    assert {name.split()[0] for name, _ in layouts} == {"topk", "random", "full", "empty", "relaxkv", "csr"}
    for page_size in (1, 4, 16, 64):
        group = [(name, lay) for name, lay in layouts if lay.page_size == page_size]
        together = anchor_prefill_inputs([lay for _, lay in group])
        assert len(together) == len(group)
        for i, ((name, lay), inputs) in enumerate(zip(group, together)):
            _check_layout(name, lay, inputs, seed * 100 + i)
            alone = anchor_prefill_inputs([lay])[0]
            for field in ("qo_indptr", "kv_indptr", "row_to_qo"):
                assert torch.equal(getattr(alone, field), getattr(inputs, field)), (name, field)
            assert torch.equal(alone.kv_positions(), inputs.kv_positions()), name


def test_anchor_inputs_of_edge_layouts():
    for i, (name, layout) in enumerate(_edge_layouts()):
        _check_layout(name, layout, anchor_prefill_inputs([layout])[0], i, lse=True)
    edges = dict(_edge_layouts())
    assert anchor_prefill_inputs([edges["empty"]])[0].n_segments == 0
    assert anchor_prefill_inputs([edges["empty"]])[0].n_kv == 0
    # Broken blocks fall back to one query per row: repeated positions, a hole between rows; a
    # row that sees no key gets no query.
    assert int(anchor_prefill_inputs([edges["repeated"]])[0].qo_indptr.diff().max()) == 1
    hole = anchor_prefill_inputs([edges["hole"]])[0]
    assert hole.qo_indptr.diff().tolist() == [1, 1] and hole.row_to_qo.tolist() == [0, 1, -1]


def test_relaxed_layouts_take_one_padded_segment_per_row_block():
    """The server's layouts: one call request per row block, at most page_size queries each,
    keys = exactly the layout's visible pairs counted per segment end."""
    g = torch.Generator().manual_seed(3)
    n, spans = 900, [(8, 300), (300, 620), (620, 900)]
    scores = torch.rand(4, n, generator=g) ** 4
    sets = select_anchors("relaxkv", scores, spans, n, 0.15)
    layouts = [build_relaxed_layout(a, scores[l], RelaxedContextSpec(spans, n, 0.25, 16)) for l, a in enumerate(sets)]
    for layout, inputs in zip(layouts, anchor_prefill_inputs(layouts)):
        assert inputs.n_segments == layout.n_row_blocks
        assert int(inputs.qo_indptr.diff().max()) <= 16
        assert bool((inputs.row_to_qo >= 0).all())
        # A block's keys: its pages up to its last anchor (every anchor sees its own position).
        assert inputs.n_kv >= layout.kv_pairs() / int(layout.row_indptr.diff().max())


def test_expand_runs():
    assert expand_runs(torch.tensor([5, 0, 9]), torch.tensor([2, 0, 3]), 5).tolist() == [5, 6, 9, 10, 11]
    assert expand_runs(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 0).numel() == 0


# --- chunk-scoped rows ----------------------------------------------------------------------


def _random_batch(seed: int):
    """Requests of an extend batch as the fold leaves them: cached prefix, chunks kept as misses
    (scoped to themselves) or dropped as hits, glue and query rows with scope 0."""
    g = torch.Generator().manual_seed(seed)
    n_req = int(torch.randint(1, 5, (1,), generator=g))
    max_ctx = 200
    req_to_token = torch.randperm(n_req * max_ctx + 7, generator=g)[:n_req * max_ctx].view(n_req, max_ctx)
    reqs = []
    for rp in torch.randperm(n_req, generator=g).tolist():
        pre = int(torch.randint(0, 40, (1,), generator=g))
        end = pre + int(torch.randint(1, 120, (1,), generator=g))
        cuts = sorted(set(torch.randint(pre, end, (int(torch.randint(0, 6, (1,), generator=g)),),
                                        generator=g).tolist()) | {pre, end})
        pos, scope = [], []
        for s, e in zip(cuts[:-1], cuts[1:]):
            kind = int(torch.randint(0, 3, (1,), generator=g))  # 0 ordinary, 1 miss, 2 hit (dropped)
            if kind == 2 and e != end:
                continue
            pos += list(range(s, e))
            scope += [s if kind == 1 else 0] * (e - s)
        reqs.append((rp, torch.tensor(pos), torch.tensor(scope)))
    return reqs, req_to_token


@pytest.mark.parametrize("seed", range(12))
def test_scoped_inputs_read_exactly_the_scoped_masks(seed):
    reqs, req_to_token = _random_batch(seed)
    req_of_row = torch.cat([torch.full((p.numel(),), rp) for rp, p, _ in reqs])
    pos = torch.cat([p for _, p, _ in reqs])
    scope = torch.cat([s for _, _, s in reqs])
    inputs = scoped_prefill_inputs(req_of_row, pos, scope)
    assert inputs.qo_indptr.dtype == torch.int32 and int(inputs.qo_indptr[-1]) == pos.numel()
    kvi = inputs.kv_indices(req_to_token)
    n_slots = int(req_to_token.max()) + 1
    got = paged_prefill_mask(inputs.qo_indptr, inputs.kv_indptr, kvi, n_slots)
    want = torch.zeros(pos.numel(), n_slots, dtype=torch.bool)
    j = torch.arange(req_to_token.shape[1])
    for i in range(pos.numel()):  # the scoped causal mask: keys scope..pos of the row's request
        visible = (j >= scope[i]) & (j <= pos[i])
        want[i, req_to_token[req_of_row[i], visible]] = True
    assert torch.equal(got, want)
    # Outputs: the torch model of the call equals scoped_causal_attention, request by request.
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = torch.randn(n_slots, 2, 8, generator=g), torch.randn(n_slots, 2, 8, generator=g)
    q = torch.randn(pos.numel(), 6, 8, generator=g)
    out = paged_prefill_attention(q, k_cache, v_cache, inputs.qo_indptr, inputs.kv_indptr, kvi, scale=0.3)
    start = 0
    for rp, p, s in reqs:
        r = slice(start, start + p.numel())
        ref = scoped_causal_attention(q[r], k_cache, v_cache, p, s, req_to_token[rp], scale=0.3)
        torch.testing.assert_close(out[r], ref, atol=1e-5, rtol=1e-5)
        start += p.numel()


def test_scoped_segments_split_on_request_scope_and_gaps():
    req = torch.tensor([0, 0, 0, 0, 0, 1, 1])
    pos = torch.tensor([4, 5, 6, 9, 10, 0, 1])
    scope = torch.tensor([4, 4, 0, 0, 0, 0, 0])
    inputs = scoped_prefill_inputs(req, pos, scope)
    assert inputs.qo_indptr.tolist() == [0, 2, 3, 5, 7]
    assert inputs.seg_scope.tolist() == [4, 0, 0, 0] and inputs.seg_len.tolist() == [2, 7, 11, 2]
    assert inputs.kv_indptr.tolist() == [0, 2, 9, 20, 22]


# --- the layer, with FlashInfer replaced by the torch model ----------------------------------


@pytest.fixture
def flashinfer_model(monkeypatch):
    module = flashinfer_stand_in(FLASHINFER_VERSION)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    PagedPrefillWrapperModel.created = 0
    return module


def _request(seed: int, n: int = 90, n_layers: int = 3, page_size: int = 8):
    g = torch.Generator().manual_seed(seed)
    spans = [(4, 30), (30, 61), (61, n)]
    scores = torch.rand(n_layers, n, generator=g) ** 3
    sets = select_anchors("relaxkv", scores, spans, n, 0.3)
    context = RelaxedContextSpec(spans, n, 0.3, page_size)
    layouts = [build_relaxed_layout(a, scores[l], context) for l, a in enumerate(sets)]
    layouts[-1] = full_causal_layout(sets[-1], spans, n, page_size)
    pool = 3 * n
    key_rows = torch.randperm(pool, generator=g)[:n]
    k_cache, v_cache = torch.randn(pool, 2, 16, generator=g), torch.randn(pool, 2, 16, generator=g)
    qs = [torch.randn(a.numel(), 6, 16, generator=g) for a in sets]
    return layouts, key_rows, qs, k_cache, v_cache


@pytest.mark.parametrize("seed", range(3))
def test_anchor_layer_equals_the_torch_executor(flashinfer_model, seed):
    layouts, key_rows, qs, k_cache, v_cache = _request(seed)
    attn = FlashInferAnchorAttention("cpu", workspace_bytes=16)
    plan = attn.pass_metadata(layouts)
    for l, (layout, q) in enumerate(zip(layouts, qs)):
        got = attn.run(plan, l, q, k_cache, v_cache, key_rows, 0.3)
        want = block_sparse_attention(q, k_cache, v_cache, layout, scale=0.3, key_rows=key_rows)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # One planned call per layer, the wrappers taken in turn from a bounded ring (FlashInfer
    # stages plans in a pinned buffer per wrapper); a new pass carries on round the same ring.
    calls = attn._ring.calls
    assert len(layouts) == 3 and len(calls) == 3 and all(c.wrapper.plans == 1 for c in calls)
    for l in range(2):
        attn.run(plan, l, qs[l], k_cache, v_cache, key_rows, 0.3)
    assert len(attn._ring.calls) == RING_SIZE and [c.wrapper.plans for c in calls] == [2, 1, 1, 1]


def test_a_wrapper_is_planned_again_only_after_its_last_run(flashinfer_model):
    """The ring on a CUDA pool, modelled with fake events: a wrapper's plan waits for the event
    recorded after its previous plan (FlashInfer's staged copy of its schedule), so the wrapper's
    page-locked buffer is never overwritten in flight; each wait is counted."""
    layouts, key_rows, qs, k_cache, v_cache = _request(3)
    attn = FlashInferAnchorAttention("cpu", workspace_bytes=16)
    log = []

    class Event:
        def __init__(self):
            self.n = sum(1 for e in log if e[0] == "record")

        def record(self):
            log.append(("record", self.n))

        def query(self):  # the device is behind: every wait is a real one
            return False

        def synchronize(self):
            log.append(("wait", self.n))

    attn._ring.new_event = Event
    plan = attn.pass_metadata(layouts)
    for turn in range(2 * RING_SIZE):
        attn.run(plan, turn % len(layouts), qs[turn % len(layouts)], k_cache, v_cache, key_rows, 0.3)
    assert len(attn._ring.calls) == RING_SIZE
    # plans 0..7 record events 0..7; the second round's plans wait for the first round's events
    assert [e for e in log if e[0] == "wait"] == [("wait", i) for i in range(RING_SIZE)]
    assert log.index(("wait", 0)) > log.index(("record", RING_SIZE - 1))
    assert attn.host_waits == RING_SIZE


def test_anchor_layer_refuses_wrong_rows(flashinfer_model):
    layouts, key_rows, qs, k_cache, v_cache = _request(5)
    attn = FlashInferAnchorAttention("cpu", workspace_bytes=16)
    with pytest.raises(ValueError, match="rows"):
        attn.run(attn.pass_metadata(layouts), 0, qs[0][1:], k_cache, v_cache, key_rows, 0.3)


def test_anchor_attention_plans_a_request_once_per_pass(flashinfer_model, monkeypatch):
    """The layer loop's executor on the GPU path: one host build per request and pass (all its
    layers), a layout decided in the layer planned alone."""
    from relaxkv_sglang.attention.staging import HostStage
    from relaxkv_sglang.attention.sglang.anchor_attention import AnchorAttention

    builds = []
    real = flashinfer_attention.anchor_prefill_inputs

    def counting(layouts):
        builds.append(len(layouts))
        return real(layouts)

    monkeypatch.setattr(flashinfer_attention, "anchor_prefill_inputs", counting)
    monkeypatch.setattr(AnchorAttention, "uses_flashinfer", staticmethod(lambda device, dtype: True))
    layouts, key_rows, qs, k_cache, v_cache = _request(7)
    anchors = AnchorAttention()
    stage = HostStage("cpu")
    planned = anchors.plan(layouts, stage, k_cache.dtype)
    stage.send()
    for l, (layout, q) in enumerate(zip(layouts, qs)):
        got = planned.run(l, q, k_cache, v_cache, key_rows, 0.3)
        torch.testing.assert_close(got, block_sparse_attention(q, k_cache, v_cache, layout, scale=0.3,
                                                               key_rows=key_rows), atol=1e-5, rtol=1e-5)
    assert builds == [len(layouts)]
    decided_in_layer = build_relaxed_layout(layouts[1].q_pos, torch.rand(90),
                                            RelaxedContextSpec([(4, 30), (30, 61), (61, 90)], 90, 0.5, 8))
    got = anchors(qs[1], k_cache, v_cache, decided_in_layer, 0.3, key_rows)
    torch.testing.assert_close(got, block_sparse_attention(qs[1], k_cache, v_cache, decided_in_layer, scale=0.3,
                                                           key_rows=key_rows), atol=1e-5, rtol=1e-5)
    assert builds == [len(layouts), 1]


@pytest.mark.parametrize("seed", range(3))
def test_scoped_prefill_plans_once_and_equals_the_torch_path(flashinfer_model, seed):
    reqs, req_to_token = _random_batch(seed)
    req_of_row = torch.cat([torch.full((p.numel(),), rp) for rp, p, _ in reqs])
    inputs = scoped_prefill_inputs(req_of_row, torch.cat([p for _, p, _ in reqs]), torch.cat([s for _, _, s in reqs]))
    n_slots = int(req_to_token.max()) + 1
    g = torch.Generator().manual_seed(seed)
    scoped = FlashInferScopedPrefill("cpu", workspace_bytes=16)
    scoped.plan(inputs, req_to_token, num_qo_heads=6, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                kv_dtype=torch.float32, scale=0.3)
    for _layer in range(3):  # the same plan serves every layer
        k_cache, v_cache = torch.randn(n_slots, 2, 8, generator=g), torch.randn(n_slots, 2, 8, generator=g)
        q = torch.randn(req_of_row.numel(), 6, 8, generator=g)
        got, start = scoped.run(q, k_cache, v_cache), 0
        for rp, p, s in reqs:
            r = slice(start, start + p.numel())
            want = scoped_causal_attention(q[r], k_cache, v_cache, p, s, req_to_token[rp], scale=0.3)
            torch.testing.assert_close(got[r], want, atol=1e-5, rtol=1e-5)
            start += p.numel()
    assert sum(c.wrapper.plans for c in scoped._ring.calls) == 1


def test_scoped_prefill_run_before_plan_is_refused(flashinfer_model):
    with pytest.raises(RuntimeError, match="before plan"):
        FlashInferScopedPrefill("cpu", workspace_bytes=16).run(torch.zeros(1, 2, 4), torch.zeros(3, 1, 4),
                                                               torch.zeros(3, 1, 4))


def test_gpu_check_runs_its_cases_on_the_torch_model(flashinfer_model, monkeypatch):
    """The GPU check's case code end to end on the CPU (FlashInfer replaced by its model, no
    timing): what runs on the lent GPU is not run there for the first time."""
    from relaxkv_sglang.gpu_check import kernels

    monkeypatch.setattr(kernels, "device_ms", lambda fn, repeats: (fn(), 1.0)[1])
    for case in (kernels.Case("anchors", "tiny", 4, 2, 16, 300, 16, 0.25),
                 kernels.Case("anchors", "tiny", 4, 2, 16, 250, 64, 1.0),
                 kernels.Case("scoped", "tiny", 4, 2, 16, 300)):
        run = kernels.run_anchors if case.kind == "anchors" else kernels.run_scoped
        r = run(case, torch.device("cpu"), flashinfer_model, 1, 0)
        assert r["ok"] and r["max_abs_err"] < kernels.TOLERANCE, r
        assert r["keys_read"] > 0 and r["dense_prefill_ms"] == 1.0
    assert len(kernels.default_cases()) == 28
    assert {c.kind for c in kernels.default_cases()} == {"anchors", "scoped"}


def test_the_repair_check_compares_its_pass_with_the_cpu_run():
    """The device check of the repair pass, run with the CPU as its device: float32 equals the
    reference run exactly, bfloat16 within the check's tolerance (what a GPU run is held to)."""
    from relaxkv_sglang.gpu_check.repair import TOLERANCE, RepairCase, run_repair

    rows = run_repair(torch.device("cpu"), seed=1, case=RepairCase(n_context=384, n_layers=2, n_chunks=4, query=16))
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"] and all(r["ok"] for r in rows)
    assert rows[0]["max_abs_err"] == 0.0 and 0 < rows[1]["max_abs_err"] <= TOLERANCE["bfloat16"]
    assert rows[0]["anchor_layers"] > 0


def test_other_flashinfer_version_is_refused(flashinfer_model):
    flashinfer_model.__version__ = "0.6.0"
    with pytest.raises(RuntimeError, match="written for 0.7.2"):
        flashinfer_attention.import_flashinfer()


def test_pin_is_the_version_sglang_requires():
    required = [r for r in importlib.metadata.requires("sglang") if r.lower().startswith("flashinfer_python")
                and "extra" not in r]
    assert required, "sglang no longer names flashinfer_python"
    assert any(r.endswith(f"=={FLASHINFER_VERSION}") for r in required), required
    assert bundle.FLASHINFER_WHEEL.version == FLASHINFER_VERSION


def test_bundle_keeps_python_and_prefill_sources_only():
    assert bundle.kept("flashinfer/sparse.py") and bundle.kept("flashinfer/jit/attention/modules.py")
    assert bundle.kept("flashinfer/data/csrc/batch_prefill.cu")
    assert bundle.kept("flashinfer/data/csrc/tvm_ffi_utils.h")
    assert bundle.kept("flashinfer/data/include/flashinfer/attention/prefill.cuh")
    assert bundle.kept("flashinfer/data/cutlass/include/cute/tensor.hpp")
    assert not bundle.kept("flashinfer/data/csrc/trtllm_alltoall.cu")
    assert not bundle.kept("flashinfer/data/cutlass/examples/00_basic_gemm/basic_gemm.cu")
    assert not bundle.kept("flashinfer/fused_moe/backends/x.cu")


# --- the composed backend: which batches go where ----------------------------------------------


def _rows(*specs):
    """ExtendRows from (req_pool_idx, positions, scopes), laid end to end."""
    from relaxkv_sglang.attention.extend_rows import ExtendRows

    rows, start = [], 0
    for rp, pos, scope in specs:
        rows.append(ExtendRows(rp, start, torch.tensor(pos, dtype=torch.int64), torch.tensor(scope, dtype=torch.int64)))
        start += len(pos)
    return rows


def test_attention_path_table():
    from relaxkv_sglang.attention.sglang.attention_paths import SCOPED, SGLANG, attention_path

    def never():
        raise AssertionError("rows inspected")

    from relaxkv_sglang.attention.extend_rows import FoldedRows

    folded = FoldedRows(_rows((0, [5, 6, 7], [5, 5, 5])))
    scores = FoldedRows(_scored(folded.extend_rows))
    cases = [
        # (is_extend, folded rows, ordinary rows?, path)
        (False, None, never, SGLANG),       # decode / idle, and every decode CUDA-graph capture
        (False, folded, never, SGLANG),     # a decode step never takes the plugin's path
        (True, None, never, SGLANG),        # ordinary prefill; prefill CUDA-graph capture
        (True, scores, never, SCOPED),      # the backend records the query's scores
        (True, folded, lambda: True, SGLANG),   # a fold that changed nothing
        (True, folded, lambda: False, SCOPED),  # misses scoped to their chunk, hits dropped
    ]
    for is_extend, rows, ordinary, want in cases:
        assert attention_path(is_extend, rows, ordinary) == want, (is_extend, rows is not None, want)


def _scored(rows):
    """``rows`` with a scores recorder each (a repair's query pass)."""
    from relaxkv_sglang.attention.extend_rows import QueryScores

    return [dataclasses.replace(r, scores=QueryScores(0, 1, torch.zeros(1, dtype=torch.int64))) for r in rows]


def test_rows_are_contiguous_tails():
    from relaxkv_sglang.attention.sglang.attention_paths import rows_are_contiguous_tails

    tails = _rows((3, [4, 5, 6], [0, 0, 0]), (1, [0, 1], [0, 0]))
    assert rows_are_contiguous_tails(tails, [4, 0], [3, 2])
    assert not rows_are_contiguous_tails(tails, [4, 0], [3, 3])  # a row dropped (a chunk hit)
    assert not rows_are_contiguous_tails(tails, [3, 0], [3, 2])  # positions not the tail
    assert not rows_are_contiguous_tails(tails[:1], [4, 0], [3, 2])
    assert not rows_are_contiguous_tails(_rows((3, [4, 5, 6], [0, 4, 4]), (1, [0, 1], [0, 0])), [4, 0], [3, 2])
    assert not rows_are_contiguous_tails(_rows((3, [4, 6, 7], [0, 0, 0])), [4], [3])  # a gap
    assert rows_are_contiguous_tails(_rows((3, [], []), (1, [0], [0])), [9, 0], [0, 1])


class _FakeMode:
    def __init__(self, extend: bool):
        self.extend = extend

    def is_extend(self):
        return self.extend


class _FakePool:
    def __init__(self, k_cache, v_cache):
        self.k, self.v, self.writes = k_cache, v_cache, []

    def set_kv_buffer(self, layer, loc, k, v):
        self.writes.append((layer.layer_id, loc.loc.clone(), loc.physical))
        self.k[loc.loc] = k.view(self.k[loc.loc].shape)
        self.v[loc.loc] = v.view(self.v[loc.loc].shape)

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v


def test_cuda_backend_routes_only_folded_batches_to_the_plugin(monkeypatch):
    """The CUDA class on fake batches: SGLang's FlashInfer methods for ordinary work (planning,
    extend, prefill CUDA graphs), the plugin's scoped prefill for a batch the fold changed
    (planned once for all layers, equal to the torch path), nothing for a repair pass."""
    # SGLang's module first (it probes for the real flashinfer), then the torch model in its place.
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    from relaxkv_sglang.attention.sglang.attention_backend import build_cuda_backend_class
    from relaxkv_sglang.attention.extend_rows import FoldedRows
    from relaxkv_sglang.runtime import records

    def attach_context(backend, rows):  # what the forward attaches for one forward (forward/context.py)
        records.detach(backend, FoldedRows)
        if rows is not None:
            records.attach(backend, rows)

    flashinfer_model.__wrapped__(monkeypatch)

    calls = []
    monkeypatch.setattr(FlashInferAttnBackend, "init_forward_metadata", lambda self, fb: calls.append(("plan", fb)))
    monkeypatch.setattr(FlashInferAttnBackend, "forward_extend",
                        lambda self, q, k, v, layer, fb, save_kv_cache=True: calls.append(("extend", fb)) or q)
    cls = build_cuda_backend_class()
    backend = object.__new__(cls)  # no GPU: the state __init__ would build, by hand
    g = torch.Generator().manual_seed(0)
    n_slots, H, HKV, D = 64, 4, 2, 8
    pool = _FakePool(torch.randn(n_slots, HKV, D, generator=g), torch.randn(n_slots, HKV, D, generator=g))
    req_to_token = torch.randperm(n_slots, generator=g)[:2 * 30].view(2, 30)
    backend.token_to_kv_pool = pool
    backend.req_to_token_pool = types.SimpleNamespace(req_to_token=req_to_token)
    backend._scoped = FlashInferScopedPrefill("cpu", workspace_bytes=16)
    backend._scoped_batch = None
    backend._path = (None, None, "sglang")
    layers = [types.SimpleNamespace(layer_id=i, is_cross_attention=False, tp_q_head_num=H, qk_head_dim=D, v_head_dim=D,
                                    scaling=0.3) for i in range(3)]

    def batch(extend, prefix, lens):
        return types.SimpleNamespace(forward_mode=_FakeMode(extend), extend_prefix_lens_cpu=prefix,
                                     extend_seq_lens_cpu=lens, out_cache_loc=None, out_cache_loc_is_physical=True)

    # Decode and an ordinary prefill: SGLang's planning and kernels, prefill graphs allowed.
    for fb in (batch(False, None, None), batch(True, [4, 0], [3, 2])):
        attach_context(backend, None)
        calls.clear()
        backend.init_forward_metadata(fb)
        assert calls == [("plan", fb)] and backend.can_run_prefill_cuda_graph(fb)
        if fb.forward_mode.is_extend():
            q = torch.randn(5, H * D)
            assert backend.forward_extend(q, q, q, layers[0], fb) is q and calls[-1] == ("extend", fb)
    # A fold that left every tail as it was: still SGLang's.
    fb = batch(True, [4, 0], [3, 2])
    attach_context(backend, FoldedRows(_rows((0, [4, 5, 6], [0, 0, 0]), (1, [0, 1], [0, 0]))))
    calls.clear()
    backend.init_forward_metadata(fb)
    assert calls == [("plan", fb)] and backend.can_run_prefill_cuda_graph(fb)
    # The same rows carrying a repair that records no scores (epic, cacheblend): SGLang's kernels,
    # but never its prefill graph, whose replay would bypass the model hook that runs the repair.
    attach_context(backend, FoldedRows(_rows((0, [4, 5, 6], [0, 0, 0]), (1, [0, 1], [0, 0])), repairs=True))
    calls.clear()
    backend.init_forward_metadata(fb)
    assert calls == [("plan", fb)] and not backend.can_run_prefill_cuda_graph(fb)
    # A repair's query pass (records the query's scores) over ordinary tails: the plugin's path,
    # so no SGLang planning and no graph.
    fb = batch(True, [0], [6])
    attach_context(backend, FoldedRows(_scored(_rows((0, list(range(6)), [0] * 6)))))
    calls.clear()
    backend.init_forward_metadata(fb)
    assert calls == [] and backend.forward_metadata is None and not backend.can_run_prefill_cuda_graph(fb)
    # A folded batch: request 0 keeps a miss scoped to [10, 14) and the query 20..22 (a hit at
    # 14..20 dropped); request 1 is an ordinary tail. The plugin's path, planned once.
    rows = _rows((0, [10, 11, 12, 13, 20, 21, 22], [10, 10, 10, 10, 0, 0, 0]), (1, [3, 4, 5], [0, 0, 0]))
    fb = batch(True, [10, 3], [12, 3])
    fb.out_cache_loc = torch.cat([req_to_token[0, rows[0].positions], req_to_token[1, rows[1].positions]])
    attach_context(backend, FoldedRows(rows))
    calls.clear()
    backend.init_forward_metadata(fb)
    assert calls == [] and not backend.can_run_prefill_cuda_graph(fb)
    for layer in layers:
        q, k, v = (torch.randn(10, n * D, generator=g) for n in (H, HKV, HKV))
        got = backend.forward_extend(q, k, v, layer, fb).view(10, H, D)
        assert torch.equal(pool.writes[-1][1], fb.out_cache_loc) and pool.writes[-1][2]  # the physical mark kept
        start = 0
        for r in rows:
            sl = slice(start, start + r.n_rows)
            want = scoped_causal_attention(q.view(10, H, D)[sl], pool.k, pool.v, r.positions, r.scope_start,
                                           req_to_token[r.req_pool_idx], scale=0.3)
            torch.testing.assert_close(got[sl], want, atol=1e-5, rtol=1e-5)
            start += r.n_rows
    assert calls == [] and sum(c.wrapper.plans for c in backend._scoped._ring.calls) == 1
    attach_context(backend, None)


def test_the_stand_in_reads_keys_as_flashinfer_does():
    from relaxkv_sglang.attention.gpu.torch_models import keys_read

    kv_indptr = torch.tensor([0, 3, 3, 5], dtype=torch.int32)  # segment 1 lists no key
    assert keys_read(kv_indptr, torch.tensor([1, 0, 1])).tolist() == [3, 0, 2]
    with pytest.raises(ValueError, match="read 1 keys of segment 1, which lists 0 pages"):
        keys_read(kv_indptr, torch.ones(3, dtype=torch.int32))  # what a plan of all ones makes FlashInfer do


def test_a_segment_without_keys_is_planned_to_read_none(flashinfer_model):
    from relaxkv_sglang.attention.gpu.flashinfer_attention import _PagedPrefillCall

    call = _PagedPrefillCall(flashinfer_model, torch.empty(16, dtype=torch.uint8))
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(8, 2, 4, generator=g), torch.randn(8, 2, 4, generator=g)
    # two segments: 2 queries over slots 5, 6; 1 query that sees no key
    kv_indptr = torch.tensor([0, 2, 2], dtype=torch.int32)
    last = flashinfer_attention.AnchorLayerInputs(torch.tensor([0, 2, 3]), kv_indptr, torch.zeros(0), torch.zeros(0),
                                                  torch.zeros(0), 3).last_page_len
    call.plan(torch.tensor([0, 2, 3], dtype=torch.int32), kv_indptr, last, torch.tensor([5, 6], dtype=torch.int32),
              num_qo_heads=4, num_kv_heads=2, head_dim=4, dtype=torch.float32, kv_dtype=torch.float32, scale=0.5)
    out = call.run(torch.randn(3, 4, 4, generator=g), k_cache, v_cache)
    assert call.wrapper.args[4].tolist() == [1, 0] and not bool(out[2].any())
    with pytest.raises(ValueError, match="heads"):  # head counts other than the plan's
        call.run(torch.randn(3, 2, 4, generator=g), k_cache, v_cache)


def test_graph_replay_only_for_sglang_batches_without_a_repair():
    from relaxkv_sglang.attention.sglang.attention_paths import SCOPED, SGLANG, may_replay_graph

    from relaxkv_sglang.attention.extend_rows import FoldedRows

    plain, repaired = FoldedRows([]), FoldedRows([], repairs=True)
    assert may_replay_graph(SGLANG, None) and may_replay_graph(SGLANG, plain)
    assert not may_replay_graph(SGLANG, repaired)  # replay would skip the model hook
    assert not may_replay_graph(SCOPED, plain) and not may_replay_graph(SCOPED, repaired)


def _attention_layer(layer_id, window=-1, cap=0.0, k_scale=None, v_scale=None):
    """A stand-in of SGLang's RadixAttention: the attributes the settings check reads."""
    layer = torch.nn.Module()
    layer.layer_id, layer.sliding_window_size, layer.logit_cap = layer_id, window, cap
    layer.k_scale_float, layer.v_scale_float = k_scale, v_scale
    return layer


def test_attention_settings_the_plugin_would_drop_are_refused_at_startup():
    from relaxkv_sglang.attention.sglang.attention_paths import check_attention_settings, unsupported_settings

    plain = torch.nn.Sequential(_attention_layer(0), _attention_layer(1, k_scale=1.0, v_scale=1.0))
    assert unsupported_settings(plain) == [] and unsupported_settings(None) == []
    check_attention_settings(plain)  # nothing to refuse
    odd = torch.nn.Sequential(_attention_layer(0, window=4096), _attention_layer(1, cap=30.0),
                              _attention_layer(2, k_scale=0.5, v_scale=2.0))
    assert unsupported_settings(odd) == ["layer 0: a sliding window of 4096 tokens",
                                         "layer 1: a logit soft cap of 30.0", "layer 2: a K scale of 0.5",
                                         "layer 2: a V scale of 2.0"]
    with pytest.raises(RuntimeError, match=r"does not apply layer 0: a sliding window of 4096 tokens; layer 1: "
                                           r"a logit soft cap of 30.0 \(and 2 more\); serve this model with another"):
        check_attention_settings(odd)


def test_create_backend_picks_the_class_by_device(monkeypatch):
    from relaxkv_sglang.attention.sglang import attention_backend

    monkeypatch.setattr(attention_backend, "build_backend_class", lambda: lambda runner: ("torch", runner.device))
    monkeypatch.setattr(attention_backend, "build_cuda_backend_class",
                        lambda: lambda runner: ("flashinfer", runner.device))
    for device, want in (("cpu", "torch"), ("cuda", "flashinfer"), ("cuda:1", "flashinfer")):
        assert attention_backend.create_backend(types.SimpleNamespace(device=device))[0] == want


def test_cuda_backend_shares_sglangs_flashinfer_workspace(flashinfer_model, monkeypatch):
    """Issue 47 item 7: the plugin's wrappers use SGLang's FlashInfer float workspace (memory
    SGLang's backend holds anyway), none of their own."""
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    from relaxkv_sglang.attention.sglang import attention_backend

    workspace = torch.empty(64, dtype=torch.uint8)

    def sglang_init(self, model_runner):
        self.workspace_buffer = workspace

    monkeypatch.setattr(FlashInferAttnBackend, "__init__", sglang_init)
    model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(to_dict=dict), vocab_size=32)
    runner = types.SimpleNamespace(device="cpu", model=None, model_config=model_config)
    backend = attention_backend.build_cuda_backend_class()(runner)
    assert backend._scoped._ring.workspace is workspace
    assert backend.anchor_attention._float_workspace is workspace
    attn = FlashInferAnchorAttention("cpu", float_workspace=workspace)
    assert attn._ring.workspace is workspace and attn._ring.calls == []  # wrappers at first use
