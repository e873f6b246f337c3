"""The GPU path checked on the CPU: the layout's split into FlashInfer's two calls, and the layer.

FlashInfer runs only on a GPU (``python -m relaxkv_sglang.gpu.check`` there).
Here the split (``gpu/variable_block.py``) is checked against the per-row loop it
replaced and against the layout's visible pairs, and FlashInfer's two wrappers
are replaced by their torch models (``gpu/torch_models.py``), with FlashInfer's
conventions (HND tensors for the block-sparse wrapper, an NHD paged cache with
page size 1, log-sum-exp in base 2), so what the thin layer itself does (slot
mapping, layouts, the base change, rows without a fully visible page, the merge)
is checked against ``block_sparse_attention``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import sys
import types

import pytest
import torch

from relaxkv_sglang.core.attention import block_sparse_attention, gathered_attention
from relaxkv_sglang.core.layout import BlockSparseLayout, build_relaxed_layout, full_causal_layout
from relaxkv_sglang.core.selection import select_anchors
from relaxkv_sglang.gpu import bundle, flashinfer_attention
from relaxkv_sglang.gpu.flashinfer_attention import FLASHINFER_VERSION, FlashInferRelaxedAttention
from relaxkv_sglang.gpu.torch_models import ragged_attention, variable_block_sparse_reference
from relaxkv_sglang.gpu.variable_block import (
    FlashInferVariableBlockPlan,
    merge_attention_states,
    to_flashinfer_variable_block,
)

LOG2E = 1 / math.log(2.0)


# --- the split ------------------------------------------------------------------------------


PLAN_FIELDS = [f.name for f in dataclasses.fields(FlashInferVariableBlockPlan)]


def _split_oracle(layout: BlockSparseLayout, num_kv_heads: int) -> dict[str, torch.Tensor]:
    """The per-row loop ``to_flashinfer_variable_block`` replaced, kept verbatim as its oracle
    (returning the plan's fields by name)."""
    P, ps = layout.n_pages, layout.page_size
    R = layout.n_row_blocks
    page_last = torch.clamp((torch.arange(P) + 1) * ps, max=layout.n_keys) - 1  # [P]
    col_sz = (page_last - torch.arange(P) * ps + 1).to(torch.int32)
    row_sz = (layout.row_indptr[1:] - layout.row_indptr[:-1]).to(torch.int32)
    mask = torch.zeros(R, P, dtype=torch.bool)
    diag_lists: list[torch.Tensor] = []
    for b in range(R):
        r0, r1 = int(layout.row_indptr[b]), int(layout.row_indptr[b + 1])
        pages = layout.block_pages(b)
        if r0 == r1:
            continue
        first = int(layout.q_pos[r0:r1].min())
        full = pages[page_last[pages] < first]
        mask[b, full] = True
        partial = pages[page_last[pages] >= first]
        ptok = (partial[:, None] * ps + torch.arange(ps)[None, :]).flatten()
        ptok = ptok[ptok < layout.n_keys]
        for t in layout.q_pos[r0:r1].tolist():
            diag_lists.append(ptok[ptok <= t])
    lens = torch.tensor([d.numel() for d in diag_lists], dtype=torch.long)
    diag_indptr = torch.zeros(layout.n_rows + 1, dtype=torch.int32)
    if lens.numel():
        diag_indptr[1:] = lens.cumsum(0).to(torch.int32)
    diag_indices = torch.cat(diag_lists).to(torch.int32) if diag_lists else torch.zeros(0, dtype=torch.int32)
    rep = lambda x: x[None].expand(num_kv_heads, *x.shape).contiguous()  # noqa: E731
    values = (rep(mask), rep(row_sz), rep(col_sz), diag_indptr, diag_indices, layout.q_pos.clone())
    return dict(zip(PLAN_FIELDS, values))


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
                    build_relaxed_layout(anchors, scores, spans, n, ratio, page_size, sink_tokens=sink)))
        out.append((f"random ps={page_size} n={n}", build_relaxed_layout(
            anchors, None, spans, n, ratio, page_size, mode="random", generator=g)))
        out.append((f"full ps={page_size} n={n}", full_causal_layout(anchors, spans, n, page_size)))
        out.append((f"empty ps={page_size} n={n}", build_relaxed_layout(
            torch.zeros(0, dtype=torch.long), scores, spans, n, ratio, page_size)))
        # The server's anchors: relaxkv's per-layer sets on random query scores.
        layer_scores = torch.rand(3, n, generator=g) ** 4
        for l, a in enumerate(select_anchors("relaxkv", layer_scores, spans, n, 0.15)):
            out.append((f"relaxkv layer {l} ps={page_size} n={n}",
                        build_relaxed_layout(a, layer_scores[l], spans, n, 0.25, page_size)))
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


