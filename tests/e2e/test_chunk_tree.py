"""The position-independent chunk tree, end to end against real SGLang servers (tiny model)."""

from __future__ import annotations

import re

import pytest
import requests
import torch
from rag_helpers import check_idle, documents, flush, generate, marked_prompt, part_token_ids, relaxkv_state

pytestmark = pytest.mark.e2e


def _top_logprobs(response: dict, step: int = 0) -> dict[int, float]:
    return {tok: lp for lp, tok, _ in response["meta_info"]["output_top_logprobs"][step]}


def test_full_policy_equals_stock_sglang(server, relaxkv_server, tokenizer):
    prompt = marked_prompt("Answer from the documents.", documents(3, seed=1), "Question: what is this about?")
    ours = generate(relaxkv_server.url, prompt, policy="full", logprobs=True)
    layout = part_token_ids(tokenizer, prompt)
    body = {"input_ids": layout.input_ids, "return_logprob": True, "top_logprobs_num": 5,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    stock = requests.post(server.url + "/generate", json=body, timeout=120).json()
    assert ours["output_ids"] == stock["output_ids"]
    assert ours["meta_info"]["cached_tokens"] == 0
    ours_lp = [lp for lp, _, _ in ours["meta_info"]["output_token_logprobs"]]
    stock_lp = [lp for lp, _, _ in stock["meta_info"]["output_token_logprobs"]]
    assert ours_lp == pytest.approx(stock_lp, abs=1e-4)


def test_pic_all_misses_equals_independent_chunk_reference(relaxkv_server, tokenizer, reference_weights):
    from relaxkv_sglang.repair.reference import reference_prefill

    prompt = marked_prompt("", documents(3, seed=2), "Question: summarize.", glue=False)
    assert prompt.offsets[0] == 0  # empty prefix
    response = generate(relaxkv_server.url, prompt, policy="pic", logprobs=True)
    record = response["meta_info"]["relaxkv"]
    assert (record["chunks_seen"], record["chunks_hit"]) == (3, 0)

    layout = part_token_ids(tokenizer, prompt)
    ids = torch.tensor(layout.input_ids)
    pic = reference_prefill(reference_weights, ids, layout.chunk_spans, layout.query_start, "pic")
    full = reference_prefill(reference_weights, ids, layout.chunk_spans, layout.query_start, "full")
    pic_lp = torch.log_softmax(pic.last_logits.float(), -1)
    full_lp = torch.log_softmax(full.last_logits.float(), -1)
    served = _top_logprobs(response)
    assert response["output_ids"][0] == int(pic_lp.argmax())
    for token, logprob in served.items():
        assert logprob == pytest.approx(float(pic_lp[token]), abs=2e-3)
    # Non-vacuous: the independent-chunk KV really differs from full prefill here.
    assert float((pic_lp - full_lp).abs().max()) > 1e-2


def test_documents_hit_in_another_order_after_another_system_prompt(relaxkv_server, tokenizer):
    docs = documents(3, seed=3)
    first = generate(relaxkv_server.url, marked_prompt("You are a helpful assistant.", docs, "Q: who?"), policy="pic")
    assert first["meta_info"]["relaxkv"]["chunks_hit"] == 0
    second_prompt = marked_prompt("Answer briefly.", [docs[2], docs[0], docs[1]], "Q: when?")
    second = generate(relaxkv_server.url, second_prompt, policy="pic")
    record = second["meta_info"]["relaxkv"]
    chunk_tokens = sum(e - s for s, e in part_token_ids(tokenizer, second_prompt).chunk_spans)
    assert (record["chunks_seen"], record["chunks_hit"]) == (3, 3)
    assert record["chunk_tokens_reused"] == chunk_tokens
    assert second["meta_info"]["cached_tokens"] >= chunk_tokens


def _metric(url: str, name: str, label: str = "") -> float:
    text = requests.get(url + "/metrics", timeout=30).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and label in line and not line.startswith("#")]
    assert values, f"{name} {label} not on /metrics"
    return sum(values)


def _model_names(url: str, prefix: str) -> set[str]:
    """The model_name label values of the /metrics series whose names start with ``prefix``."""
    text = requests.get(url + "/metrics", timeout=30).text
    return set(re.findall(rf'^{re.escape(prefix)}\w*{{[^}}]*model_name="([^"]*)"', text, re.M))


