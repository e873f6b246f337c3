"""Query scores and anchor selection: values, nesting, ratio accounting, per-policy rules."""

import itertools
import math

import pytest
import torch

from relaxkv_sglang.repair.policies import Policy
from relaxkv_sglang.attention.query_scores import query_attention_scores
from relaxkv_sglang.repair.exit_layers import _hull_exit_allocation
from relaxkv_sglang.repair.selection import (
    layer_weights,
    anchor_ratio_achieved,
    chunk_ids,
    eligible_tokens,
    exits_to_anchor_sets,
    relaxkv_exit_layers,
    select_anchors,
    shared_opening_sinks,
)
from relaxkv_sglang.repair.policies.cacheblend import CacheBlendOptions, check_layer_deviation, kv_deviation
from relaxkv_sglang.repair.repair_config import RepairConfig
from relaxkv_sglang.repair.anchor_schedule import schedule_anchors

PREFIX = 6
SPANS = [(6, 26), (26, 40), (40, 71), (71, 90)]
N_CTX = 90
L = 4


def _naive_scores(q, k, n_context, scale):
    """Loop-by-loop definition of s(t) = sum_{query i, head h} softmax_i,h[t]."""
    n_q, H, _ = q.shape
    g = H // k.shape[1]
    s = torch.zeros(n_context, dtype=torch.float64)
    for i in range(n_q):
        for h in range(H):
            keys = k[: n_context + i + 1, h // g].double()
            p = torch.softmax(keys @ q[i, h].double() * scale, dim=0)
            s += p[:n_context]
    return s


def test_query_scores_match_loop_definition_gqa_causal():
    g = torch.Generator().manual_seed(0)
    n_ctx, n_q, H, Hkv, d = 11, 4, 4, 2, 8
    q = torch.randn(n_q, H, d, generator=g)
    k = torch.randn(n_ctx + n_q, Hkv, d, generator=g)
    # A large key on the last query token: only the last query may see it (causality), so
    # an implementation that lets earlier queries see it disagrees with the loop below.
    k[-1] = 5.0
    s = query_attention_scores(q, k, n_ctx)
    assert s.dtype == torch.float32 and s.shape == (n_ctx,)
    ref = _naive_scores(q, k, n_ctx, d ** -0.5)
    torch.testing.assert_close(s.double(), ref, atol=1e-5, rtol=1e-5)
    # Mass on the query's own keys is not handed to the context.
    assert float(s.sum()) < n_q * H - 1e-3


def test_query_scores_batched_over_layers():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 2, 4, 8, generator=g)
    k = torch.randn(3, 9 + 2, 2, 8, generator=g)
    s = query_attention_scores(q, k, 9)
    assert s.shape == (3, 9)
    for l in range(3):
        torch.testing.assert_close(s[l], query_attention_scores(q[l], k[l], 9))


def test_eligible_excludes_prefix_and_chunk_at_zero():
    el = eligible_tokens(SPANS, N_CTX)
    assert el.tolist() == list(range(6, 90))
    # No prefix: the first chunk's cached KV is exact, so it is not eligible.
    el0 = eligible_tokens([(0, 10), (10, 25)], 25)
    assert el0.tolist() == list(range(10, 25))
    ids = chunk_ids(SPANS, N_CTX)
    assert ids[:6].tolist() == [-1] * 6 and ids[26].item() == 1 and ids[89].item() == 3