def _assert_same_plan(got: FlashInferVariableBlockPlan, want: dict[str, torch.Tensor], name: str) -> None:
    assert len(PLAN_FIELDS) == 6 and set(want) == set(PLAN_FIELDS)
    for field in PLAN_FIELDS:
        a, b = getattr(got, field), want[field]
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: {field} differs\n got {a}\nwant {b}"


@pytest.mark.parametrize("seed", range(8))
def test_split_equals_the_per_row_loop(seed):
    layouts = _random_layouts(seed)
    kinds = {name.split()[0] for name, _ in layouts}
    assert kinds == {"topk", "random", "full", "empty", "relaxkv", "csr"}
    for name, layout in layouts:
        for num_kv_heads in (1, 3):
            _assert_same_plan(to_flashinfer_variable_block(layout, num_kv_heads), _split_oracle(layout, num_kv_heads),
                              f"{name} heads={num_kv_heads}")


def test_split_of_edge_layouts_equals_the_per_row_loop():
    """No rows or blocks at all; rows only on the first page; one page larger than the context;
    pages listed out of order (beyond the layout's contract, still the same as the loop)."""
    empty = BlockSparseLayout.from_page_mask(torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.int32),
                                             torch.zeros(0, 3, dtype=torch.bool), 4, 10)
    first_page = build_relaxed_layout(torch.tensor([1, 3, 6]), torch.linspace(0, 1, 40), [(0, 40)], 40, 0.5, 8,
                                      sink_tokens=1)
    big_page = full_causal_layout(torch.tensor([0, 5, 9]), [(2, 10)], 10, 64)
    shuffled = BlockSparseLayout(q_pos=torch.tensor([9, 12, 30, 31]),
                                 row_indptr=torch.tensor([0, 2, 4], dtype=torch.int32),
                                 indptr=torch.tensor([0, 3, 5], dtype=torch.int32),
                                 indices=torch.tensor([3, 0, 2, 7, 1], dtype=torch.int32), page_size=4, n_keys=33)
    for name, layout in [("empty", empty), ("first page", first_page), ("big page", big_page), ("shuffled", shuffled)]:
        _assert_same_plan(to_flashinfer_variable_block(layout, 2), _split_oracle(layout, 2), name)
    assert not to_flashinfer_variable_block(first_page, 1).block_mask_map.any()


def _plan_dense_mask(plan: FlashInferVariableBlockPlan, n_rows: int, n_keys: int) -> torch.Tensor:
    """int32 [n_rows, n_keys]: how many of the two calls cover each (row, key) pair."""
    rows, cols = plan.block_row_sz[0].long(), plan.block_col_sz[0].long()
    dense = plan.block_mask_map[0].to(torch.int32).repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    for i in range(n_rows):
        dense[i, plan.diag_kv_indices[plan.diag_kv_indptr[i]:plan.diag_kv_indptr[i + 1]].long()] += 1
    return dense


@pytest.mark.parametrize("seed", range(3))
def test_split_covers_exactly_the_visible_pairs(seed):
    for name, layout in _random_layouts(100 + seed):
        plan = to_flashinfer_variable_block(layout, num_kv_heads=2)
        R, P = layout.n_row_blocks, layout.n_pages
        assert plan.block_mask_map.shape == (2, R, P) and plan.block_mask_map.dtype == torch.bool, name
        assert plan.block_row_sz.shape == (2, R) and int(plan.block_row_sz[0].sum()) == layout.n_rows, name
        assert plan.block_col_sz.shape == (2, P) and int(plan.block_col_sz[1].sum()) == layout.n_keys, name
        assert torch.equal(plan.block_mask_map[0], plan.block_mask_map[1]), name
        # The two parts are disjoint and together exactly the layout's visible pairs.
        dense = _plan_dense_mask(plan, layout.n_rows, layout.n_keys)
        assert bool((dense <= 1).all()) and torch.equal(dense.bool(), layout.to_dense_mask()), name
        if name.split()[0] in ("topk", "random", "full", "relaxkv") and layout.n_rows:
            # Relaxed layouts: only the anchor's own page is partial, 1..page_size ragged keys each.
            lens = plan.diag_kv_indptr[1:] - plan.diag_kv_indptr[:-1]
            assert int(lens.max()) <= layout.page_size and int(lens.min()) >= 1, name


