"""Property test: SGLang's own request options, crossed with every policy, chunk marking and route.

Hypothesis draws requests against the session's relaxkv server: a route (``/generate`` with one
prompt or a batch, ``/v1/chat/completions`` with documents as text parts, ``/v1/completions``),
a policy (each served one, none named, or the ``X-RelaxKV-Policy`` header), how the documents are
marked (character offsets, unmarked so chunk policies find them by content, or none at all), and
SGLang's options: grammars valid and invalid (``regex``, ``json_schema``, ``ebnf``), logprob
options (``return_logprob``, ``logprob_start_len`` from -2 to past the prompt, top logprobs, token
ids), sessions (an open one, one that does not exist), ``n``, ``stream``, ``max_new_tokens`` 0,
stop strings, ``ignore_eos``, temperatures.

The property: every response is a 200 or a 4xx (a stream's error events too), the server answers
``/health`` after each request, and at the end an idle flush returns the pool to full (every KV
slot free, no chunk held).

Bounded in ``make test`` (:data:`DEFAULT_REQUESTS` drawn requests); a longer run on demand:
``RELAXKV_PROPERTY_REQUESTS=2000 .venv/bin/python -m pytest -q -s
tests/e2e/test_request_options_property.py`` (the test prints how many requests it sent and how
they were answered).
"""

from __future__ import annotations

import collections
import json
import os
from typing import Any, Optional

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rag_helpers import documents, flush, marked_prompt, relaxkv_state

from relaxkv_sglang.core.policies import SERVER_POLICIES
from relaxkv_sglang.schema import POLICY_HEADER

pytestmark = pytest.mark.e2e

REQUESTS_ENV = "RELAXKV_PROPERTY_REQUESTS"
DEFAULT_REQUESTS = 30
N_REQUESTS = int(os.environ.get(REQUESTS_ENV, DEFAULT_REQUESTS))
DOCS = documents(6, seed=37)  # a small pool, so that drawn prompts share documents (chunk hits, repairs)
TIMEOUT_S = 120

GRAMMARS = [  # (field, value): valid and invalid, as SGLang compiles them (xgrammar)
    ("regex", "(yes|no)"), ("regex", "(["),
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
    ("json_schema", "{not json"),
    ("ebnf", 'root ::= "yes" | "no"'), ("ebnf", "root ::= ("),
]
LOGPROB_STARTS = [None, -1, 0, 3, "last", "end", 10_000, -2]  # "last"/"end": the prompt's last token / its length
SENT: collections.Counter = collections.Counter()  # (route, status class) -> requests, reported at the end


@st.composite
def prompts(draw) -> tuple[str, Optional[list[int]], list[str]]:
    """(text, offsets or None, the documents): a system prompt, 1-3 documents of :data:`DOCS` in
    a drawn order, a question; the offsets mark the documents, or None for an unmarked prompt."""
    docs = draw(st.lists(st.sampled_from(DOCS), min_size=1, max_size=3, unique=True))
    system = draw(st.sampled_from(["Answer from the documents.", "You are terse.", ""]))
    prompt = marked_prompt(system, docs, draw(st.sampled_from(["Question: what?", "Q?", "Summarise."])))
    marked = draw(st.booleans())
    return prompt.text, prompt.offsets if marked else None, docs


def policy_fields(draw) -> tuple[dict, dict]:
    """(custom_params' policy entry, HTTP headers): a named policy, the header, or neither."""
    how = draw(st.sampled_from(["body", "body", "header", "none"]))
    policy = draw(st.sampled_from(SERVER_POLICIES))
    if how == "body":
        return {"relaxkv_policy": policy}, {}
    if how == "header":
        return {}, {POLICY_HEADER: policy}
    return {}, {}


@st.composite
def sglang_options(draw) -> dict:
    """SGLang's sampling options for one item: grammar, stop, lengths, temperature, n."""
    options: dict[str, Any] = {"max_new_tokens": draw(st.sampled_from([0, 1, 3])),
                               "temperature": draw(st.sampled_from([0.0, 0.7]))}
    if draw(st.booleans()):
        field, value = draw(st.sampled_from(GRAMMARS))
        options[field] = value
    if draw(st.booleans()):
        options["stop"] = draw(st.sampled_from([["the"], ".", ["\n", "a"]]))
    if draw(st.booleans()):
        options["ignore_eos"] = True
    options["n"] = draw(st.sampled_from([1, 1, 2]))
    return options


def logprob_fields(draw, text_len: int) -> dict:
    """``return_logprob`` and its options (a start drawn from :data:`LOGPROB_STARTS`)."""
    if not draw(st.booleans()):
        return {}
    fields: dict[str, Any] = {"return_logprob": True, "top_logprobs_num": draw(st.sampled_from([0, 2]))}
    start = draw(st.sampled_from(LOGPROB_STARTS))
    if start is not None:
        fields["logprob_start_len"] = {"last": max(text_len - 1, 0), "end": text_len}.get(start, start)
    if draw(st.booleans()):
        fields["token_ids_logprob"] = [1, 2]
    return fields


