"""Repair policies inside SGLang's prefill: the invariants, end to end (tiny model)."""

from __future__ import annotations

import pytest
import requests
import torch
from rag_helpers import documents, flush, marked_prompt, part_token_ids

pytestmark = pytest.mark.e2e


def _run(url, prompt, policy, anchor=None, context=None, budget=None):
    custom = {"relaxkv_chunks": prompt.offsets, "relaxkv_policy": policy}
    if anchor is not None:
        custom["relaxkv_anchor_ratio"] = anchor
    if context is not None:
        custom["relaxkv_context_ratio"] = context
    if budget is not None:
        custom["relaxkv_budget"] = budget
    body = {"text": prompt.text, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "custom_params": custom}}
    response = requests.post(url + "/generate", json=body, timeout=120)
    response.raise_for_status()
    out = response.json()
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], out["meta_info"]["relaxkv"]


@pytest.fixture(scope="module")
def warm_prompt(relaxkv_server):
    """Chunks cached by a first request; the measured prompt reorders them after another system prompt."""
    flush(relaxkv_server.url)
    docs = documents(3, seed=31)
    _run(relaxkv_server.url, marked_prompt("You are a helpful assistant.", docs, "Question: first?"), "pic")
    return marked_prompt("Answer from the documents.", [docs[1], docs[2], docs[0]], "Question: which?")


def test_full_repair_reproduces_full_prefill(relaxkv_server, warm_prompt):
    full_ids, full_lp, _ = _run(relaxkv_server.url, warm_prompt, "full")
    _, pic_lp, _ = _run(relaxkv_server.url, warm_prompt, "pic")
    assert pic_lp != pytest.approx(full_lp, abs=1e-3)  # the repair has something to fix
    for policy in ("relaxkv", "prophetkv", "epic", "cacheblend", "relaxkv_randctx"):
        ids, lp, record = _run(relaxkv_server.url, warm_prompt, policy, anchor=1.0, context=1.0)
        assert record["repaired"] and record["chunks_hit"] == 3, (policy, record)
        assert record["anchor_ratio"] == pytest.approx(1.0)
        assert ids == full_ids, policy
        assert lp == pytest.approx(full_lp, abs=1e-4), policy


def test_zero_anchors_reproduce_pic(relaxkv_server, warm_prompt):
    pic_ids, pic_lp, _ = _run(relaxkv_server.url, warm_prompt, "pic")
    full_ids, full_lp, _ = _run(relaxkv_server.url, warm_prompt, "full")
    assert pic_lp != pytest.approx(full_lp, abs=1e-3)  # the repair has something to fix
    for policy in ("relaxkv", "prophetkv", "epic"):
        ids, lp, record = _run(relaxkv_server.url, warm_prompt, policy, anchor=0.0, context=0.5)
        assert record["anchors_per_layer"] == 0 and record["repair_kv_pairs"] == 0
        assert ids == pic_ids and lp == pytest.approx(pic_lp, abs=1e-5), policy


def test_budget_one_is_full_prefill_zero_is_pic_and_relaxkv_buys_more_anchors(relaxkv_server, warm_prompt):
    full_ids, full_lp, _ = _run(relaxkv_server.url, warm_prompt, "full")
    pic_ids, pic_lp, _ = _run(relaxkv_server.url, warm_prompt, "pic")
    assert pic_lp != pytest.approx(full_lp, abs=1e-3)  # the repair has something to fix
    for policy in ("relaxkv", "prophetkv"):
        ids, lp, record = _run(relaxkv_server.url, warm_prompt, policy, budget=1.0)
        assert record["budget"] == 1.0 and record["anchor_ratio"] == pytest.approx(1.0)
        assert ids == full_ids and lp == pytest.approx(full_lp, abs=1e-4), policy
        ids, lp, record = _run(relaxkv_server.url, warm_prompt, policy, budget=0.0)
        assert record["anchors_per_layer"] == 0
        assert ids == pic_ids and lp == pytest.approx(pic_lp, abs=1e-5), policy
    # At one budget, the peer's anchors attend to their whole prefix, relaxkv's to part of it:
    # relaxkv buys more anchors for the same estimated cost.
    relaxed = _run(relaxkv_server.url, warm_prompt, "relaxkv", budget=0.2)[2]
    peer = _run(relaxkv_server.url, warm_prompt, "prophetkv", budget=0.2)[2]
    assert peer["anchor_ratio"] == pytest.approx(0.2, abs=0.02)
    assert relaxed["anchor_ratio"] > peer["anchor_ratio"] and relaxed["context_ratio"] < 1.0


