"""Relaxed-context layouts: contents, budget, causality, nesting in the ratio."""

import math

import pytest
import torch

from relaxkv_sglang.attention.layout import (
    BlockSparseLayout,
    RelaxedContextSpec,
    build_relaxed_layout,
    build_relaxed_layouts,
    full_causal_layout,
    key_bound_page_scores,
    page_scores,
)

PS = 4
SPANS = [(6, 27), (27, 45), (45, 70)]  # prefix 0..5; pages straddle chunk boundaries
N_CTX = 70


def _anchors():
    return torch.tensor([6, 7, 13, 26, 27, 30, 44, 46, 52, 53, 69])


def _ctx(ratio, **knobs):
    """The tests' relaxed context: SPANS over N_CTX tokens in pages of PS."""
    return RelaxedContextSpec(SPANS, N_CTX, ratio, page_size=PS, **knobs)


def _scores():
    s = torch.full((N_CTX,), 0.01)
    s[[9, 10]] = 1.0  # page 2
    s[36] = 3.0  # page 9
    s[21] = 2.0  # page 5
    s[58] = 0.5  # page 14
    return s


def test_page_scores_sum_tokens():
    s = torch.arange(10, dtype=torch.float32)
    assert page_scores(s, 4).tolist() == [6.0, 22.0, 17.0]


def test_full_ratio_is_exactly_the_causal_prefix():
    a = _anchors()
    for lay in (
        build_relaxed_layout(a, _scores(), _ctx(1.0)),
        full_causal_layout(a, SPANS, N_CTX, page_size=PS),
    ):
        expect = torch.arange(N_CTX)[None, :] <= a[:, None]
        assert torch.equal(lay.to_dense_mask(), expect)
        assert lay.kv_pairs() == int((a + 1).sum()) == lay.full_kv_pairs()
        assert lay.context_ratio() == 1.0


def test_row_blocks_group_by_page_and_chunk():
    lay = build_relaxed_layout(_anchors(), _scores(), _ctx(0.5))
    # 26 (chunk 0) and 27 (chunk 1) share page 6 but not a chunk: two row blocks.
    groups = [lay.q_pos[lay.row_indptr[b]:lay.row_indptr[b + 1]].tolist() for b in range(lay.n_row_blocks)]
    assert groups == [[6, 7], [13], [26], [27], [30], [44], [46], [52, 53], [69]]
    assert lay.indptr.dtype == torch.int32 and lay.indices.dtype == torch.int32
    assert torch.equal(lay.q_pos, _anchors())


def test_relaxed_context_contents_and_budget():
    # Page ranking by summed score: 9 (3.03) > 5 (2.03) > 2 (2.02) > 14 (0.53) > ties (0.04).
    lay = build_relaxed_layout(_anchors(), _scores(), _ctx(0.5, sink_tokens=4))
    by_first_row = {int(lay.q_pos[lay.row_indptr[b]]): lay.block_pages(b).tolist() for b in range(lay.n_row_blocks)}
    # Anchor 69 (page 17, chunk 2 starts at 45 = page 11): sink page 0 + own pages 11..17 = 8,
    # budget ceil(0.5 * 18) = 9 -> one more page: the best scored, page 9.
    assert by_first_row[69] == [0, 9, 11, 12, 13, 14, 15, 16, 17]
    # Anchor 46 (page 11): sink + own page 11 = 2, budget 6 -> pages 9, 5, 2, then the
    # lowest-index page of the tied rest (1).
    assert by_first_row[46] == [0, 1, 2, 5, 9, 11]
    # Anchor 30 (page 7, chunk 1 starts at page 6): budget 4 = sink, 6, 7 + best of 1..5 (5).
    assert by_first_row[30] == [0, 5, 6, 7]
    # Budgets round up to whole pages: 0.4 * 12 = 4.8 -> 5 pages for anchor 46.
    lay4 = build_relaxed_layout(_anchors(), _scores(), _ctx(0.4))
    b46 = int((lay4.q_pos[lay4.row_indptr[:-1].long()] == 46).nonzero())
    assert lay4.block_pages(b46).tolist() == [0, 2, 5, 9, 11]
    # Mandatory pages exceed a tiny budget: still kept (floor = sink + own chunk).
    tiny = build_relaxed_layout(_anchors(), _scores(), _ctx(0.01))
    pages = {int(tiny.q_pos[tiny.row_indptr[b]]): tiny.block_pages(b).tolist() for b in range(tiny.n_row_blocks)}
    assert pages[69] == [0, 11, 12, 13, 14, 15, 16, 17]
    # Causal: nothing after the anchor.
    mask = lay.to_dense_mask()
    assert not (mask & (torch.arange(N_CTX)[None, :] > lay.q_pos[:, None])).any()
    # The anchor always sees itself and the sink.
    assert mask[torch.arange(lay.n_rows), lay.q_pos].all() and mask[:, 0].all()


