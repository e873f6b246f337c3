"""Reference executor invariants on a tiny random Llama (the backbone of the method's tests)."""

import pytest
import torch

from relaxkv_sglang.repair.repair_config import RepairConfig
from relaxkv_sglang.repair.reference import (
    apply_neox_rope,
    build_stale_kv,
    from_hf_state_dict,
    glue_tokens,
    reference_prefill,
)

transformers = pytest.importorskip("transformers")

PREFIX = 8
CHUNK = 32
N_CHUNKS = 4
N_QUERY = 6
SPANS = [(PREFIX + CHUNK * i, PREFIX + CHUNK * (i + 1)) for i in range(N_CHUNKS)]
Q0 = PREFIX + CHUNK * N_CHUNKS
PS = 8  # small pages so a 136-token context has 17 of them


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.1,
        attn_implementation="eager",
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    return hf, from_hf_state_dict(hf.state_dict(), cfg.to_dict())


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (Q0 + N_QUERY,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def full(model, ids):
    return reference_prefill(model[1], ids, SPANS, Q0, "full")


def run(model, ids, policy, r=0.15, c=1.0, **kw):
    config = RepairConfig.from_knobs(anchor_ratio=r, context_ratio=c, page_size=PS, **kw)
    return reference_prefill(model[1], ids, SPANS, Q0, policy, config)


def close(a, b, tol=1e-4):
    return float((a - b).abs().max()) <= tol


def test_full_equals_hf_logits_and_kv(model, ids, full):
    hf, w = model
    with torch.no_grad():
        out = hf(ids[None], use_cache=True)
    assert full.last_logits.shape == (256,) and full.last_logits.dtype == torch.float32
    torch.testing.assert_close(full.last_logits, out.logits[0, -1].float(), atol=1e-4, rtol=1e-4)
    cache = out.past_key_values
    for l in range(w.n_layers):
        hk, hv = cache.layers[l].keys[0].transpose(0, 1), cache.layers[l].values[0].transpose(0, 1)
        torch.testing.assert_close(full.kv[l][0], hk, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(full.kv[l][1], hv, atol=1e-4, rtol=1e-4)


def test_rope_rerotation_composes(model):
    w = model[1]
    x = torch.randn(10, 2, w.head_dim, generator=torch.Generator().manual_seed(2))
    p0 = torch.arange(10)
    inv = w.rope_inv_freq()
    once = apply_neox_rope(x, p0 + 37, inv)
    twice = apply_neox_rope(apply_neox_rope(x, p0, inv), torch.full((10,), 37), inv)
    torch.testing.assert_close(once, twice, atol=1e-5, rtol=1e-5)


def test_stale_kv_prefix_exact_chunks_not(model, ids, full):
    stale = build_stale_kv(model[1], ids, SPANS, Q0)
    k0, v0 = stale[0]
    assert k0.shape == (Q0, 2, model[1].head_dim)
    # Prefix exact at every layer; layer 0 K/V depend on the token and position only, so the
    # re-rotated chunk K/V are exact there too.  Deeper chunk layers differ (no cross-chunk
    # attention) - the thing repair fixes.
    for l in range(3):
        assert close(stale[l][0][:PREFIX], full.kv[l][0][:PREFIX])
    assert close(k0, full.kv[0][0][:Q0]) and close(v0, full.kv[0][1][:Q0])
    assert not close(stale[2][1][PREFIX:Q0], full.kv[2][1][:Q0][PREFIX:], 1e-2)


def test_full_repair_with_full_context_equals_full_prefill(model, ids, full):
    res = run(model, ids, "relaxkv", 1.0, 1.0)
    assert close(res.last_logits, full.last_logits)
    for l in range(3):
        assert close(res.kv[l][0], full.kv[l][0]) and close(res.kv[l][1], full.kv[l][1])
    assert res.report.anchor_ratio == 1.0 and res.report.context_ratio == 1.0
    assert res.report.anchors_per_layer == [CHUNK * N_CHUNKS] * 3


@pytest.mark.parametrize("policy", ["prophetkv", "epic", "cacheblend", "relaxkv_fullctx", "random"])
def test_peers_at_ratio_one_equal_full(model, ids, full, policy):
    res = run(model, ids, policy, 1.0)
    assert close(res.last_logits, full.last_logits)
    assert not close(res.last_logits, run(model, ids, "pic").last_logits, 0.05)  # repaired, not pic


def test_ratio_zero_equals_pic_and_pic_is_not_full(model, ids, full):
    pic = run(model, ids, "pic")
    r0 = run(model, ids, "relaxkv", 0.0, 0.5)
    assert close(r0.last_logits, pic.last_logits, 1e-5)
    assert r0.report.repair_kv_pairs == 0 and r0.report.anchors_per_layer == [0, 0, 0]
    # The invariants above would be vacuous if reuse were harmless on this model.
    assert float((pic.last_logits - full.last_logits).abs().max()) > 0.05


@pytest.mark.parametrize("policy", ["relaxkv", "prophetkv"])
def test_budget_one_is_full_prefill_and_zero_is_pic(model, ids, full, policy):
    # Whatever the layer value rule and context budget, a budget of 1 buys every token at every
    # layer with its whole prefix; 0 buys nothing.
    knobs = dict(layer_value="depth", own_chunk_in_budget=False)
    res = reference_prefill(model[1], ids, SPANS, Q0, policy, RepairConfig.from_knobs(budget=1.0, page_size=PS, **knobs))
    assert close(res.last_logits, full.last_logits)
    assert res.report.anchor_ratio == 1.0 and res.report.context_ratio == 1.0
    zero = reference_prefill(model[1], ids, SPANS, Q0, policy, RepairConfig.from_knobs(budget=0.0, page_size=PS, **knobs))
    assert close(zero.last_logits, run(model, ids, "pic").last_logits, 1e-5)
    assert zero.report.repair_kv_pairs == 0


def test_layer_value_rules_keep_the_invariants(model, ids, full):
    for rule in ("skip0", "depth", "ramp"):
        res = run(model, ids, "relaxkv", 1.0, 1.0, layer_value=rule, own_chunk_in_budget=False)
        assert close(res.last_logits, full.last_logits)
        zero = run(model, ids, "relaxkv", 0.0, 0.5, layer_value=rule, own_chunk_in_budget=False)
        assert zero.report.repair_kv_pairs == 0


def test_context_ratio_one_equals_fullctx_exactly(model, ids):
    a = run(model, ids, "relaxkv", 0.3, 1.0)
    b = run(model, ids, "relaxkv_fullctx", 0.3)
    assert torch.equal(a.last_logits, b.last_logits)
    assert all(torch.equal(x, y) for x, y in zip(a.anchors, b.anchors))
    assert a.report.repair_kv_pairs == b.report.repair_kv_pairs > 0
    assert not close(a.last_logits, run(model, ids, "pic").last_logits, 0.05)  # both repaired, not pic


@pytest.mark.parametrize("rank", ["keys", "oracle"])
def test_context_ranked_in_the_layer_keeps_the_budget_and_the_invariants(model, ids, full, rank):
    # Full context whatever the ranking; at 0.5 the same work as the query ranking, other pages.
    assert close(run(model, ids, "relaxkv", 1.0, 1.0, context_rank=rank).last_logits, full.last_logits)
    planned, ranked = run(model, ids, "relaxkv", 0.3, 0.5), run(model, ids, "relaxkv", 0.3, 0.5, context_rank=rank)
    assert all(torch.equal(x, y) for x, y in zip(planned.anchors, ranked.anchors))
    assert abs(ranked.report.repair_kv_pairs - planned.report.repair_kv_pairs) <= 3 * PS * len(planned.anchors[0])
    assert not torch.equal(planned.last_logits, ranked.last_logits)


def test_relaxed_context_work_shrinks(model, ids):
    reps = [run(model, ids, "relaxkv", 0.3, c) for c in (1.0, 0.5, 0.25)]
    pairs = [r.report.repair_kv_pairs for r in reps]
    assert pairs[0] > pairs[1] > pairs[2] > 0
    assert reps[0].report.context_ratio == 1.0 > reps[1].report.context_ratio > reps[2].report.context_ratio
    # Targets do not depend on the context budget.
    assert all(torch.equal(x, y) for x, y in zip(reps[0].anchors, reps[2].anchors))
    assert pairs[0] == reps[0].report.full_kv_pairs


def test_report_and_nesting(model, ids):
    res = run(model, ids, "relaxkv", 0.2, 0.5)
    n_el = CHUNK * N_CHUNKS
    rep = res.report
    assert abs(sum(rep.anchors_per_layer) / 3 - 0.2 * n_el) <= 1.0
    assert rep.recomputed_token_layers == sum(rep.anchors_per_layer)
    for l in range(1, 3):
        assert set(res.anchors[l].tolist()) <= set(res.anchors[l - 1].tolist())
    assert all(int(a.min()) >= PREFIX for a in res.anchors if a.numel())
    assert res.scores.shape == (3, Q0) and res.scores.dtype == torch.float32
    assert rep.query_kv_pairs == 3 * (N_QUERY * Q0 + N_QUERY * (N_QUERY + 1) // 2)


def test_layer0_anchor_kv_is_exact(model, ids, full):
    # Anchors' layer-0 input is the exact embedding, so their repaired layer-0 K/V match full
    # prefill whatever their context; non-anchors keep the stale value.
    res = run(model, ids, "relaxkv", 0.2, 0.25)
    a0 = res.anchors[0]
    assert close(res.kv[0][0][a0], full.kv[0][0][a0]) and close(res.kv[0][1][a0], full.kv[0][1][a0])
    # At the last layer an anchor's K/V were recomputed with a relaxed context: different
    # from the stale value of the same token.
    stale = build_stale_kv(model[1], ids, SPANS, Q0)
    a2 = res.anchors[2]
    assert not close(res.kv[2][1][a2], stale[2][1][a2], 1e-3)


def test_random_context_ablation(model, ids):
    rk = run(model, ids, "relaxkv", 0.3, 0.5)
    rr = run(model, ids, "relaxkv_randctx", 0.3, 0.5, seed=3)
    rr2 = run(model, ids, "relaxkv_randctx", 0.3, 0.5, seed=3)
    assert torch.equal(rr.last_logits, rr2.last_logits)
    assert all(torch.equal(x, y) for x, y in zip(rk.anchors, rr.anchors))
    assert not torch.equal(rk.last_logits, rr.last_logits)
    assert abs(rr.report.context_ratio - rk.report.context_ratio) < 0.05


def test_cacheblend_check_layers_full_then_subset(model, ids):
    res = run(model, ids, "cacheblend", 0.1, check_layer=1)
    assert res.report.anchors_per_layer == [128, 128, 13]
    assert set(res.anchors[2].tolist()) <= set(range(PREFIX, Q0))


def test_bad_requests(model, ids):
    with pytest.raises(ValueError, match="overlap"):
        reference_prefill(model[1], ids, [(8, 41), (40, Q0)], Q0, "relaxkv")
    with pytest.raises(ValueError, match="end at query_start"):
        reference_prefill(model[1], ids, [(8, 40), (40, Q0 - 2)], Q0, "relaxkv")
    with pytest.raises(ValueError):
        reference_prefill(model[1], ids, SPANS, ids.numel(), "relaxkv")


@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_biases_and_tied_embeddings_match_hf(tied, ids):
    """Qwen2 (the optional second model): q/k/v biases; its embeddings tied or not (a GGUF may carry
    its own output matrix, as the packaged Qwen2.5-Coder-0.5B does)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=1e6, tie_word_embeddings=tied, initializer_range=0.1, attn_implementation="eager",
    )
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-zero biases, so leaving them out would show
        for name, p in hf.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_(0.0, 0.5)
    sd = hf.state_dict()
    if tied:  # a tied checkpoint saves no lm_head
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    w = from_hf_state_dict(sd, cfg.to_dict())
    assert all("q_bias" in layer and "v_bias" in layer for layer in w.layers)
    assert w.rope_theta == 1e6 and (w.lm_head is w.embed) == tied
    full = reference_prefill(w, ids, SPANS, Q0, "full")
    with torch.no_grad():
        out = hf(ids[None]).logits[0, -1].float()
    torch.testing.assert_close(full.last_logits, out, atol=1e-4, rtol=1e-4)


# Glue: tokens between chunks (separators) that the server computes with the request, never cached.
GLUE_SPANS = [(PREFIX, PREFIX + 30), (PREFIX + 32, PREFIX + 62), (PREFIX + 64, Q0)]


def test_glue_is_fresh_and_full_repair_equals_full_prefill(model, ids, full):
    w = model[1]
    assert glue_tokens(GLUE_SPANS, Q0).tolist() == [38, 39, 70, 71]
    stale = build_stale_kv(w, ids, GLUE_SPANS, Q0)
    # The glue is computed over the stale context: not the chunks' position-0 computation...
    contiguous = build_stale_kv(w, ids, [(PREFIX, PREFIX + 32), (PREFIX + 32, PREFIX + 64), (PREFIX + 64, Q0)], Q0)
    assert not close(stale[2][1][38:40], contiguous[2][1][38:40], 1e-3)
    # ...and its first glue token, after only the prefix and one chunk, matches a direct pass
    # over that chunk's stale KV (layer 0: exact, as for any token).
    assert close(stale[0][0][38], full.kv[0][0][38]) and close(stale[0][1][38], full.kv[0][1][38])
    config = RepairConfig(anchor_ratio=1.0, context_ratio=1.0, page_size=PS)
    res = reference_prefill(w, ids, GLUE_SPANS, Q0, "relaxkv", config)
    assert close(res.last_logits, full.last_logits)
    for l in range(3):
        assert close(res.kv[l][0], full.kv[l][0]) and close(res.kv[l][1], full.kv[l][1])
    # Glue is never an anchor: every eligible (chunk) token is, and only those.
    assert res.report.anchors_per_layer == [30 + 30 + 64] * 3
    assert 38 not in res.anchors[0].tolist()


def test_glue_zero_anchors_is_pic(model, ids):
    w = model[1]
    pic = reference_prefill(w, ids, GLUE_SPANS, Q0, "pic")
    zero = reference_prefill(w, ids, GLUE_SPANS, Q0, "relaxkv", RepairConfig(anchor_ratio=0.0, page_size=PS))
    assert close(zero.last_logits, pic.last_logits)
    for l in range(3):
        assert close(zero.kv[l][0], pic.kv[l][0]) and close(zero.kv[l][1], pic.kv[l][1])