def _scores(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(L, N_CTX, generator=g) ** 4


# Every repairing policy that decides before the forward (CacheBlend spends more at its check layers).
@pytest.mark.parametrize("policy", [p.value for p in Policy if p.repairs and not p.spec.decides_mid_forward])
@pytest.mark.parametrize("ratio", [0.0, 0.03, 0.15, 0.37, 1.0])
def test_sets_nested_sorted_eligible_and_ratio_met(policy, ratio):
    sets = select_anchors(policy, _scores(), SPANS, N_CTX, ratio, torch.Generator().manual_seed(3))
    el = set(eligible_tokens(SPANS, N_CTX).tolist())
    n_el = len(el)
    assert len(sets) == L
    for l, a in enumerate(sets):
        assert a.dtype == torch.long
        assert torch.equal(a, torch.sort(a).values) and a.unique().numel() == a.numel()
        assert set(a.tolist()) <= el  # never prefix tokens
        if l:
            assert set(a.tolist()) <= set(sets[l - 1].tolist())  # nested over depth
    mean_per_layer = sum(a.numel() for a in sets) / L
    assert abs(mean_per_layer - ratio * n_el) <= 1.0  # within one token per layer
    assert abs(anchor_ratio_achieved(sets, n_el) - ratio) <= 1.0 / n_el
    if ratio == 0.0:
        assert all(a.numel() == 0 for a in sets)
    if ratio == 1.0:
        assert all(a.tolist() == sorted(el) for a in sets)


def test_full_and_pic_sets():
    full = select_anchors("full", None, SPANS, N_CTX, 0.3, n_layers=L)
    pic = select_anchors(Policy.PIC, None, SPANS, N_CTX, 0.3, n_layers=L)
    assert all(a.tolist() == list(range(6, 90)) for a in full)
    assert all(a.numel() == 0 for a in pic)


def test_epic_takes_first_tokens_of_each_chunk():
    spans = [(5, 15), (15, 25), (25, 35), (35, 45)]
    sets = select_anchors("epic", None, spans, 45, 0.3, n_layers=2)  # 12 tokens = 3 per chunk
    assert sets[0].tolist() == [5, 6, 7, 15, 16, 17, 25, 26, 27, 35, 36, 37]
    assert torch.equal(sets[0], sets[1])
    # 14 tokens: the extra round goes to the earlier chunks.
    sets = select_anchors("epic", None, spans, 45, 0.35, n_layers=1)
    assert sets[0].tolist() == [5, 6, 7, 8, 15, 16, 17, 18, 25, 26, 27, 35, 36, 37]


def test_prophetkv_top_mean_score():
    s = torch.zeros(3, 20)
    s[0, 12] = 9.0  # high at one layer only, but highest mean
    s[:, 15] = 2.0
    s[:, 3] = 100.0  # prefix: never an anchor
    s[2, 18] = 3.0
    sets = select_anchors("prophetkv", s, [(10, 20)], 20, 0.3)
    assert all(a.tolist() == [12, 15, 18] for a in sets)


def test_cacheblend_full_check_layers_then_top_deviation():
    dev = torch.zeros(N_CTX)
    dev[[7, 30, 50, 88]] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    dev[2] = 100.0  # prefix deviation is ignored
    plan = schedule_anchors("cacheblend", None, SPANS, N_CTX, 5, RepairConfig(anchor_ratio=3 / 84))
    assert plan.decided_layers == 2 and plan.config.cacheblend == CacheBlendOptions(check_layer=1)
    sets = check_layer_deviation(plan.anchor_inputs(), dev)
    el = list(range(6, 90))
    assert sets[0].tolist() == el and sets[1].tolist() == el
    assert all(a.tolist() == [7, 30, 50] for a in sets[2:])
    # Without the deviation only the check layers are known.
    assert len(select_anchors("cacheblend", None, SPANS, N_CTX, 0.1, n_layers=5)) == 2


def test_kv_deviation_values():
    k_old = torch.zeros(3, 2, 4)
    v_old = torch.zeros(3, 2, 4)
    k_new = torch.zeros(3, 2, 4)
    v_new = torch.zeros(3, 2, 4)
    v_new[1, 0, 0] = 3.0
    v_new[1, 1, 0] = 4.0
    k_new[2, 0, 0] = 2.0
    assert kv_deviation(k_new, v_new, k_old, v_old).tolist() == [0.0, 5.0, 0.0]
    assert kv_deviation(k_new, v_new, k_old, v_old, use_k=True).tolist() == [0.0, 5.0, 2.0]


def test_random_policy_seeded():
    a = select_anchors("random", None, SPANS, N_CTX, 0.2, torch.Generator().manual_seed(5), n_layers=2)
    b = select_anchors("random", None, SPANS, N_CTX, 0.2, torch.Generator().manual_seed(5), n_layers=2)
    c = select_anchors("random", None, SPANS, N_CTX, 0.2, torch.Generator().manual_seed(6), n_layers=2)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


# ----------------------------------------------------------------------------- relaxkv rule


def test_hull_keeps_deep_token_through_all_layers_when_worth_it():
    util = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.1, 0.0, 0.0, 0.0], [0.05, 0.05, 0.0, 0.0]])
    assert _hull_exit_allocation(util, 4).tolist() == [4, 0, 0]
    # A deep value too small per token-layer loses to shallow values.
    util[0, 3] = 0.3
    assert _hull_exit_allocation(util, 3).tolist() == [0, 1, 2]