def test_own_chunk_outside_the_budget():
    a = _anchors()
    # Ratio 1 is still exactly the causal prefix; ratio 0 is sink + own chunk only.
    full = build_relaxed_layout(a, _scores(), _ctx(1.0, own_chunk_in_budget=False))
    assert torch.equal(full.to_dense_mask(), torch.arange(N_CTX)[None, :] <= a[:, None])
    bare = build_relaxed_layout(a, _scores(), _ctx(0.0, own_chunk_in_budget=False))
    pages = {int(bare.q_pos[bare.row_indptr[b]]): bare.block_pages(b).tolist() for b in range(bare.n_row_blocks)}
    assert pages[69] == [0, 11, 12, 13, 14, 15, 16, 17]
    lay = build_relaxed_layout(a, _scores(), _ctx(0.5, own_chunk_in_budget=False))
    pages = {int(lay.q_pos[lay.row_indptr[b]]): lay.block_pages(b).tolist() for b in range(lay.n_row_blocks)}
    # Anchor 69: 11 pages before its chunk (page 11), budget ceil(0.5 * 11) = 6 = sink + the five best
    # (9, 5, 2, then the tied 1, 3); inside the budget it got one page besides sink and own chunk.
    assert pages[69] == [0, 1, 2, 3, 5, 9, 11, 12, 13, 14, 15, 16, 17]
    # Anchor 30 (chunk from page 6): budget ceil(0.5 * 6) = 3 = sink + 5 + 2.
    assert pages[30] == [0, 2, 5, 6, 7]
    # Never fewer pages than with the own chunk counted in the budget.
    inside = build_relaxed_layout(a, _scores(), _ctx(0.5))
    assert not (inside.to_dense_mask() & ~lay.to_dense_mask()).any()


def test_work_shrinks_monotonically_and_sets_nest():
    a = torch.arange(6, 70, 3)
    masks, pairs = [], []
    for ratio in (1.0, 0.5, 0.25):
        lay = build_relaxed_layout(a, _scores(), _ctx(ratio))
        masks.append(lay.to_dense_mask())
        pairs.append(lay.kv_pairs())
        assert lay.kv_pairs() == int(masks[-1].sum())
    assert pairs[0] > pairs[1] > pairs[2]
    assert not (masks[1] & ~masks[0]).any() and not (masks[2] & ~masks[1]).any()


def test_random_context_same_budget_seeded():
    a = _anchors()
    top = build_relaxed_layout(a, _scores(), _ctx(0.5))
    r1 = build_relaxed_layout(a, None, _ctx(0.5, mode="random"), generator=torch.Generator().manual_seed(1))
    r2 = build_relaxed_layout(a, None, _ctx(0.5, mode="random"), generator=torch.Generator().manual_seed(1))
    assert torch.equal(r1.indices, r2.indices)
    assert torch.equal(top.indptr, r1.indptr)  # same page count per row block
    assert not torch.equal(top.indices, r1.indices)
    full = full_causal_layout(a, SPANS, N_CTX, PS)
    for b in range(r1.n_row_blocks):
        pages = set(r1.block_pages(b).tolist())
        p = int(r1.q_pos[r1.row_indptr[b]]) // PS
        assert 0 in pages and p in pages and max(pages) == p
        assert pages <= set(full.block_pages(b).tolist())


