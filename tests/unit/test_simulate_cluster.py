"""The cluster simulator (benchmarks/simulate_cluster.py): its router models and its accounting, on values."""

from __future__ import annotations

import pytest

from benchmarks import simulate_cluster as sc


def _trace(requests: list[tuple[int, tuple[int, ...]]], doc_tokens: int = 100, prefix: int = 10) -> sc.Trace:
    """Requests (system, docs) with every document ``doc_tokens`` tokens, a ``prefix``-token system prompt, 5 more."""
    docs = {d for _, ds in requests for d in ds}
    reqs = [sc.SimRequest(s, ds, prefix, prefix + doc_tokens * len(ds) + 5) for s, ds in requests]
    return sc.Trace(reqs, {d: doc_tokens for d in docs})


def test_one_replica_sequential_hit_rate_is_exact():
    # request 2 reuses doc 1 and the system prompt; request 3 reuses docs 1, 2 and the system prompt
    trace = _trace([(0, (1, 2)), (0, (3, 1)), (0, (2, 1))])
    out = sc.simulate(trace, 1, "round_robin", pool_tokens=10_000, clients=1)
    cached = 0 + (10 + 100) + (10 + 200)
    prompt = 3 * (10 + 200 + 5)
    assert out["hit_rate_pct"] == pytest.approx(100 * cached / prompt)
    assert out["per_replica_requests"] == [3]
    assert out["evicted_tokens"] == 0


def test_requests_in_flight_do_not_see_each_others_chunks():
    trace = _trace([(0, (1,)), (1, (1,)), (2, (1,))])
    # 2 clients: request 1 starts before request 0 has finished (no hit, and a duplicate insert);
    # request 2 starts after request 0 finished (hit)
    out = sc.simulate(trace, 1, "round_robin", pool_tokens=10_000, clients=2)
    assert out["hit_rate_pct"] == pytest.approx(100 * 100 / (3 * 115))
    assert out["duplicate_inserts"] == 1


def test_a_small_pool_evicts_with_the_pool_chunk_index():
    trace = _trace([(0, (d,)) for d in range(10)] * 2)  # 10 documents twice, in the same order
    roomy = sc.simulate(trace, 1, "round_robin", pool_tokens=10_000, clients=1)
    tight = sc.simulate(trace, 1, "round_robin", pool_tokens=500, clients=1)  # 4 documents fit
    assert roomy["evicted_tokens"] == 0 and tight["evicted_tokens"] > 0
    # LRU over a cyclic pattern larger than the pool: every document is evicted before its reuse
    assert tight["hit_rate_pct"] == pytest.approx(100 * 19 * 10 / (20 * 115))  # only the system prompt hits
    assert roomy["hit_rate_pct"] > tight["hit_rate_pct"]


def test_document_routing_is_sticky_by_document_set_and_assigns_new_keys_by_turn():
    trace = _trace([(0, (1, 2, 3)), (1, (3, 1, 2)), (2, (7, 8, 9)), (0, (4, 5, 6))])
    router = sc.Router("document", 3, trace, seed=0)
    assert router.route(trace.requests[0], [0, 0, 0]) == 0  # the first new key: the first turn
    assert router.route(trace.requests[1], [5, 0, 0]) == 0  # same documents, another order and system
    assert router.route(trace.requests[2], [0, 0, 0]) == 1  # the next new key: the next turn, whatever the loads
    assert router.route(trace.requests[3], [0, 0, 9]) == 2


def test_cache_aware_follows_text_prefixes_and_balances_when_imbalanced():
    trace = _trace([(0, (1, 2, 3)), (0, (1, 2, 3)), (0, (3, 2, 1)), (1, (4, 5, 6))])
    router = sc.Router("cache_aware", 2, trace, seed=0, balance_abs=2, balance_rel=1.5)
    a = router.route(trace.requests[0], [0, 0])
    assert router.route(trace.requests[1], [0, 0]) == a  # the same text: full match
    # the same documents reordered match only the system prompt (< 30% of the text): smallest tree
    assert router.route(trace.requests[2], [0, 0]) == 1 - a
    # imbalanced (3 - 0 > 2 and 3 > 1.5 x 0): the least loaded, whatever the match
    assert router.route(trace.requests[1], [3, 0]) == 1


def test_round_robin_and_imbalance_figures():
    trace = sc.synthetic_trace(40, docs=50, zipf=1.0, k=3, doc_tokens=50, systems=2, seed=0)
    out = sc.simulate(trace, 4, "round_robin", 4096, clients=4)
    assert out["per_replica_requests"] == [10, 10, 10, 10]
    assert out["max_over_min"] == 1.0 and out["max_over_mean"] == 1.0


def test_topical_trace_document_routing_beats_round_robin_at_scale():
    trace = sc.synthetic_trace(8 * 200, docs=4000, zipf=1.0, k=5, doc_tokens=100, systems=3, seed=0, topics=400)
    assert all(len({d // 10 for d in r.docs}) == 1 for r in trace.requests)  # one topic per request
    doc = sc.simulate(trace, 8, "document", 8192, clients=16)
    rr = sc.simulate(trace, 8, "round_robin", 8192, clients=16)
    ideal = sc.simulate(trace, 1, "round_robin", 8 * 8192, clients=16)
    assert rr["hit_rate_pct"] + 10 < doc["hit_rate_pct"] <= ideal["hit_rate_pct"] + 1
    assert doc["max_over_mean"] < 1.5
