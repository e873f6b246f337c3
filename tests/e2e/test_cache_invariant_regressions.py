"""A cache changes speed, never answers: one example per server bug the property found.

The property (``tests/e2e/test_request_options_property.py``) sends random requests under several
cache histories; each bug it found (or issue 46 reported) is kept here as a named example on the
session's relaxkv server (tiny model), so that it stays fixed whatever the property draws:

* input logprobs inside chunks (``logprob_start_len`` 0 or inside a chunk; ``/v1/completions``
  with ``echo`` + ``logprobs``): a warm request recomputed the rows it read at full scope where a
  cold one computed them at chunk scope, and generated other tokens (issue 46 item 1, ``forward/fold.py``);
* session turns: the plan's spans were built on the new turn alone, so a turn whose documents
  were warm reused none of them and published history fragments as chunks (item 2, ``request/plan.py``);
* discovery: an unmarked prompt's documents, once marked by a request of the same namespace, were
  found whole where before the block rules had cut them in pieces, so the prompt's chunking, and
  its answer, depended on what was sent before (and survived ``/flush_cache``; item 3,
  ``request/doc_index.py``);
* a streamed request the plugin refuses (``request/sglang/api.py::around_generate_request`` raises before
  SGLang normalizes the request) made SGLang's abort task raise 2 s later, and uvicorn dropped the
  keep-alive connection under the client's next request;
* a streamed chat lost the logprob of a token whose step had no text (``request/sglang/chat_stream_logprobs.py``).

Each cache test compares the same request sent cold (after ``/flush_cache``) and under another
history: equal output ids, output and input logprobs within :data:`LOGPROB_ABS`, and equal chunking.
Each runs in a namespace of its own (a fresh ``cache_salt``), so what other tests sent cannot matter.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
import requests
from rag_helpers import documents, essay_paragraphs, flush, marked_prompt, part_token_ids, relaxkv_state

pytestmark = pytest.mark.e2e

LOGPROB_ABS = 1e-4
TIMEOUT_S = 120


def fresh_namespace() -> dict:
    """A ``cache_salt`` no other request used: an empty chunk tree and document index."""
    return {"cache_salt": f"regression-{uuid.uuid4().hex}"}


def post(url: str, route: str, body: dict) -> dict:
    response = requests.post(url + route, json=body, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()


def logprobs(rows) -> list:
    """SGLang's ``[[logprob, token_id, text], ...]`` as ``(logprob, token_id)``."""
    return [(row[0], row[1]) for row in rows or []]


def assert_same_logprobs(cold: list, warm: list, what: str) -> None:
    assert len(cold) == len(warm), f"{what}: {len(cold)} vs {len(warm)} entries"
    for i, ((a, ta), (b, tb)) in enumerate(zip(cold, warm)):
        assert ta == tb, f"{what}[{i}]: token {ta!r} vs {tb!r}"
        assert (a is None and b is None) or abs(a - b) <= LOGPROB_ABS, f"{what}[{i}]: {a} cold vs {b} warm"


def assert_same_answer(cold: dict, warm: dict) -> None:
    """Equal output ids, output/input logprobs within 1e-4, equal chunking (``chunks_seen``)."""
    assert warm["output_ids"] == cold["output_ids"]
    for key in ("output_token_logprobs", "input_token_logprobs"):
        assert_same_logprobs(logprobs(cold["meta_info"].get(key)), logprobs(warm["meta_info"].get(key)), key)
    assert warm["meta_info"]["relaxkv"]["chunks_seen"] == cold["meta_info"]["relaxkv"]["chunks_seen"]


@pytest.fixture
def url(relaxkv_server) -> str:
    return relaxkv_server.url