def test_kv_pairs_hand_count_and_from_page_mask():
    q_pos = torch.tensor([5, 9, 10])
    row_indptr = torch.tensor([0, 1, 3])
    pm = torch.tensor([[True, True, False], [True, False, True]])
    lay = BlockSparseLayout.from_page_mask(q_pos, row_indptr, pm, page_size=4, n_keys=11)
    # row 5: pages 0,1 -> keys 0..5 = 6; row 9: pages 0,2 -> 0..3 + 8,9 = 6; row 10: 4 + 3 = 7.
    assert lay.kv_pairs() == 19
    assert lay.full_kv_pairs() == 6 + 10 + 11
    assert lay.block_key_index(1).tolist() == [0, 1, 2, 3, 8, 9, 10]
    assert math.isclose(lay.context_ratio(), 19 / 27)


def test_empty_anchor_set():
    lay = build_relaxed_layout(torch.zeros(0, dtype=torch.long), _scores(), _ctx(0.5))
    assert lay.n_rows == 0 and lay.n_row_blocks == 0 and lay.kv_pairs() == 0


def test_bad_arguments():
    with pytest.raises(ValueError):
        build_relaxed_layout(torch.tensor([9, 7]), _scores(), _ctx(0.5))
    with pytest.raises(ValueError):
        build_relaxed_layout(_anchors(), _scores(), _ctx(1.2))
    with pytest.raises(ValueError):
        build_relaxed_layout(_anchors(), None, _ctx(0.5, mode="topk"))
    with pytest.raises(ValueError, match="unknown context mode"):
        _ctx(0.5, mode="dense")


def test_context_spec_is_one_frozen_value():
    context = _ctx(0.5)
    assert context.chunk_spans == ((6, 27), (27, 45), (45, 70))  # a list of spans becomes a tuple
    assert context == _ctx(0.5) and hash(context) == hash(_ctx(0.5))
    with pytest.raises(AttributeError):
        context.context_ratio = 0.3


@pytest.mark.parametrize("seed", range(5))
def test_kv_pairs_counts_the_dense_mask_on_random_layouts(seed):
    g = torch.Generator().manual_seed(seed)
    n_keys, page_size = 61, 4
    q_pos = torch.sort(torch.randperm(n_keys, generator=g)[:20]).values
    cuts = torch.sort(torch.randperm(19, generator=g)[:6] + 1).values
    row_indptr = torch.cat([torch.tensor([0]), cuts, torch.tensor([20])]).to(torch.int32)
    page_mask = torch.rand(7, math.ceil(n_keys / page_size), generator=g) < 0.4  # pages past a row too
    lay = BlockSparseLayout.from_page_mask(q_pos, row_indptr, page_mask, page_size, n_keys)
    assert lay.kv_pairs() == int(lay.to_dense_mask().sum())


# ----------------------------------------------------------------------------- per-row-block ranking