# --- the torch models of FlashInfer's calls and the merge -----------------------------------


def test_ragged_model_and_merge():
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(4, 4, 8, generator=g), torch.randn(25, 2, 8, generator=g), torch.randn(25, 2, 8, generator=g)
    no_causal = torch.full((1,), 10**6)

    def want(lists):
        pairs = [gathered_attention(q[i:i + 1], k, v, no_causal, torch.tensor(l, dtype=torch.long), return_lse=True)
                 for i, l in enumerate(lists)]
        return torch.cat([o for o, _ in pairs]), torch.cat([s for _, s in pairs])

    lists = [[0, 3, 7], [1], [2, 4, 6, 8, 24], [10, 11]]
    indptr = torch.tensor([0, 3, 4, 9, 11], dtype=torch.int32)
    out, lse = ragged_attention(q, k, v, indptr, torch.tensor(sum(lists, []), dtype=torch.int32), return_lse=True)
    ro, rl = want(lists)
    torch.testing.assert_close(out, ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, rl, atol=1e-5, rtol=1e-5)
    # Two disjoint halves merged == attention over their union; an empty half is neutral.
    other = [[12, 13], [14, 15, 16], [], [17]]
    ip2 = torch.tensor([0, 2, 5, 5, 6], dtype=torch.int32)
    o2, l2 = ragged_attention(q, k, v, ip2, torch.tensor(sum(other, []), dtype=torch.int32), return_lse=True)
    assert torch.isinf(l2[2]).all() and (o2[2] == 0).all()
    mo, ml = merge_attention_states(out, lse, o2, l2)
    ro, rl = want([a + b for a, b in zip(lists, other)])
    torch.testing.assert_close(mo, ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ml, rl, atol=1e-5, rtol=1e-5)


def test_split_through_the_torch_models_reproduces_block_sparse():
    n, H, HKV, D = 70, 4, 2, 8
    spans = [(6, 27), (27, 45), (45, 70)]
    g = torch.Generator().manual_seed(5)
    q_all = torch.randn(n, H, D, generator=g)
    k, v = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
    anchors = torch.tensor([6, 7, 13, 26, 27, 30, 44, 46, 52, 53, 69])
    lay = build_relaxed_layout(anchors, torch.rand(n, generator=g), spans, n, 0.4, page_size=4)
    q = q_all[anchors]
    ref, ref_lse = block_sparse_attention(q, k, v, lay, return_lse=True)
    plan = to_flashinfer_variable_block(lay, HKV)
    # FlashInfer's wrapper takes HND tensors.
    o1, l1 = variable_block_sparse_reference(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        plan.block_mask_map, plan.block_row_sz, plan.block_col_sz, return_lse=True,
    )
    o2, l2 = ragged_attention(q, k, v, plan.diag_kv_indptr, plan.diag_kv_indices, return_lse=True)
    mo, ml = merge_attention_states(o1.transpose(0, 1), l1.transpose(0, 1), o2, l2)
    torch.testing.assert_close(mo, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ml, ref_lse, atol=1e-5, rtol=1e-5)


# --- the layer, with FlashInfer replaced by the torch models --------------------------------


class _VariableBlockModel:
    """torch model of ``VariableBlockSparseAttentionWrapper`` (plan + run, return_lse)."""

    def __init__(self, workspace):
        self.args = None

    def plan(self, block_mask_map, block_row_sz, block_col_sz, num_qo_heads, num_kv_heads, head_dim, *,
             causal, sm_scale, q_data_type, kv_data_type):
        assert not causal and block_mask_map.any(), "the real wrapper cannot plan an empty map"
        self.args = (block_mask_map, block_row_sz, block_col_sz, sm_scale)

    def run(self, q, k, v, return_lse):
        mask, rows, cols, scale = self.args
        assert q.dim() == 3 and q.shape[1] == int(rows[0].sum()) and k.shape[1] == int(cols[0].sum())  # HND
        out, lse = variable_block_sparse_reference(q, k, v, mask, rows, cols, scale, return_lse=True)
        # An empty row: FlashInfer's value there is not specified, so give one the layer must ignore.
        lse = torch.where(torch.isinf(lse), torch.full_like(lse, 7.0), lse * LOG2E)
        return out, lse