@pytest.mark.parametrize("policy", ["pic", "relaxkv", "prophetkv"])
@pytest.mark.parametrize("start", ["zero", "inside_second_chunk"])
def test_input_logprobs_inside_chunks_are_the_same_cold_and_warm(url, tokenizer, policy, start):
    prompt = marked_prompt("Answer from the documents.", documents(3, seed=91), "Question: what?")
    spans = part_token_ids(tokenizer, prompt).chunk_spans
    logprob_start = 0 if start == "zero" else (spans[1][0] + spans[1][1]) // 2
    body = {"text": prompt.text, "return_logprob": True, "logprob_start_len": logprob_start, **fresh_namespace(),
            "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                "custom_params": {"relaxkv_chunks": prompt.offsets, "relaxkv_policy": policy}}}
    flush(url)
    cold = post(url, "/generate", body)
    warm = post(url, "/generate", body)
    assert (cold["meta_info"]["relaxkv"]["chunks_hit"], warm["meta_info"]["relaxkv"]["chunks_hit"]) == (0, 3)
    assert_same_answer(cold, warm)


@pytest.mark.parametrize("policy", ["pic", "relaxkv"])
def test_completions_echo_logprobs_are_the_same_cold_and_warm(url, policy):
    prompt = marked_prompt("Answer from the documents.", documents(2, seed=92), "Question: what?")
    body = {"model": "tiny", "prompt": prompt.text, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 2,
            **fresh_namespace(), "custom_params": {"relaxkv_chunks": prompt.offsets, "relaxkv_policy": policy}}

    def complete() -> tuple[dict, int]:
        before = relaxkv_state(url)["chunk_hits"]  # completions return no meta_info: count on the server
        return post(url, "/v1/completions", body)["choices"][0], relaxkv_state(url)["chunk_hits"] - before

    flush(url)
    (cold, cold_hits), (warm, warm_hits) = complete(), complete()
    assert (cold_hits, warm_hits) == (0, 2)  # the warm request reused both documents
    assert warm["text"] == cold["text"]
    pairs = [list(zip(c["logprobs"]["token_logprobs"], c["logprobs"]["tokens"])) for c in (cold, warm)]
    assert len(pairs[0]) > 6  # the prompt's tokens are echoed with their logprobs
    assert_same_logprobs(*pairs, "token_logprobs")


def session_turns(url: str, first: dict, second: dict) -> tuple[dict, dict]:
    """Two turns of a newly opened session, the second continuing the first (closed after)."""
    response = requests.post(url + "/open_session", json={"capacity_of_str_len": 1 << 20}, timeout=60)
    assert response.status_code == 200, response.text
    session_id, rid = response.json(), f"turn1-{uuid.uuid4().hex}"
    try:
        one = post(url, "/generate", dict(first, rid=rid, session_params={"id": session_id}))
        two = post(url, "/generate", dict(second, rid=f"turn2-{uuid.uuid4().hex}",
                                          session_params={"id": session_id, "rid": rid}))
        return one, two
    finally:
        requests.post(url + "/close_session", json={"session_id": session_id}, timeout=60)


@pytest.mark.parametrize("policy", ["pic", "relaxkv"])
def test_a_session_turn_answers_the_same_with_its_documents_warm(url, policy):
    docs = documents(4, seed=93)
    namespace = fresh_namespace()

    def turn(prompt, max_new_tokens):
        return {"text": prompt.text, "return_logprob": True, **namespace,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                    "custom_params": {"relaxkv_chunks": prompt.offsets, "relaxkv_policy": policy}}}

    first = turn(marked_prompt("Answer from the documents.", docs[:1], "Q?"), 3)
    second = turn(marked_prompt("", docs[2:4], "And now?"), 6)
    flush(url)
    cold = session_turns(url, first, second)
    flush(url)
    warm_docs = marked_prompt("Another system prompt.", docs[2:4][::-1], "Q?")  # the turn's documents, reordered
    post(url, "/generate", {**turn(warm_docs, 1)})
    warm = session_turns(url, first, second)
    assert [t["meta_info"]["relaxkv"]["chunks_hit"] for t in (cold[1], warm[1])] == [0, 2]
    for c, w in zip(cold, warm):
        assert_same_answer(c, w)


def structured_documents(n: int) -> list[str]:
    """Essay paragraphs with structure inside (a quoted ``>`` line, a ``**heading**``): the block
    rules cut them in several pieces where a document index holding them finds them whole."""
    return [p for p in essay_paragraphs() if "\n>" in p or "**" in p][:n]


def test_an_unmarked_prompt_chunks_the_same_after_its_documents_were_marked(url):
    docs = structured_documents(3)
    namespace = fresh_namespace()
    body = {"text": marked_prompt("You are terse.", docs, "Q?").text, "return_logprob": True, **namespace,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "custom_params": {"relaxkv_policy": "pic"}}}
    flush(url)
    cold = post(url, "/generate", body)
    marked = marked_prompt("Another system prompt.", docs[::-1], "Q?")  # the same namespace marks them
    post(url, "/generate", {"text": marked.text, **namespace, "sampling_params": {
        "max_new_tokens": 1, "custom_params": {"relaxkv_chunks": marked.offsets, "relaxkv_policy": "pic"}}})
    flush(url)
    after = post(url, "/generate", body)
    assert_same_answer(cold, after)


@pytest.mark.parametrize("prompt", ["A prompt.", ["A prompt.", "And a second one, in a batch."]],
                         ids=["one_prompt", "batch"])
