"""Torch attention references: dense, gathered, scoped, block-sparse."""

import math

import pytest
import torch

from relaxkv_sglang.attention.causal import dense_causal_attention, gathered_attention
from relaxkv_sglang.attention.block_sparse import (
    GROUP_ROWS,
    AttentionWork,
    _block_groups,
    block_sparse_attention,
    executed_kv_pairs,
)
from relaxkv_sglang.attention.layout import BlockSparseLayout, RelaxedContextSpec, build_relaxed_layout, full_causal_layout

H, HKV, D = 4, 2, 8


def _qkv(n_q, n_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n_q, H, D, generator=g),
        torch.randn(n_k, HKV, D, generator=g),
        torch.randn(n_k, HKV, D, generator=g),
    )


def _masked_dense(q, k, v, mask):
    """Loop reference: row i attends keys where mask[i]; returns out and natural-log lse."""
    out = torch.zeros(q.shape[0], H, D, dtype=torch.float64)
    lse = torch.full((q.shape[0], H), -math.inf, dtype=torch.float64)
    for i in range(q.shape[0]):
        idx = mask[i].nonzero().squeeze(1)
        if idx.numel() == 0:
            continue
        for h in range(H):
            logit = k[idx, h // (H // HKV)].double() @ q[i, h].double() / math.sqrt(D)
            lse[i, h] = torch.logsumexp(logit, 0)
            out[i, h] = torch.softmax(logit, 0) @ v[idx, h // (H // HKV)].double()
    return out, lse


def test_dense_causal_matches_loop_reference():
    q, k, v = _qkv(5, 12)
    out, lse = dense_causal_attention(q, k, v, return_lse=True)  # queries = last 5 keys
    mask = torch.arange(12)[None, :] <= torch.arange(7, 12)[:, None]
    ro, rl = _masked_dense(q, k, v, mask)
    torch.testing.assert_close(out.double(), ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), rl, atol=1e-5, rtol=1e-5)
    assert out.shape == (5, H, D) and lse.dtype == torch.float32


def test_full_layout_equals_dense_causal():
    n = 53
    q_all, k, v = _qkv(n, n, seed=1)
    anchors = torch.tensor([3, 4, 17, 18, 19, 31, 40, 52])
    spans = [(2, 20), (20, 41), (41, 53)]
    lay = full_causal_layout(anchors, spans, n, page_size=8)
    out, lse = block_sparse_attention(q_all[anchors], k, v, lay, return_lse=True)
    ref, ref_lse = dense_causal_attention(q_all, k, v, return_lse=True)
    torch.testing.assert_close(out, ref[anchors], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse[anchors], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_random_layouts_equal_masked_dense(seed):
    g = torch.Generator().manual_seed(100 + seed)
    n_keys, ps = 45, 4
    n_pages = math.ceil(n_keys / ps)
    q_pos = torch.sort(torch.randperm(n_keys, generator=g)[:14]).values
    cuts = torch.sort(torch.randperm(13, generator=g)[:4] + 1).values
    row_indptr = torch.cat([torch.tensor([0]), cuts, torch.tensor([14])])
    page_mask = torch.rand(5, n_pages, generator=g) < 0.45
    lay = BlockSparseLayout.from_page_mask(q_pos, row_indptr, page_mask, ps, n_keys)
    q, k, v = _qkv(14, n_keys, seed=seed)
    out, lse = block_sparse_attention(q, k, v, lay, return_lse=True)
    mask = lay.to_dense_mask()
    ro, rl = _masked_dense(q, k, v, mask)
    torch.testing.assert_close(out.double(), ro, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(rl))  # rows that see nothing
    fin = ~torch.isinf(rl)
    torch.testing.assert_close(lse.double()[fin], rl[fin], atol=1e-5, rtol=1e-5)
    assert lay.kv_pairs() == int(mask.sum())


def test_gathered_attention_reads_only_the_gathered_rows():
    q, k, v = _qkv(3, 30, seed=2)
    key_idx = torch.tensor([0, 1, 5, 9, 12, 20])
    q_pos = torch.tensor([6, 12, 25])
    # Poison every row outside the gathered set: any dense-then-mask path turns NaN.
    poison = torch.ones(30, dtype=torch.bool)
    poison[key_idx] = False
    kp, vp = k.clone(), v.clone()
    kp[poison], vp[poison] = float("nan"), float("nan")
    out = gathered_attention(q, kp, vp, q_pos, key_idx)
    assert torch.isfinite(out).all()
    mask = torch.zeros(3, 30, dtype=torch.bool)
    mask[:, key_idx] = True
    mask &= torch.arange(30)[None, :] <= q_pos[:, None]
    ro, _ = _masked_dense(q, k, v, mask)
    torch.testing.assert_close(out.double(), ro, atol=1e-5, rtol=1e-5)


def test_block_sparse_reads_only_listed_pages():
    n = 40
    q_all, k, v = _qkv(n, n, seed=3)
    anchors = torch.tensor([21, 22, 35])
    s = torch.zeros(n)
    s[9] = 1.0
    lay = build_relaxed_layout(anchors, s, RelaxedContextSpec([(4, 20), (20, 40)], n, 0.3, page_size=4))
    listed = lay.to_dense_mask().any(0)
    kp, vp = k.clone(), v.clone()
    kp[~listed], vp[~listed] = float("nan"), float("nan")
    # Keys after the last anchor are never needed either.
    out = block_sparse_attention(q_all[anchors], kp, vp, lay)
    assert torch.isfinite(out).all()
    ro, _ = _masked_dense(q_all[anchors], k, v, lay.to_dense_mask())
    torch.testing.assert_close(out.double(), ro, atol=1e-5, rtol=1e-5)
    assert lay.kv_pairs() < lay.full_kv_pairs()


def test_fully_masked_row_is_zero_not_nan():
    q, k, v = _qkv(2, 6, seed=6)
    out, lse = gathered_attention(q, k, v, torch.tensor([1, 5]), torch.tensor([3, 4]), return_lse=True)
    assert (out[0] == 0).all() and torch.isinf(lse[0]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


def test_batched_block_sparse_equals_the_block_loop():
    """The serving path (one padded SDPA call) equals the per-block reference loop."""
    g = torch.Generator().manual_seed(7)
    n_ctx, H, Hkv, d = 200, 4, 2, 16
    q_all = torch.randn(n_ctx, H, d, generator=g)
    k = torch.randn(n_ctx, Hkv, d, generator=g)
    v = torch.randn(n_ctx, Hkv, d, generator=g)
    spans = [(10, 70), (70, 150), (150, 200)]
    anchors = torch.tensor([12, 13, 40, 71, 72, 99, 120, 151, 170, 199])
    scores = torch.rand(n_ctx, generator=g)
    for ratio in (0.0, 0.3, 1.0):
        layout = build_relaxed_layout(anchors, scores, RelaxedContextSpec(spans, n_ctx, ratio, page_size=8))
        q = q_all[anchors]
        batched = block_sparse_attention(q, k, v, layout)
        looped, _ = block_sparse_attention(q, k, v, layout, return_lse=True)
        assert torch.allclose(batched, looped, atol=1e-5)
        # Through a slot map (as in the server's KV pool) the result is the same.
        perm = torch.randperm(n_ctx, generator=g)
        k_pool, v_pool = torch.empty_like(k), torch.empty_like(v)
        k_pool[perm], v_pool[perm] = k, v
        mapped = block_sparse_attention(q, k_pool, v_pool, layout, key_rows=perm)
        assert torch.allclose(mapped, batched, atol=1e-5)


def test_scoped_causal_attention_sees_exactly_its_scope():
    """Rows see keys [scope start, own position], read through a slot map."""
    from relaxkv_sglang.attention.causal import scoped_causal_attention

    g = torch.Generator().manual_seed(3)
    n, H, Hkv, d = 40, 4, 2, 8
    q = torch.randn(n, H, d, generator=g)
    k, v = torch.randn(n, Hkv, d, generator=g), torch.randn(n, Hkv, d, generator=g)
    slots = torch.randperm(n, generator=g)
    k_pool, v_pool = torch.empty_like(k), torch.empty_like(v)
    k_pool[slots], v_pool[slots] = k, v
    pos = torch.arange(n)
    scope = torch.where((pos >= 10) & (pos < 25), torch.tensor(10), torch.tensor(0))  # a chunk at 10..24
    out = scoped_causal_attention(q, k_pool, v_pool, pos, scope, slots)
    for t in (0, 9, 10, 17, 24, 25, 39):
        keys = torch.arange(int(scope[t]), t + 1)
        expect = gathered_attention(q[t:t + 1], k, v, pos[t:t + 1], keys)
        assert torch.allclose(out[t:t + 1], expect, atol=1e-6), t


@pytest.mark.parametrize("seed", range(4))
def test_executed_kv_pairs_counts_each_groups_union_of_pages(seed):
    g = torch.Generator().manual_seed(seed)
    n_keys, page_size, n_rows = 203, 8, 300  # more rows than one group holds
    q_pos = torch.sort(torch.randint(0, n_keys, (n_rows,), generator=g)).values
    cuts = torch.sort(torch.randperm(n_rows - 1, generator=g)[:40] + 1).values
    row_indptr = torch.cat([torch.tensor([0]), cuts, torch.tensor([n_rows])]).to(torch.int32)
    page_mask = torch.rand(41, -(-n_keys // page_size), generator=g) < 0.3
    lay = BlockSparseLayout.from_page_mask(q_pos, row_indptr, page_mask, page_size, n_keys)
    groups = _block_groups(lay)
    # The groups partition the row blocks in order; none is over GROUP_ROWS unless one block is.
    assert [b for b0, b1 in groups for b in range(b0, b1)] == list(range(lay.n_row_blocks))
    bounds = row_indptr.tolist()
    assert all(bounds[b1] - bounds[b0] <= GROUP_ROWS or b1 == b0 + 1 for b0, b1 in groups)
    expect = 0
    for b0, b1 in groups:
        keys = torch.unique(torch.cat([lay.block_key_index(b) for b in range(b0, b1)]))
        expect += (bounds[b1] - bounds[b0]) * keys.numel()
    assert executed_kv_pairs(lay) == expect >= lay.kv_pairs()


@pytest.mark.parametrize("seed", range(3))
def test_executor_counts_the_pairs_it_runs(seed):
    """The work the executor counts as it runs (both paths, summed over calls) equals the
    layouts' own counts: visible pairs, executed pairs and the full causal prefix's."""
    g = torch.Generator().manual_seed(seed)
    n_keys, page_size = 157, 8
    work, lse_work, layouts = AttentionWork(), AttentionWork(), []
    for n_rows in (90, 200):
        q_pos = torch.sort(torch.randint(0, n_keys, (n_rows,), generator=g)).values
        cuts = torch.sort(torch.randperm(n_rows - 1, generator=g)[:12] + 1).values
        row_indptr = torch.cat([torch.tensor([0]), cuts, torch.tensor([n_rows])]).to(torch.int32)
        page_mask = torch.rand(13, -(-n_keys // page_size), generator=g) < 0.4
        lay = BlockSparseLayout.from_page_mask(q_pos, row_indptr, page_mask, page_size, n_keys)
        q, k, v = _qkv(n_rows, n_keys, seed)
        block_sparse_attention(q, k, v, lay, work=work)
        block_sparse_attention(q, k, v, lay, return_lse=True, work=lse_work)
        layouts.append(lay)
    expect = AttentionWork()
    for lay in layouts:  # each layout's own counts
        expect.add(lay.kv_pairs(), executed_kv_pairs(lay), lay.full_kv_pairs())
    assert work == expect and expect.visible > 0
    assert lse_work.visible == expect.visible and lse_work.full == expect.full
    assert lse_work.executed == sum(lay.block_key_index(b).numel() * int(lay.row_indptr[b + 1] - lay.row_indptr[b])
                                    for lay in layouts for b in range(lay.n_row_blocks))


def test_blocks_share_a_call_only_where_it_is_cheaper():
    """Two blocks with the same pages run as one call; a block whose pages barely overlap the
    group's (the earlier rows would compute all of them masked) opens a call of its own."""
    page_size, n_keys = 16, 16 * 64
    q_pos = torch.cat([torch.arange(100, 160), torch.arange(1000, 1020)])
    row_indptr = torch.tensor([0, 30, 60, 80], dtype=torch.int32)
    page_mask = torch.zeros(3, 64, dtype=torch.bool)
    page_mask[0, :7] = page_mask[1, :7] = True  # same pages: one call
    page_mask[2, 40:63] = True  # 23 other pages: its own call
    lay = BlockSparseLayout.from_page_mask(q_pos, row_indptr, page_mask, page_size, n_keys)
    assert _block_groups(lay) == [(0, 2), (2, 3)]
    assert executed_kv_pairs(lay) == 60 * 7 * 16 + 20 * 23 * 16
    q, k, v = torch.randn(80, 4, 8), torch.randn(n_keys, 2, 8), torch.randn(n_keys, 2, 8)
    out = block_sparse_attention(q, k, v, lay)
    for b in range(3):
        r0, r1 = int(row_indptr[b]), int(row_indptr[b + 1])
        expect = gathered_attention(q[r0:r1], k, v, q_pos[r0:r1], lay.block_key_index(b))
        assert torch.allclose(out[r0:r1], expect, atol=1e-6)