def test_hull_remainder_goes_to_real_gain_not_to_a_worthless_cut():
    # Greedy by slope takes token 1 (0.3/layer), then token 0's segment (0.25/layer over 4
    # layers) does not fit: cutting it would buy nothing; token 2's two layers buy 0.4.
    util = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.3, 0.0, 0.0, 0.0], [0.2, 0.2, 0.0, 0.0]])
    ex = _hull_exit_allocation(util, 4)
    assert int(ex.sum()) == 4
    assert ex[1].item() == 1 and ex[2].item() >= 2


def _value(util, exits):
    cum = torch.cat([torch.zeros(util.shape[0], 1, dtype=util.dtype), util.cumsum(1)], 1)
    return float(cum[torch.arange(util.shape[0]), exits].sum())


@pytest.mark.parametrize("seed", range(4))
def test_hull_is_optimal_for_concave_utilities(seed):
    g = torch.Generator().manual_seed(seed)
    util = torch.sort(torch.rand(4, 3, generator=g, dtype=torch.float64), dim=1, descending=True).values
    for budget in range(0, 13):
        ex = _hull_exit_allocation(util, budget)
        assert int(ex.sum()) == budget and int(ex.max()) <= 3
        best = max(
            _value(util, torch.tensor(e))
            for e in itertools.product(range(4), repeat=4)
            if sum(e) == budget
        )
        assert _value(util, ex) == pytest.approx(best, abs=1e-12)


def test_relaxkv_layer_specific_targets():
    spans = [(4, 24), (24, 44)]
    s = torch.full((4, 44), 1e-3)
    s[0, 10] = 5.0  # wanted only at layer 0
    s[3, 30] = 5.0  # wanted at the last layer: must be kept through 0..3
    ex = relaxkv_exit_layers(s, spans, anchor_ratio=5 / 40, chunk_sink_tokens=0)  # 20 token-layers
    assert ex[30].item() == 4
    assert ex[10].item() >= 1
    assert int(ex.sum()) == 20 and int(ex[:4].sum()) == 0
    sets = exits_to_anchor_sets(ex, 4)
    assert 30 in sets[3].tolist() and 10 in sets[0].tolist()


def test_relaxkv_chunk_sinks_favoured():
    spans = [(4, 24), (24, 44)]
    s = torch.zeros(4, 44)
    s[:, 15] = 1.0
    ex = relaxkv_exit_layers(s, spans, anchor_ratio=0.25, chunk_sink_tokens=2)  # 40 token-layers
    assert [ex[t].item() for t in (4, 5, 24, 25)] == [4, 4, 4, 4]
    assert ex[15].item() == 4 and int(ex.sum()) == 40
    # Budget smaller than all sinks: sinks spread over chunks first (offset 0 of each chunk).
    ex = relaxkv_exit_layers(s, spans, anchor_ratio=0.075, chunk_sink_tokens=2)  # 12 token-layers
    assert [ex[t].item() for t in (4, 24, 5, 25)] == [4, 4, 4, 0]
    assert int(ex.sum()) == 12