def test_full_context_reproduces_the_same_targets_with_full_context(relaxkv_server, warm_prompt):
    relaxed = _run(relaxkv_server.url, warm_prompt, "relaxkv", anchor=0.15, context=1.0)
    fullctx = _run(relaxkv_server.url, warm_prompt, "relaxkv_fullctx", anchor=0.15)
    assert relaxed[0] == fullctx[0]
    assert relaxed[1] == pytest.approx(fullctx[1], abs=1e-5)
    assert relaxed[2]["repair_kv_pairs"] == fullctx[2]["repair_kv_pairs"] > 0
    pic_lp = _run(relaxkv_server.url, warm_prompt, "pic")[1]
    assert relaxed[1] != pytest.approx(pic_lp, abs=1e-3)  # both repaired, not answered as pic


def test_repair_work_shrinks_with_the_context_ratio(relaxkv_server, warm_prompt):
    pairs = []
    for ratio in (1.0, 0.5, 0.25):
        _, _, record = _run(relaxkv_server.url, warm_prompt, "relaxkv", anchor=0.15, context=ratio)
        assert record["anchor_ratio"] == pytest.approx(0.15, abs=0.01)
        pairs.append(record["repair_kv_pairs"])
    assert pairs[0] > pairs[1] > pairs[2] > 0


def test_partial_repair_moves_toward_full(relaxkv_server, warm_prompt):
    _, full_lp, _ = _run(relaxkv_server.url, warm_prompt, "full")
    _, pic_lp, _ = _run(relaxkv_server.url, warm_prompt, "pic")
    _, half_lp, _ = _run(relaxkv_server.url, warm_prompt, "relaxkv_fullctx", anchor=0.5)
    pic_err = abs(pic_lp[0] - full_lp[0])
    assert abs(half_lp[0] - full_lp[0]) < pic_err


# Cold chunks (no request has cached them): the request's misses run through SGLang's forward,
# as pic's do, and that forward is the repair's query pass (forward/repair_stage.py). The repair it gets is
# the one the same request gets on warm chunks, and the invariants hold as on warm chunks.

@pytest.fixture(scope="module")
def cold_prompt():
    return marked_prompt("You are a careful reader.", documents(3, seed=35), "Question: which one, and why?")


def _cold(url, prompt, policy, **knobs):
    flush(url)
    ids, lp, record = _run(url, prompt, policy, **knobs)
    assert record.get("chunks_hit", 0) == 0, (policy, record)
    return ids, lp, record


@pytest.mark.parametrize("policy,anchor,context", [
    ("relaxkv", 0.3, 0.5), ("prophetkv", 0.3, None), ("cacheblend", 0.3, None), ("epic", 0.15, None),
])
def test_cold_repair_equals_the_same_request_on_warm_chunks(relaxkv_server, cold_prompt, policy, anchor, context):
    url = relaxkv_server.url
    cold = _cold(url, cold_prompt, policy, anchor=anchor, context=context)
    warm = _run(url, cold_prompt, policy, anchor=anchor, context=context)  # its chunks are cached now
    assert cold[2]["repaired"] and warm[2]["repaired"] and warm[2]["chunks_hit"] == 3
    for key in ("anchor_ratio", "anchors_per_layer", "repair_kv_pairs", "repair_kv_pairs_executed"):
        assert cold[2][key] == warm[2][key], key
    assert cold[2]["anchors_per_layer"] > 0
    assert cold[0] == warm[0]
    assert cold[1] == pytest.approx(warm[1], abs=1e-5)
    # the cold request computed its chunks and the repair, the warm one only the repair
    assert cold[2]["tokens_computed"] > warm[2]["tokens_computed"]


