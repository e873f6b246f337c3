"""Tenant isolation: ``cache_salt`` / ``extra_key`` namespaces, end to end (tiny model).

A document cached by tenant A is a miss for tenant B (no cross-tenant
``cached_tokens``), in the chunk tree and in SGLang's radix tree, on the native
API, the OpenAI APIs and batches. What the namespaces do not hide, measured
here and written up in docs/reliability.md ("Isolation"): the time to first
token of a hit, within one namespace, and the shared KV pool's eviction
pressure, across namespaces.
"""

from __future__ import annotations

import statistics

import pytest
import requests
from rag_helpers import documents, flush, generate, marked_prompt, part_token_ids, relaxkv_state

from relaxkv_sglang.client import ServerClient

pytestmark = pytest.mark.e2e

TENANT_FIELDS = ["cache_salt", "extra_key"]


@pytest.fixture
def url(relaxkv_server) -> str:
    """The shared server with an empty cache (no pressure from earlier tests)."""
    flush(relaxkv_server.url)
    return relaxkv_server.url


def chunk_tokens(tokenizer, prompt) -> int:
    return sum(e - s for s, e in part_token_ids(tokenizer, prompt).chunk_spans)


@pytest.mark.parametrize("field", TENANT_FIELDS)
def test_chunks_cached_by_one_tenant_miss_for_another(url, tokenizer, field):
    docs = documents(3, seed=71)
    prompt = marked_prompt("Sys.", docs, "Q?")
    first = generate(url, prompt, policy="pic", **{field: "tenant-a"})
    assert first["meta_info"]["relaxkv"]["chunks_hit"] == 0
    other = generate(url, prompt, policy="pic", **{field: "tenant-b"})  # same text, same offsets
    assert other["meta_info"]["cached_tokens"] == 0
    assert (other["meta_info"]["relaxkv"]["chunks_seen"], other["meta_info"]["relaxkv"]["chunks_hit"]) == (3, 0)

    reordered = marked_prompt("Other sys.", docs[::-1], "Q2?")
    again = generate(url, reordered, policy="pic", **{field: "tenant-a"})
    assert again["meta_info"]["relaxkv"]["chunks_hit"] == 3
    assert again["meta_info"]["cached_tokens"] >= chunk_tokens(tokenizer, reordered)
    # B's own request stored B's copy: B now hits in its own namespace.
    own = generate(url, reordered, policy="pic", **{field: "tenant-b"})
    assert own["meta_info"]["relaxkv"]["chunks_hit"] == 3


@pytest.mark.parametrize("field", TENANT_FIELDS)
def test_radix_prefix_is_not_shared_between_tenants(url, field):
    prompt = marked_prompt("Sys.", documents(2, seed=72), "Q?")
    first = generate(url, prompt, policy="prefix", **{field: "tenant-a"})
    other = generate(url, prompt, policy="prefix", **{field: "tenant-b"})
    assert other["meta_info"]["cached_tokens"] == 0
    again = generate(url, prompt, policy="prefix", **{field: "tenant-a"})
    # The whole prompt but its last token (computed for the first output's logits).
    assert again["meta_info"]["cached_tokens"] == first["meta_info"]["prompt_tokens"] - 1


def test_no_salt_a_salt_and_an_extra_key_are_three_namespaces(url):
    # What a salted tenant cached is a miss without a salt (nothing unsalted is cached yet:
    # even the BOS token is not shared) ...
    salted = marked_prompt("Sys.", documents(2, seed=74), "Q?")
    generate(url, salted, policy="pic", cache_salt="x")
    assert generate(url, salted, policy="pic")["meta_info"]["cached_tokens"] == 0
    assert generate(url, salted, policy="pic", cache_salt="x")["meta_info"]["relaxkv"]["chunks_hit"] == 2
    # ... and what unsalted requests cached is a miss for a salt, and for an extra_key of the same value.
    shared = marked_prompt("Another system prompt.", documents(2, seed=73), "Q?")
    generate(url, shared, policy="pic")
    for tenant in ({"cache_salt": "y"}, {"extra_key": "y"}):
        response = generate(url, shared, policy="pic", **tenant)
        assert response["meta_info"]["cached_tokens"] == 0, tenant


def test_extra_key_and_salt_pairs_do_not_collide(url):
    # With a bare separator between the two fields these pairs would share a namespace.
    prompt = marked_prompt("Sys.", documents(2, seed=75), "Q?")
    generate(url, prompt, policy="pic", extra_key="a\x1f", cache_salt="b")
    other = generate(url, prompt, policy="pic", extra_key="a", cache_salt="\x1fb")
    assert other["meta_info"]["relaxkv"]["chunks_hit"] == 0
    assert other["meta_info"]["cached_tokens"] == 0


def _chat(url: str, system: str, docs: list[str], question: str, salt: str) -> dict:
    content = [{"type": "text", "text": d} for d in docs] + [{"type": "text", "text": question}]
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "return_meta_info": True, "cache_salt": salt,
            "custom_params": {"relaxkv_policy": "pic"},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}]}
    response = requests.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["meta_info"]