def test_relaxkv_chunk_sink_share_and_order():
    spans = [(4, 24), (24, 44)]
    s = torch.full((4, 44), 1e-3)
    s[:, 25] = 1.0  # the second chunk's second token is the one the query attends to
    s[:, 5] = 0.0  # the first chunk's second token is worth nothing
    # 16 token-layers, sinks capped at half: 8 // 4 = 2 whole sinks, in offset order the first
    # token of each chunk; token 25 (a sink left out) then wins in the hull allocation, token 5 not.
    ex = relaxkv_exit_layers(s, spans, anchor_ratio=0.1, chunk_sink_tokens=2, chunk_sink_share=0.5)
    assert [ex[t].item() for t in (4, 24, 25, 5)] == [4, 4, 4, 0]
    assert int(ex.sum()) == 16
    # 12 token-layers, 3 whole sinks: offset order takes 4, 24, 5; score order takes the
    # highest-valued first (25), then 4 and 24 (equal values, by position), not 5 (worth 0).
    ex = relaxkv_exit_layers(s, spans, anchor_ratio=0.075, chunk_sink_tokens=2, chunk_sink_order="score")
    assert [ex[t].item() for t in (25, 4, 24, 5)] == [4, 4, 4, 0]
    # Share 1 and offset order are the defaults exactly.
    assert torch.equal(relaxkv_exit_layers(s, spans, 0.25, 2, chunk_sink_share=1.0, chunk_sink_order="offset"),
                       relaxkv_exit_layers(s, spans, 0.25, 2))
    with pytest.raises(ValueError, match="chunk_sink_order"):
        relaxkv_exit_layers(s, spans, 0.25, 2, chunk_sink_order="depth")


def test_shared_opening_sinks_count_the_opening_a_chunk_shares():
    # Chunks open with [5, 6, 7, 8], [5, 6, 3], [5, 2, 2], [7, 7]: the first two share two tokens,
    # the third one token with them, the last none (a chunk shorter than the cap is padded with a
    # value only it has, so two short chunks never match on their padding).
    ids = torch.tensor([0, 1, 5, 6, 7, 8, 9, 5, 6, 3, 4, 5, 2, 2, 7, 7])
    spans = [(2, 7), (7, 11), (11, 14), (14, 16)]
    assert shared_opening_sinks(ids, spans, 4).tolist() == [3, 3, 2, 1]
    assert shared_opening_sinks(ids, spans, 2).tolist() == [2, 2, 2, 1]
    assert shared_opening_sinks(ids, spans, 0).tolist() == [0, 0, 0, 0]
    assert shared_opening_sinks(torch.tensor([1, 2, 3, 4]), [(0, 2), (2, 4)], 4).tolist() == [1, 1]


def test_per_chunk_sink_counts():
    spans = [(4, 24), (24, 44)]
    s = torch.full((4, 44), 1e-3)
    # The same count for every chunk is the scalar rule exactly.
    assert torch.equal(relaxkv_exit_layers(s, spans, 0.25, torch.tensor([2, 2])),
                       relaxkv_exit_layers(s, spans, 0.25, 2))
    # 3 sinks in the first chunk, 1 in the second: exactly those 4 tokens take all 4 layers.
    ex = relaxkv_exit_layers(s, spans, anchor_ratio=0.1, chunk_sink_tokens=torch.tensor([3, 1]))
    assert (ex == 4).nonzero().squeeze(1).tolist() == [4, 5, 6, 24]


def test_plan_sizes_sinks_by_the_configured_rule():
    ids = torch.tensor([0, 1, 2, 3] + [9, 8, 7] * 6 + [9, 8, 5] * 6 + [1, 2] * 10 + [3, 3])
    spans, n_ctx = [(4, 22), (22, 40), (40, 60)], 60
    scores = torch.rand(4, n_ctx, generator=torch.Generator().manual_seed(0))
    fixed = schedule_anchors("relaxkv", scores, spans, n_ctx, 4, RepairConfig.from_knobs(chunk_sink_tokens=4))
    assert fixed.chunk_sinks.tolist() == [4, 4, 4]
    shared = schedule_anchors("relaxkv", scores, spans, n_ctx, 4,
                          RepairConfig.from_knobs(chunk_sink_tokens=4, chunk_sink_rule="shared"), input_ids=ids)
    assert shared.chunk_sinks.tolist() == [3, 3, 1]
    # The stale shift leaves the same per-chunk sinks out of its body.
    assert shared.layer_step.body.tolist()[:2] == [7, 8] and 41 in shared.layer_step.body.tolist()
    with pytest.raises(ValueError, match="input_ids"):
        schedule_anchors("relaxkv", scores, spans, n_ctx, 4, RepairConfig.from_knobs(chunk_sink_rule="shared"))
    with pytest.raises(ValueError, match="chunk_sink_rule"):
        RepairConfig.from_knobs(chunk_sink_rule="score")


