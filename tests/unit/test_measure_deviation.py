"""``python -m scripts.measure_deviation`` on the tiny model: its exact-KV bounds hold the invariants."""

from __future__ import annotations

import pytest
import torch

from benchmarks import quality_tasks
from relaxkv_sglang.repair.reference import query_over, reference_prefill, stale_context


@pytest.fixture(scope="module")
def case():
    from scripts.ablate_repair import load_reference, request_tokens

    weights, tokenizer, _ = load_reference("tiny-llama")
    example = quality_tasks.task_examples("niah_multivalue", 1, seed=0)[0]
    return weights, *request_tokens(tokenizer, example, "tagged")


def test_exact_kv_everywhere_is_full_prefill_and_nowhere_is_pic(case):
    from scripts.measure_deviation import exact_at, token_groups

    weights, ids, spans, q0 = case
    full = reference_prefill(weights, ids, spans, q0, "full")
    stale = stale_context(weights, ids, spans, q0)
    masks = token_groups(spans, q0)
    every_chunk_token = masks["opening"] | masks["1-3"] | masks["body"]
    # glue and prefix are computed over the stale context in pic: exact them too for the full bound
    everything = torch.ones(q0, dtype=torch.bool)
    exact = query_over(weights, ids, q0, exact_at(stale.kv, full.kv, everything))[0]
    torch.testing.assert_close(exact, full.last_logits, atol=2e-4, rtol=0)
    nothing = query_over(weights, ids, q0, exact_at(stale.kv, full.kv, torch.zeros(q0, dtype=torch.bool)))[0]
    torch.testing.assert_close(nothing, stale.pic_logits, atol=1e-5, rtol=0)
    assert int(masks["opening"].sum()) == len(spans)  # one opening per chunk
    assert int(every_chunk_token.sum()) == sum(e - s for s, e in spans)


def test_measure_case_reports_the_profile_and_bounds(case):
    from scripts.measure_deviation import BOUNDS, GROUPS, measure_case

    weights, ids, spans, q0 = case
    row = measure_case(weights, ids, spans, q0, anchor_ratio=0.15, seed=0)
    assert len(row["profile"]) == weights.n_layers
    assert row["profile"][0]["body"]["k_err"] < 1e-4  # layer 0: a chunk token's K/V depend on it alone
    assert set(row["profile"][-1]) == set(GROUPS)
    assert all(row[b] >= 0 for b in BOUNDS) and 0 <= row["opening_mass_stale"] <= 1
    assert row["chunks"] == len(spans)
    assert 0 < row["markup_share"] < 0.5  # tagged: every chunk repeats its tags, the text differs


def test_measure_deviation_refuses_the_test_split():
    from scripts import measure_deviation

    with pytest.raises(SystemExit):
        measure_deviation.main(["--model", "tiny-llama", "--offset", "3000"])