def test_chat_documents_are_isolated_by_cache_salt(url):
    docs = documents(3, seed=76)
    assert _chat(url, "Use the documents.", docs, "What?", "tenant-a")["relaxkv"]["chunks_seen"] == 3
    other = _chat(url, "Use the documents.", docs, "What?", "tenant-b")
    assert other["cached_tokens"] == 0 and other["relaxkv"]["chunks_hit"] == 0
    again = _chat(url, "Another system prompt.", docs[::-1], "Who?", "tenant-a")
    assert again["relaxkv"]["chunks_hit"] == 3


def test_completions_and_batches_carry_their_salt(url):
    prompt = marked_prompt("Sys.", documents(2, seed=77), "Q?")
    completion = {"model": "tiny", "max_tokens": 2, "prompt": prompt.text,
                  "custom_params": {"relaxkv_policy": "pic", "relaxkv_chunks": prompt.offsets}}
    for salt, hits in (("tenant-a", 0), ("tenant-b", 0), ("tenant-a", 2)):
        before = relaxkv_state(url)["chunk_hits"]  # completions return no meta_info: count on the server
        response = requests.post(url + "/v1/completions", json=dict(completion, cache_salt=salt), timeout=120)
        assert response.status_code == 200, response.text
        assert relaxkv_state(url)["chunk_hits"] - before == hits, salt
    # One batch, one salt per item: item 0 is tenant A's (hit), item 1 a new tenant's (miss).
    sampling = {"max_new_tokens": 2, "custom_params": {"relaxkv_policy": "pic", "relaxkv_chunks": prompt.offsets}}
    body = {"text": [prompt.text, prompt.text], "sampling_params": [sampling, sampling],
            "cache_salt": ["tenant-a", "tenant-c"]}
    items = requests.post(url + "/generate", json=body, timeout=120).json()
    assert items[0]["meta_info"]["relaxkv"]["chunks_hit"] == 2
    assert items[1]["meta_info"]["cached_tokens"] == 0


def test_other_tenants_load_evicts_your_chunks(url):
    """The salt hides content, not load: the pool is shared, so B's traffic evicts A's chunks
    (the 8,192-token pool holds ~2,900 tokens per prompt below, twice: request and tree copy)."""
    mine = marked_prompt("Sys.", documents(8, seed=78), "Q?")
    generate(url, mine, policy="pic", cache_salt="tenant-a")
    undisturbed = generate(url, mine, policy="pic", cache_salt="tenant-a")["meta_info"]["relaxkv"]
    assert undisturbed["chunks_hit"] == 8
    evictions = relaxkv_state(url)["chunk_evictions"]
    for seed in (80, 81, 82):  # tenant B: other documents, ~2,500 tokens each request
        generate(url, marked_prompt("Other.", documents(25, seed=seed), "Q?"), policy="pic", cache_salt="tenant-b")
    assert relaxkv_state(url)["chunk_evictions"] > evictions
    disturbed = generate(url, mine, policy="pic", cache_salt="tenant-a")["meta_info"]["relaxkv"]
    assert disturbed["chunks_hit"] < 8


def test_time_to_first_token_of_a_hit_and_of_another_tenant(url, capsys):
    """Measured, printed, not asserted (timing on a shared 2-core machine is noisy):
    a same-namespace hit is the timing signal; another tenant sees a miss's time."""
    client = ServerClient(url, timeout=120)
    rows: dict[str, list[float]] = {}
    for policy in ("pic", "prefix"):
        for rnd in range(3):
            flush(url)
            prompt = marked_prompt("System.", documents(24, seed=90 + rnd), f"Question {rnd}?")
            # B comes last, when A's copy is certainly cached: B must not be able to tell.
            for label, salt in (("miss", "tenant-a"), ("hit", "tenant-a"), ("other tenant", "tenant-b")):
                out = client.generate_stream(prompt.text, prompt.offsets, policy, max_new_tokens=1, cache_salt=salt)
                if label == "other tenant":
                    assert out["meta_info"]["cached_tokens"] == 0
                if label == "hit":
                    assert out["meta_info"]["cached_tokens"] > 0.5 * out["meta_info"]["prompt_tokens"]
                rows.setdefault(f"{policy} {label}", []).append(out["ttft_s"])
    medians = {key: statistics.median(values) for key, values in rows.items()}
    with capsys.disabled():
        print("\nTTFT medians (s), ~2,400-token prompts, tiny model, 3 rounds: " + ", ".join(
            f"{key} {value:.3f}" for key, value in medians.items()))
        for policy in ("pic", "prefix"):
            print(f"  {policy}: other tenant / hit = "
                  f"{medians[f'{policy} other tenant'] / medians[f'{policy} hit']:.1f}x, "
                  f"miss / hit = {medians[f'{policy} miss'] / medians[f'{policy} hit']:.1f}x")