@st.composite
def generate_requests(draw, session_id: str) -> tuple[str, dict, dict]:
    """A ``/generate`` request: one prompt or a batch of two; (route, body, headers)."""
    policy, headers = policy_fields(draw)
    batch = draw(st.booleans())
    items = [draw(prompts()) for _ in range(2 if batch else 1)]
    sampling = []
    for _, offsets, _ in items:
        custom = dict(policy, **({"relaxkv_chunks": offsets} if offsets is not None else {}))
        sampling.append(dict(draw(sglang_options()), **({"custom_params": custom} if custom else {})))
    n = sampling[0]["n"]
    for sp in sampling:  # SGLang asks one n for the whole batch
        sp["n"] = n
    body: dict[str, Any] = {"text": [t for t, _, _ in items] if batch else items[0][0],
                            "sampling_params": sampling if batch else sampling[0]}
    # logprob_start_len counts tokens; the text's length in characters is an upper bound
    body.update(logprob_fields(draw, len(items[0][0]) // 4))
    session = draw(st.sampled_from([None, None, None, "open", "missing"]))
    if session is not None and not batch:
        body["session_params"] = {"id": session_id if session == "open" else "no-such-session"}
    body["stream"] = draw(st.booleans())
    return "/generate", body, headers


@st.composite
def chat_requests(draw) -> tuple[str, dict, dict]:
    """A ``/v1/chat/completions`` request: documents as text parts (or one plain string)."""
    policy, headers = policy_fields(draw)
    _, _, docs = draw(prompts())
    parts = [{"type": "text", "text": d} for d in docs] + [{"type": "text", "text": "Question: what?"}]
    content = parts if draw(st.booleans()) else "\n\n".join(p["text"] for p in parts)
    options = draw(sglang_options())
    body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": content}],
                            "max_tokens": options["max_new_tokens"], "temperature": options["temperature"],
                            "n": options["n"], "stream": draw(st.booleans())}
    for field in ("regex", "ebnf", "stop"):
        if field in options:
            body[field] = options[field]
    if draw(st.booleans()):
        body.update(logprobs=True, top_logprobs=draw(st.sampled_from([0, 2])))
    if policy:
        body["custom_params"] = policy
    return "/v1/chat/completions", body, headers


@st.composite
def completion_requests(draw) -> tuple[str, dict, dict]:
    """A ``/v1/completions`` request, its prompt marked or not."""
    policy, headers = policy_fields(draw)
    text, offsets, _ = draw(prompts())
    options = draw(sglang_options())
    body: dict[str, Any] = {"model": "tiny", "prompt": text, "max_tokens": options["max_new_tokens"],
                            "temperature": options["temperature"], "n": options["n"], "stream": draw(st.booleans())}
    for field in ("regex", "json_schema", "ebnf", "stop"):
        if field in options:
            body[field] = options[field]
    if draw(st.booleans()):
        body["logprobs"] = draw(st.sampled_from([0, 2]))
    custom = dict(policy, **({"relaxkv_chunks": offsets} if offsets is not None else {}))
    if custom:
        body["custom_params"] = custom
    return "/v1/completions", body, headers


def any_request(session_id: str) -> st.SearchStrategy:
    return st.one_of(generate_requests(session_id), chat_requests(), completion_requests())


def stream_error_codes(response: requests.Response) -> list[int]:
    """The ``code`` of every error event of a streamed answer (read to its end)."""
    codes = []
    for line in response.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[len(b"data: "):])
        error = event.get("error") if isinstance(event, dict) else None
        if isinstance(error, dict):
            codes.append(int(error.get("code", 500)))
    return codes


def send(url: str, route: str, body: dict, headers: dict) -> int:
    """Post the request (a stream read to its end); the worst status it got (HTTP or stream event)."""
    with requests.post(url + route, json=body, headers=headers, timeout=TIMEOUT_S, stream=bool(body.get("stream"))) as r:
        if body.get("stream") and r.status_code == 200:
            return max([200] + stream_error_codes(r))
        r.content  # read it whole
        return r.status_code


@pytest.fixture(scope="module")
def session_id(relaxkv_server) -> str:
    """An SGLang session open for the test's requests (closed at the end)."""
    response = requests.post(relaxkv_server.url + "/open_session", json={"capacity_of_str_len": 1 << 20}, timeout=60)
    assert response.status_code == 200, response.text
    sid = response.json()
    yield sid
    requests.post(relaxkv_server.url + "/close_session", json={"session_id": sid}, timeout=60)


def test_any_request_options_get_200_or_4xx_and_the_server_lives(relaxkv_server, session_id):
    url = relaxkv_server.url
    flush(url)

    @settings(max_examples=N_REQUESTS, deadline=None, database=None, derandomize=N_REQUESTS <= DEFAULT_REQUESTS,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=any_request(session_id))
    def one_request(request: tuple[str, dict, dict]) -> None:
        route, body, headers = request
        status = send(url, route, body, headers)
        SENT[(route, f"{status // 100}xx")] += 1
        assert status == 200 or 400 <= status < 500, f"HTTP {status} for {route} {json.dumps(body)[:2000]}"
        assert relaxkv_server.proc.poll() is None, f"the server exited after {route} {json.dumps(body)[:2000]}"
        assert requests.get(url + "/health", timeout=60).status_code == 200

    one_request()
    flush(url)
    state = relaxkv_state(url)
    assert state["chunk_tokens_held"] == 0
    assert state["kv_available_tokens"] == state["kv_total_tokens"]
    print(f"\nrequest-options property: {sum(SENT.values())} drawn requests, "
          + ", ".join(f"{route} {cls}: {n}" for (route, cls), n in sorted(SENT.items())))