def _qk(seed=0, n_heads=4, n_kv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    a = _anchors()
    return a, torch.randn(a.numel(), n_heads, d, generator=g), torch.randn(N_CTX, n_kv, d, generator=g)


def test_row_ranking_with_the_shared_scores_is_the_shared_layout():
    a = _anchors()
    shared = page_scores(_scores(), PS)
    for own in (True, False):
        for ratio in (0.0, 0.3, 0.6, 1.0):
            context = _ctx(ratio, own_chunk_in_budget=own)
            ref = build_relaxed_layout(a, _scores(), context)
            per_row = build_relaxed_layout(a, None, context, row_page_scores=shared.expand(a.numel(), -1))
            assert torch.equal(ref.to_dense_mask(), per_row.to_dense_mask())


def test_row_ranking_keeps_each_blocks_page_count_and_follows_its_own_rows():
    a, q, k = _qk()
    context = _ctx(0.5, own_chunk_in_budget=False)
    shared = build_relaxed_layout(a, _scores(), context)
    rows = key_bound_page_scores(q, a, k, N_CTX, PS)
    own = build_relaxed_layout(a, None, context, row_page_scores=rows)
    assert torch.equal(own.row_indptr, shared.row_indptr)
    assert own.indptr.diff().tolist() == shared.indptr.diff().tolist()  # same budget per block
    # A block whose rows favour one optional page takes it.
    boosted = rows.clone()
    last = shared.n_row_blocks - 1
    r0, r1 = int(shared.row_indptr[last]), int(shared.row_indptr[last + 1])
    listed = set(shared.block_pages(last).tolist())
    target = next(p for p in range(1, int(a[r0]) // PS) if p not in listed and p * PS >= 6 and p < 6)
    boosted[r0:r1, target] = 100.0
    lay = build_relaxed_layout(a, None, context, row_page_scores=boosted)
    assert target in lay.block_pages(last).tolist()


def test_key_bound_scores_are_causal_per_head_distributions():
    a, q, k = _qk(1)
    for exact in (False, True):
        s = key_bound_page_scores(q, a, k, N_CTX, PS, exact=exact)
        assert s.shape == (a.numel(), math.ceil(N_CTX / PS))
        assert torch.allclose(s.sum(dim=1), torch.full((a.numel(),), 4.0), atol=1e-5)  # n_heads
        later = torch.arange(s.shape[1])[None, :] > (a // PS)[:, None]
        assert float(s[later].abs().max()) == 0.0


def test_exact_page_scores_are_the_attention_mass_per_page():
    a, q, k = _qk(2)
    s = key_bound_page_scores(q, a, k, N_CTX, PS, exact=True)
    kk = k.repeat_interleave(2, dim=1)
    for i, t in enumerate(a.tolist()):
        logits = torch.einsum("hd,khd->hk", q[i], kk[: t + 1]) * 8 ** -0.5
        mass = torch.softmax(logits, dim=1).sum(dim=0)  # [t+1]
        per_page = torch.zeros(s.shape[1]).index_add_(0, torch.arange(t + 1) // PS, mass)
        assert torch.allclose(s[i], per_page, atol=1e-5)


def test_key_bound_is_an_upper_bound_of_each_pages_logits():
    # Ranking by the bound: a page holding one key aligned with the query outranks pages of noise.
    g = torch.Generator().manual_seed(3)
    k = 0.1 * torch.randn(40, 1, 8, generator=g)
    q = torch.zeros(1, 1, 8)
    q[0, 0, 0] = 5.0
    k[22, 0, 0] = 3.0  # page 5
    s = key_bound_page_scores(q, torch.tensor([39]), k, 40, PS)
    assert int(s[0].argmax()) == 5


@pytest.mark.parametrize("mode", ["topk", "random", "full"])
@pytest.mark.parametrize("own_chunk_in_budget", [True, False])
def test_layouts_of_several_layers_at_once_equal_one_at_a_time(mode, own_chunk_in_budget):
    # A plan's layers: nested sets, one empty, a set whose last anchor and the next set's first
    # share a (page, chunk) (their row blocks must not merge), each layer its own scores.
    g = torch.Generator().manual_seed(3)
    a0 = _anchors()
    sets = [a0, a0[[0, 2, 3, 5, 9]], torch.zeros(0, dtype=torch.long), a0[[3, 9, 10]], a0[[10]]]
    scores = torch.rand(len(sets), N_CTX, generator=g) ** 4
    context = _ctx(0.3, sink_tokens=4, mode=mode, own_chunk_in_budget=own_chunk_in_budget)
    together = build_relaxed_layouts(sets, scores, context, generator=torch.Generator().manual_seed(7))
    one_rng = torch.Generator().manual_seed(7)  # one order drawn per non-empty set, in set order
    for i, a in enumerate(sets):
        alone = build_relaxed_layout(a, scores[i], context, generator=one_rng)
        for field in ("q_pos", "row_indptr", "indptr", "indices"):
            assert torch.equal(getattr(together[i], field), getattr(alone, field)), (i, field)
    assert together[2].n_rows == 0 and together[2].nnz == 0
    with pytest.raises(ValueError, match="strictly increasing"):
        build_relaxed_layouts([a0, a0.flip(0)], scores[:2], context)