def test_cold_full_repair_is_full_prefill_and_zero_anchors_are_pic(relaxkv_server, cold_prompt):
    url = relaxkv_server.url
    full_ids, full_lp, _ = _cold(url, cold_prompt, "full")
    pic_ids, pic_lp, _ = _cold(url, cold_prompt, "pic")
    assert pic_lp != pytest.approx(full_lp, abs=1e-3)  # the repair has something to fix
    for policy in ("relaxkv", "prophetkv", "epic", "cacheblend"):
        ids, lp, record = _cold(url, cold_prompt, policy, anchor=1.0, context=1.0)
        assert record["repaired"] and record["anchor_ratio"] == pytest.approx(1.0), policy
        assert ids == full_ids and lp == pytest.approx(full_lp, abs=1e-4), policy
    for policy in ("relaxkv", "prophetkv", "epic"):  # CacheBlend always recomputes up to its check layer
        ids, lp, record = _cold(url, cold_prompt, policy, anchor=0.0, context=0.5)
        assert record["repaired"] and record["anchors_per_layer"] == 0, policy
        assert ids == pic_ids and lp == pytest.approx(pic_lp, abs=1e-5), policy


def _reference_logprobs(weights, tokenizer, prompt, policy, anchor, context):
    from relaxkv_sglang.repair.reference import reference_prefill
    from relaxkv_sglang.repair.repair_config import RepairConfig

    layout = part_token_ids(tokenizer, prompt)
    result = reference_prefill(weights, torch.tensor(layout.input_ids), layout.chunk_spans, layout.query_start,
                               policy, RepairConfig(anchor_ratio=anchor, context_ratio=context))
    return torch.log_softmax(result.last_logits.float(), -1), result.report


@pytest.mark.parametrize("policy,anchor,context,cached", [
    ("pic", 0.0, 1.0, True), ("epic", 0.3, 1.0, True), ("prophetkv", 0.3, 1.0, True), ("relaxkv", 0.3, 0.25, True),
    ("relaxkv_fullctx", 0.3, 1.0, True), ("relaxkv", 0.3, 0.25, False), ("pic", 0.0, 1.0, False),
])
def test_server_repair_matches_the_torch_reference(relaxkv_server, tokenizer, reference_weights, policy, anchor, context,
                                                   cached):
    """The server's repair (folded batch, own layer loop, pool slots) equals repair.reference on the same tokens,
    on chunks cached by an earlier request and on cold chunks computed by the request itself."""
    flush(relaxkv_server.url)
    docs = documents(3, seed=33)
    if cached:
        warm = marked_prompt("Warm-up system prompt.", docs[::-1], "Q?", glue=False)
        _run(relaxkv_server.url, warm, "pic")
    prompt = marked_prompt("You answer questions.", docs, "Question: what?", glue=False)
    body = {"text": prompt.text, "return_logprob": True, "top_logprobs_num": 5, "sampling_params": {
        "max_new_tokens": 1, "temperature": 0, "custom_params": {
            "relaxkv_chunks": prompt.offsets, "relaxkv_policy": policy,
            "relaxkv_anchor_ratio": anchor, "relaxkv_context_ratio": context}}}
    served = requests.post(relaxkv_server.url + "/generate", json=body, timeout=120).json()
    assert served["meta_info"]["relaxkv"]["chunks_hit"] == (3 if cached else 0)
    ref_lp, report = _reference_logprobs(reference_weights, tokenizer, prompt, policy, anchor, context)
    top = served["meta_info"]["output_top_logprobs"][0]
    assert served["output_ids"][0] == int(ref_lp.argmax())
    for logprob, token, _ in top:
        assert logprob == pytest.approx(float(ref_lp[token]), abs=2e-3), (policy, token)
    if policy != "pic":
        assert served["meta_info"]["relaxkv"]["repair_kv_pairs"] == report.repair_kv_pairs > 0
        # pic's reference is far outside the tolerance: matching the policy's is not matching pic's
        pic_lp, _ = _reference_logprobs(reference_weights, tokenizer, prompt, "pic", 0.0, 1.0)
        assert max(abs(logprob - float(pic_lp[token])) for logprob, token, _ in top) > 0.05, (policy, "pic")