def test_layer_weights_rules():
    assert layer_weights(4, "uniform").tolist() == [1.0, 1.0, 1.0, 1.0]
    assert layer_weights(4, "skip0").tolist() == [0.0, 1.0, 1.0, 1.0]
    assert layer_weights(4, "depth").tolist() == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])
    with pytest.raises(ValueError, match="layer value"):
        layer_weights(4, "deep")


def test_layer_zero_is_worth_nothing_without_later_layers():
    # Token 10 is wanted only at layer 0, where its cached KV is already exact (re-rotated):
    # with the layer value rules that know it, the budget goes to the token wanted deep.
    spans = [(4, 24), (24, 44)]
    s = torch.full((4, 44), 1e-3)
    s[0, 10] = 5.0
    s[1:, 30] = 5.0
    uniform = relaxkv_exit_layers(s, spans, anchor_ratio=1 / 40, chunk_sink_tokens=0)  # 4 token-layers
    assert uniform[10].item() > 0
    for rule in ("skip0", "depth", "ramp"):
        ex = relaxkv_exit_layers(s, spans, anchor_ratio=1 / 40, chunk_sink_tokens=0, layer_value=rule)
        assert ex[10].item() == 0 and ex[30].item() == 4 and int(ex.sum()) == 4


def test_ramp_layer_value_grows_then_stays_flat():
    from relaxkv_sglang.repair.selection import layer_weights

    assert layer_weights(30, "ramp").tolist() == [0.0, 0.25, 0.5, 0.75] + [1.0] * 26
    assert layer_weights(4, "ramp").tolist() == [0.0, 1.0, 1.0, 1.0]  # R = max(1, round(4 / 8))


def test_ratio_is_validated():
    with pytest.raises(ValueError):
        select_anchors("relaxkv", _scores(), SPANS, N_CTX, 1.5)
    with pytest.raises(ValueError):
        select_anchors("prophetkv", None, SPANS, N_CTX, 0.5, n_layers=2)
    assert math.isclose(anchor_ratio_achieved([], 10), 0.0)