def test_a_refused_stream_leaves_its_connection_usable(url, prompt):
    """A streamed request the plugin refuses (here ``logprob_start_len`` -2, on every server) ends
    with its error event; the requests a client sends next on the same keep-alive connection are
    served. SGLang's stream response carries a task that aborts the request 2 s after it ended
    (``TokenizerManager.create_abort_task``), and it reads ``obj.is_single``, which SGLang sets only
    once it normalizes the request, and ``obj.rid`` (a list for a batch, set then too): a request
    refused before that made the task raise, and uvicorn closed the connection under the request
    then in flight (found by the property: a request lost with ``RemoteDisconnected``)."""
    http = requests.Session()
    refused = {"text": prompt, "stream": True, "return_logprob": True, "logprob_start_len": -2,
               "sampling_params": {"max_new_tokens": 2}}
    with http.post(url + "/generate", json=refused, stream=True, timeout=TIMEOUT_S) as response:
        events = [line for line in response.iter_lines() if line]
    assert response.status_code == 200 and b'"code":400' in events[0], events
    deadline, served = time.monotonic() + 3.0, 0  # past the abort task's 2 s
    while time.monotonic() < deadline:
        answer = http.post(url + "/generate", json={"text": "Another prompt.", "sampling_params": {
            "max_new_tokens": 4, "temperature": 0}}, timeout=TIMEOUT_S)
        assert answer.status_code == 200, answer.text
        served += 1
    assert served > 1


def test_a_prefill_only_item_reports_no_output_logprob_whatever_its_batch(url):
    """An item with ``max_new_tokens`` 0 reports no output logprob whether its prefill batch also
    holds an item that generates (SGLang then samples the whole batch and appended one for it) or
    not (found by the property, seed 20261204 case 209: a warm-up changed how the two items of a
    batch were admitted, and with it the prefill-only item's ``output_token_logprobs``)."""
    docs = documents(2, seed=11)
    prompts = [marked_prompt("You are terse.", docs, "Q?"), marked_prompt("", docs[::-1], "What?")]
    params = [{"temperature": 0, "custom_params": {"relaxkv_policy": "pic", "relaxkv_chunks": p.offsets}}
              for p in prompts]
    alone = post(url, "/generate", {"text": prompts[1].text, "return_logprob": True,
                                    "sampling_params": dict(params[1], max_new_tokens=0)})
    flush(url)
    batch = post(url, "/generate", {"text": [p.text for p in prompts], "return_logprob": True, "sampling_params": [
        dict(params[0], max_new_tokens=4), dict(params[1], max_new_tokens=0)]})
    assert alone["meta_info"]["output_token_logprobs"] == []
    assert batch[1]["meta_info"]["output_token_logprobs"] == [], batch[1]["meta_info"]["output_token_logprobs"]
    assert len(batch[0]["meta_info"]["output_token_logprobs"]) == len(batch[0]["output_ids"]) > 0


def _chat_logprobs(choices: list[dict]) -> list[tuple[str, float]]:
    return [(t["token"], t["logprob"]) for c in choices for t in ((c.get("logprobs") or {}).get("content") or [])]


@pytest.mark.parametrize("story, n", [(0, 1), (9, 2)])
def test_a_streamed_chat_keeps_the_logprob_of_a_token_with_no_text_of_its_own(url, story, n):
    """A streamed chat's logprobs are the non-streamed answer's, token for token: SGLang 0.5.23
    dropped those of a step whose text delta was empty (here the tiny model's incomplete UTF-8
    characters, and story 9's ``<|endoftext|>``), which the property then had to leave out
    (``request/sglang/chat_stream_logprobs.py``)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"Tell me story number {story} please."}],
            "max_tokens": 24, "temperature": 0.0, "logprobs": True, "top_logprobs": 2, "n": n}
    whole = post(url, "/v1/chat/completions", body)
    with requests.post(url + "/v1/chat/completions", json=dict(body, stream=True), stream=True,
                       timeout=TIMEOUT_S) as response:
        events = [json.loads(line[len(b"data: "):]) for line in response.iter_lines()
                  if line.startswith(b"data: ") and line != b"data: [DONE]"]
    for index in range(n):
        expected = _chat_logprobs([c for c in whole["choices"] if c["index"] == index])
        streamed = _chat_logprobs([c for e in events for c in e.get("choices") or [] if c["index"] == index])
        assert any("\ufffd" in token for token, _ in expected), "the case no longer has a token with no text"
        assert [t for t, _ in streamed] == [t for t, _ in expected], (index, streamed, expected)
        assert all(abs(a - b) <= LOGPROB_ABS for (_, a), (_, b) in zip(streamed, expected))