class _PagedPrefillModel:
    """torch model of ``BatchPrefillWithPagedKVCacheWrapper`` for page size 1, one query per request."""

    def __init__(self, workspace, kv_layout):
        assert kv_layout == "NHD"
        self.args = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             *, causal, sm_scale, q_data_type, kv_data_type):
        assert page_size == 1 and not causal and torch.equal(qo_indptr, torch.arange(qo_indptr.numel(), dtype=torch.int32))
        self.args = (kv_indptr, kv_indices, sm_scale)

    def run(self, q, paged_kv_cache, return_lse):
        k_cache, v_cache = paged_kv_cache
        assert k_cache.dim() == 4 and k_cache.shape[1] == 1  # [pages, page_size, heads, dim]
        indptr, indices, scale = self.args
        out, lse = ragged_attention(q, k_cache[:, 0], v_cache[:, 0], indptr, indices, scale, return_lse=True)
        return out, lse * LOG2E


@pytest.fixture
def flashinfer_model(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.__version__ = FLASHINFER_VERSION
    module.sparse = types.SimpleNamespace(VariableBlockSparseAttentionWrapper=_VariableBlockModel)
    module.BatchPrefillWithPagedKVCacheWrapper = _PagedPrefillModel
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def _case(seed: int, n: int = 90, ratio: float = 0.3, page_size: int = 8, full: bool = False):
    g = torch.Generator().manual_seed(seed)
    spans = [(4, 30), (30, 61), (61, n)]
    # Anchor 5 sits on the first page: its row block has no fully visible page.
    anchors = torch.tensor(sorted({5} | set(torch.randint(4, n, (18,), generator=g).tolist())))
    scores = torch.rand(n, generator=g)
    layout = (full_causal_layout(anchors, spans, n, page_size) if full
              else build_relaxed_layout(anchors, scores, spans, n, ratio, page_size))
    pool = 3 * n
    key_rows = torch.randperm(pool, generator=g)[:n]
    k_cache, v_cache = torch.randn(pool, 2, 16, generator=g), torch.randn(pool, 2, 16, generator=g)
    q = torch.randn(anchors.numel(), 6, 16, generator=g)
    return layout, key_rows, q, k_cache, v_cache


@pytest.mark.parametrize("seed,ratio,full", [(0, 0.3, False), (1, 0.1, False), (2, 1.0, False), (3, 0.5, True)])
def test_layer_equals_the_torch_executor(flashinfer_model, seed, ratio, full):
    layout, key_rows, q, k_cache, v_cache = _case(seed, ratio=ratio, full=full)
    attn = FlashInferRelaxedAttention("cpu", workspace_bytes=16)
    attn.plan(layout, num_qo_heads=6, num_kv_heads=2, head_dim=16, dtype=q.dtype, scale=0.3, key_rows=key_rows)
    got = attn.run(q, k_cache, v_cache)
    want = block_sparse_attention(q, k_cache, v_cache, layout, scale=0.3, key_rows=key_rows)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_layout_with_no_fully_visible_page_skips_the_block_call(flashinfer_model):
    # Anchors all on the first page: every key they see is on their own (diagonal) page.
    n, spans = 40, [(0, 40)]
    layout = build_relaxed_layout(torch.tensor([1, 3, 6]), torch.rand(n), spans, n, 0.5, page_size=8, sink_tokens=1)
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(3, 4, 8, generator=g), torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g)
    attn = FlashInferRelaxedAttention("cpu", workspace_bytes=16)
    attn.plan(layout, num_qo_heads=4, num_kv_heads=2, head_dim=8, dtype=q.dtype)
    assert attn._blocks.args is None  # never planned
    torch.testing.assert_close(attn.run(q, k, v), block_sparse_attention(q, k, v, layout), atol=1e-5, rtol=1e-5)


def test_run_before_plan_and_wrong_rows_are_refused(flashinfer_model):
    attn = FlashInferRelaxedAttention("cpu", workspace_bytes=16)
    layout, key_rows, q, k_cache, v_cache = _case(5)
    with pytest.raises(RuntimeError, match="before plan"):
        attn.run(q, k_cache, v_cache)
    attn.plan(layout, num_qo_heads=6, num_kv_heads=2, head_dim=16, dtype=q.dtype, key_rows=key_rows)
    with pytest.raises(ValueError, match="rows"):
        attn.run(q[1:], k_cache, v_cache)


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