def test_metrics_see_chunk_hits(relaxkv_server):
    url = relaxkv_server.url
    docs = documents(3, seed=12)
    generate(url, marked_prompt("One.", docs, "Q1?"), policy="pic")
    before = {name: _metric(url, name) for name in (
        "relaxkv:chunk_hits_total", "relaxkv:chunk_miss_tokens_total", "sglang:cached_tokens_total",
        "sglang:prompt_tokens_total")}
    device_before = _metric(url, "sglang:cached_tokens_total", 'cache_source="device"')
    second = generate(url, marked_prompt("Two.", docs[::-1], "Q2?"), policy="pic")["meta_info"]
    assert _metric(url, "relaxkv:chunk_hits_total") == before["relaxkv:chunk_hits_total"] + 3
    assert _metric(url, "relaxkv:chunk_miss_tokens_total") == before["relaxkv:chunk_miss_tokens_total"]
    # SGLang's own per-source accounting sees the chunk hits (served from the device pool).
    assert second["cached_tokens"] >= second["relaxkv"]["chunk_tokens_reused"] > 0
    assert second["cached_tokens_details"]["device"] == second["cached_tokens"]
    assert second["cached_tokens_details"]["host"] == 0
    device_after = _metric(url, "sglang:cached_tokens_total", 'cache_source="device"')
    assert device_after - device_before == second["cached_tokens"]
    assert _metric(url, "relaxkv:chunk_tokens_held", 'model_name="') > 0
    assert _metric(url, "relaxkv:chunk_entries", 'model_name="') >= 3
    # the plugin's series carry SGLang's own model_name label (once "None")
    assert _model_names(url, "relaxkv:chunk_") == _model_names(url, "sglang:") != {"None"}
    # The counters' hit rate (cached over prompt tokens, summed over sources) is the gauge of
    # SGLang's last prefill (this request's): dashboards on either agree.
    cached = _metric(url, "sglang:cached_tokens_total") - before["sglang:cached_tokens_total"]
    prompt = _metric(url, "sglang:prompt_tokens_total") - before["sglang:prompt_tokens_total"]
    assert prompt == second["prompt_tokens"] and cached == second["cached_tokens"]
    gauge = _metric(url, "sglang:cache_hit_rate")
    assert gauge > 0.5 and abs(cached / prompt - gauge) <= 0.02, (cached, prompt, gauge)


def test_prefix_policy_misses_what_pic_hits(relaxkv_server, tokenizer):
    docs = documents(3, seed=4)
    generate(relaxkv_server.url, marked_prompt("System one.", docs, "Q?"), policy="prefix")
    reordered = marked_prompt("System two.", docs[::-1], "Q?")
    prefix = generate(relaxkv_server.url, reordered, policy="prefix")
    chunk_tokens = sum(e - s for s, e in part_token_ids(tokenizer, reordered).chunk_spans)
    # Only the shared head of the system prompt ("<bos>System") can hit.
    assert prefix["meta_info"]["cached_tokens"] < 0.05 * chunk_tokens


def test_unmarked_prompt_is_chunked_by_content(relaxkv_server):
    docs = documents(3, seed=6)
    first = "You are helpful.\n\n" + "\n\n".join(docs) + "\n\nQuestion: one?"
    second = "Be brief.\n\n" + "\n\n".join([docs[1], docs[2], docs[0]]) + "\n\nQuestion: two?"
    generate(relaxkv_server.url, first, policy="pic")
    record = generate(relaxkv_server.url, second, policy="pic")["meta_info"]["relaxkv"]
    # Each document is found again wherever it sits (an essay paragraph may hold
    # a blank line of spaces, which the content-defined rule also cuts at).
    assert record["chunks_seen"] >= 3
    assert record["chunks_hit"] == record["chunks_seen"]


def test_policy_header_sets_the_policy_and_the_body_wins(relaxkv_server):
    """``X-RelaxKV-Policy``: the request's policy where the body names none (the server default here
    is ``prefix``); header names are case-insensitive; ``custom_params.relaxkv_policy`` wins."""
    prompt = marked_prompt("S.", documents(2, seed=9), "Q?")
    url = relaxkv_server.url + "/generate"

    def send(headers: dict, custom_params: dict) -> dict:
        body = {"text": prompt.text, "sampling_params": {"max_new_tokens": 2, "custom_params": custom_params}}
        response = requests.post(url, json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["meta_info"]

    flush(relaxkv_server.url)
    chunks = {"relaxkv_chunks": prompt.offsets}
    first = send({"X-RelaxKV-Policy": "pic"}, chunks)["relaxkv"]
    assert (first["policy"], first["chunks_seen"], first["chunks_hit"]) == ("pic", 2, 0)
    again = send({"x-relaxkv-policy": "relaxkv"}, chunks)["relaxkv"]
    assert (again["policy"], again["chunks_hit"]) == ("relaxkv", 2)
    body_wins = send({"X-RelaxKV-Policy": "relaxkv"}, dict(chunks, relaxkv_policy="full"))
    assert body_wins["relaxkv"]["policy"] == "full" and body_wins["cached_tokens"] == 0
    # Without the header the server default (prefix) serves the same body: no chunk report.
    plain = send({}, {})
    assert (plain.get("relaxkv") or {}).get("policy", "prefix") == "prefix", plain


def test_flush_returns_every_slot(relaxkv_server):
    generate(relaxkv_server.url, marked_prompt("S.", documents(4, seed=7), "Q?"), policy="pic")
    state = relaxkv_state(relaxkv_server.url)
    assert state["chunk_tokens_held"] > 0
    check_idle(relaxkv_server.url)