def test_split_budget_spends_anchors_first_then_context():
    from relaxkv_sglang.repair.repair_config import RepairConfig, RepairCost, split_budget

    spans = [(40 + 130 * i, 40 + 130 * (i + 1)) for i in range(10)]
    n = 1340
    cost = RepairCost(pair_cost=1 / 3000)
    config = RepairConfig.from_knobs(context_ratio=0.25, own_chunk_in_budget=False)
    # Full-context policies: the budget is the anchor ratio.
    assert split_budget(0.2, Policy.PROPHETKV, spans, n, config, cost) == (0.2, 1.0)
    # Relaxed context: cheaper anchors, so more of them than the budget, at the asked context.
    r, c = split_budget(0.2, Policy.RELAXKV, spans, n, config, cost)
    assert c == 0.25 and 0.2 < r < 0.25
    ratios = [split_budget(b, Policy.RELAXKV, spans, n, config, cost)[0] for b in (0.0, 0.1, 0.3, 0.6)]
    assert ratios[0] == 0.0 and ratios == sorted(ratios)
    # Once every token is an anchor, the context widens; budget 1 is everything.
    r, c = split_budget(0.95, Policy.RELAXKV, spans, n, config, cost)
    assert r == 1.0 and 0.25 < c < 1.0
    assert split_budget(1.0, Policy.RELAXKV, spans, n, config, cost) == (1.0, pytest.approx(1.0, abs=1e-9))
    # The cost model from a config: SmolLM2-135M's dimensions.
    smol = RepairCost.from_hf_config({"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                                      "num_key_value_heads": 3, "head_dim": 64})
    flops = 2 * 9 * 64 / (576 * (2 * 576 + 2 * 192) + 3 * 576 * 1536)
    assert smol.pair_cost == pytest.approx(flops)
    on_cpu = RepairCost.from_hf_config({"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                                        "num_key_value_heads": 3, "head_dim": 64}, "cpu")
    assert on_cpu.pair_cost == pytest.approx(3.0 * flops)


# ----------------------------------------------------------------------------- the policy registry


def _docstring_table(doc: str) -> list[list[str]]:
    """The rows of the first reST simple table in ``doc`` (between its 2nd and 3rd rule lines)."""
    lines = doc.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("=====")]
    return [line.split() for line in lines[rules[1] + 1:rules[2]] if line.strip()]


def test_the_policies_docstring_table_is_the_registry():
    from relaxkv_sglang.repair import policies

    yes = {True: "yes", False: "no"}
    want = [[name, yes[s.served], yes[s.reuses_chunks], yes[s.repairs], yes[s.needs_query_scores],
             "decides" if s.decides_mid_forward else "step" if s.layer_step else "no",
             s.context if s.repairs else "(none)" if s.reuses_chunks else "(causal)", s.role]
            for name, s in policies.POLICY_SPECS.items()]
    assert _docstring_table(policies.__doc__) == want


def test_every_policy_has_a_spec_module_and_an_enum_member():
    import importlib

    from relaxkv_sglang.repair.policies import OPTION_GROUPS, POLICY_SPECS

    assert list(POLICY_SPECS) == [p.value for p in Policy]
    for name, spec in POLICY_SPECS.items():
        assert spec.name == name and Policy(name).spec is spec
        # The enum's properties are the spec's (what the server's adapters and the reference read).
        policy = Policy(name)
        assert (policy.served, policy.reuses_chunks, policy.repairs, policy.needs_query_scores, policy.context_mode) \
            == (spec.served, spec.reuses_chunks, spec.repairs, spec.needs_query_scores, spec.context)
        # Its rule lives in its own module (one module per policy; relaxkv's ablations in relaxkv's).
        module = importlib.import_module(spec.anchor_rule.__module__)
        assert module.__name__.startswith("relaxkv_sglang.repair.policies.")
        assert spec.options is None or spec.options in OPTION_GROUPS
    assert [g.name for g in OPTION_GROUPS] == ["cacheblend", "relaxkv"]
    assert [n for n, s in POLICY_SPECS.items() if s.decides_mid_forward] == ["cacheblend"]


def test_the_relaxkv_vocabularies_are_the_ones_the_maths_implements():
    from relaxkv_sglang.repair.policies.relaxkv import LAYER_VALUES, SINK_ORDERS, STALE_SHIFTS
    from relaxkv_sglang.repair.stale_shift import shift_deltas

    scores = torch.rand(3, 20, generator=torch.Generator().manual_seed(0))
    for rule in LAYER_VALUES:
        assert layer_weights(3, rule).shape == (3,)
    for order in SINK_ORDERS:
        relaxkv_exit_layers(scores, [(4, 20)], 0.2, 2, "uniform", 0.5, order)
    with pytest.raises(ValueError, match="chunk_sink_order"):
        relaxkv_exit_layers(scores, [(4, 20)], 0.2, 2, "uniform", 0.5, "random")
    kv = torch.rand(2, 1, 4)
    for mode in STALE_SHIFTS:
        shift_deltas(mode, torch.tensor([5, 6]), kv, kv, kv, kv, lambda k, d: k)
    with pytest.raises(ValueError, match="stale_shift"):
        shift_deltas("k", torch.tensor([5, 6]), kv, kv, kv, kv, lambda k, d: k)


def test_registry_queries():
    from relaxkv_sglang.repair.policies import (CHUNK_POLICIES, REPAIR_POLICIES, SERVER_POLICIES, chunk_policies,
                                              repair_policies, served_policies)

    assert served_policies() == SERVER_POLICIES == tuple(p.value for p in Policy if p is not Policy.RANDOM)
    assert set(chunk_policies()) == CHUNK_POLICIES == set(SERVER_POLICIES) - {"full", "prefix"}
    assert repair_policies() == REPAIR_POLICIES == tuple(p for p in chunk_policies() if p != "pic")
    assert repair_policies(ablations=False) == ("epic", "cacheblend", "prophetkv", "relaxkv")


def test_policy_knobs_live_with_their_policy():
    from relaxkv_sglang.repair.policies import CacheBlendOptions, RelaxKVOptions
    from relaxkv_sglang.repair.repair_config import RepairConfig, knob_defaults

    config = RepairConfig.from_knobs(anchor_ratio=0.2, layer_value="depth", check_layer=3, cacheblend_use_k=True)
    assert config.anchor_ratio == 0.2
    assert config.relaxkv == RelaxKVOptions(layer_value="depth")
    assert config.cacheblend == CacheBlendOptions(check_layer=3, use_k=True)
    assert config.options_of("relaxkv_randctx") is config.relaxkv and config.options_of("epic") is None
    assert config.options_of(Policy.CACHEBLEND) is config.cacheblend
    assert config.with_options(cacheblend=CacheBlendOptions()).cacheblend == CacheBlendOptions()
    assert config.with_options(cacheblend=CacheBlendOptions()).relaxkv is config.relaxkv
    with pytest.raises(TypeError, match="option group"):
        config.with_options(prophetkv=CacheBlendOptions())
    with pytest.raises(AttributeError):
        config.prophetkv  # noqa: B018
    with pytest.raises(TypeError, match="options must be"):
        RepairConfig(options=(RelaxKVOptions(),))
    assert RepairConfig.from_knobs(**knob_defaults()) == RepairConfig()
    with pytest.raises(TypeError, match="unknown repair knob"):
        RepairConfig.from_knobs(sink_count=3)
    with pytest.raises(ValueError, match="layer_value"):
        RelaxKVOptions(layer_value="steep")
    with pytest.raises(ValueError, match="check_layer"):
        CacheBlendOptions(check_layer=-1)


def test_only_a_mid_forward_policy_waits_for_its_check_layer():
    from relaxkv_sglang.repair.policies.cacheblend import CheckLayerStep
    from relaxkv_sglang.repair.policies.relaxkv import StaleShiftStep
    from relaxkv_sglang.repair.repair_config import RepairConfig
    from relaxkv_sglang.repair.anchor_schedule import schedule_anchors

    scores = torch.rand(L, N_CTX, generator=torch.Generator().manual_seed(0))
    config = RepairConfig.from_knobs(anchor_ratio=0.2, check_layer=2)
    for policy in Policy:
        if not policy.repairs:
            continue
        plan = schedule_anchors(policy, scores if policy.needs_query_scores else None, SPANS, N_CTX, L, config)
        waits = policy.spec.decides_mid_forward
        assert plan.decided_layers == (3 if waits else L)
        step = plan.layer_step
        if waits:
            assert isinstance(step, CheckLayerStep)
            assert [step.reads(l) is not None for l in range(L)] == [l == 2 for l in range(L)]
        else:  # the relaxkv policies shift; the peers run as published
            assert isinstance(step, StaleShiftStep) == policy.value.startswith("relaxkv"), policy
            assert step is None or step.reads(0) is not None
    off = RepairConfig.from_knobs(stale_shift="none")
    assert schedule_anchors("relaxkv", scores, SPANS, N_CTX, L, off).layer_step is None

def test_shared_runs_mark_the_markup_every_chunk_repeats():
    from relaxkv_sglang.repair.token_sets import shared_runs

    # three chunks: [7 8 9 | own text | 5 6] - the runs 7 8 9 and (own) 5 6 x; glue 0 between them
    ids = torch.tensor([0, 7, 8, 9, 1, 2, 5, 6, 0, 7, 8, 9, 3, 5, 6, 0, 7, 8, 9, 4, 4, 5, 6, 0])
    spans = [(1, 8), (9, 15), (16, 23)]
    marked = shared_runs(ids, spans, 24, run=3)
    assert marked.nonzero().flatten().tolist() == [1, 2, 3, 9, 10, 11, 16, 17, 18]  # 5 6 is only 2 long
    assert shared_runs(ids, spans, 24, run=2)[[6, 7, 13, 14, 21, 22]].all()
    assert not shared_runs(ids, spans[:1], 24).any()  # one chunk repeats nothing
    assert not shared_runs(torch.arange(24), spans, 24).any()  # no run in every chunk


def test_markup_takes_every_layer_after_the_sinks_within_its_share():
    spans = [(4, 24), (24, 44)]
    s = torch.full((4, 44), 1e-3)
    s[:, 30] = 1.0  # the query's token, outside the markup
    markup = torch.zeros(44, dtype=torch.bool)
    markup[[10, 11, 12, 34, 35, 36]] = True
    s[:, 35] = 0.5  # the query ranks this copy of the markup first
    base = relaxkv_exit_layers(s, spans, 0.2, 1)  # 32 token-layers: 2 sinks (8), then the hull
    assert torch.equal(relaxkv_exit_layers(s, spans, 0.2, 1, markup=markup, markup_share=0.0), base)
    # a layout without repeated markup plans as before, whatever the share
    assert torch.equal(relaxkv_exit_layers(s, spans, 0.2, 1, markup=torch.zeros(44, dtype=torch.bool),
                                           markup_share=1.0), base)
    # share 0.5: 16 token-layers, 4 markup tokens every layer, query-ranked first (35), then offset order
    ex = relaxkv_exit_layers(s, spans, 0.2, 1, markup=markup, markup_share=0.5)
    assert ex[[10, 11, 12, 34, 35, 36]].tolist() == [4, 4, 4, 0, 4, 0]
    assert ex[4] == ex[24] == ex[30] == 4  # the sinks, then the hull's first pick
    assert int(ex.sum()) == int(base.sum()) == 32  # the budget is met exactly
    # share 1: whatever the sinks leave; the markup never exceeds it
    ex = relaxkv_exit_layers(s, spans, 0.2, 1, markup=markup, markup_share=1.0)
    assert ex[markup].eq(4).all() and int(ex.sum()) == 32
    assert relaxkv_exit_layers(s, spans, 0.05, 1, markup=markup, markup_share=1.0)[markup].eq(0).all()  # sinks first
    # the invariants: ratio 1 recomputes everything, ratio 0 nothing
    assert relaxkv_exit_layers(s, spans, 1.0, 1, markup=markup, markup_share=1.0)[4:].eq(4).all()
    assert relaxkv_exit_layers(s, spans, 0.0, 1, markup=markup, markup_share=1.0).eq(0).all()


def test_plan_anchors_the_markup_the_chunks_repeat():
    ids = torch.tensor([0, 1, 2, 3] + [7, 8, 9] + list(range(20, 35)) + [7, 8, 9] + list(range(40, 55)))
    spans, n_ctx = [(4, 22), (22, 40)], 40
    scores = torch.rand(4, n_ctx, generator=torch.Generator().manual_seed(0))
    config = RepairConfig.from_knobs(chunk_sink_tokens=1, markup_share=1.0, anchor_ratio=0.25)
    plan = schedule_anchors("relaxkv", scores, spans, n_ctx, 4, config, input_ids=ids)
    assert set(range(4, 7)) | set(range(22, 25)) <= set(plan.anchor_sets[-1].tolist())
    with pytest.raises(ValueError, match="input_ids"):
        schedule_anchors("relaxkv", scores, spans, n_ctx, 4, config)
    with pytest.raises(ValueError, match="markup_share"):
        RepairConfig.from_knobs(markup_share=1.5)
