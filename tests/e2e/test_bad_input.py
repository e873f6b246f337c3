"""The bad-input suite: malformed requests to every entry point get a 4xx naming the problem.

One table of named cases across the native API (``/generate``), the OpenAI API
(``/v1/chat/completions``, ``/v1/completions``) and the frontend (the
``/concate_and_append_request`` route, and ``relaxkv_sglang.lang``'s client-side
errors). Every HTTP case must answer a status in [400, 500) whose error message
contains a substring naming the offending field or the problem; a client-side
case must raise the named exception with such a message. Afterwards the server
still answers a fixed greedy request exactly as before the suite, every KV slot
comes back after a flush, and the process is alive. The last test prints how
many cases ran.

What the API promises about text (tested below, not rejected): offsets are
Python ``str`` indices, i.e. Unicode code points. There is no offset "inside" a
multi-byte character (UTF-8 bytes and UTF-16 surrogate pairs never appear in
the decoded text; a lone surrogate escape is invalid JSON), so byte or UTF-16
offsets are the client's bug and show up as "past the end of the text" when
they overrun it. Offsets may split a grapheme cluster (a letter and its
combining accent, an emoji ZWJ sequence): the parts are tokenized separately
and the request is served. A NUL character is an ordinary code point in text.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
from typing import Any, Callable

import pytest
import requests
import sglang as sgl
from rag_helpers import check_idle, documents, flush, generate, marked_prompt, relaxkv_state

from relaxkv_sglang.lang import RelaxKVEndpoint, document

pytestmark = pytest.mark.e2e

TEXT = "Hello there, general Kenobi. Question: hi?"  # 42 code points
DOC_MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "A document about ships."},
                                             {"type": "text", "text": "Question: what?"}]}]
TRIED: list[str] = []  # names of cases that ran and passed, reported by the last test


@dataclasses.dataclass(frozen=True)
class BadCase:
    """One malformed request.

    name: the case's id; route: the path it is posted to; body: the JSON body
    (or a zero-argument callable building it, for large bodies); raw: bytes
    sent as the body instead of JSON; expect: a substring of the error message
    that names the problem; headers: extra HTTP headers.
    """

    name: str
    route: str
    expect: str
    body: Any = None
    raw: bytes | None = None
    headers: dict | None = None

    def build(self) -> Any:
        return self.body() if callable(self.body) else self.body


def gen(custom_params: Any = None, text: Any = TEXT, **extra) -> dict:
    """A /generate body; custom_params omitted when None."""
    sampling: dict = {"max_new_tokens": 2}
    if custom_params is not None:
        sampling["custom_params"] = custom_params
    return {"text": text, "sampling_params": sampling, **extra}


def chat(custom_params: Any = None, messages: Any = None, **extra) -> dict:
    body = {"model": "tiny", "max_tokens": 2, "messages": DOC_MESSAGES if messages is None else messages, **extra}
    if custom_params is not None:
        body["custom_params"] = custom_params
    return body


def chat_doc(doc_part: dict, policy: str = "pic") -> dict:
    return chat({"relaxkv_policy": policy}, [{"role": "user", "content": [doc_part, {"type": "text", "text": "Q?"}]}])


def completion(custom_params: dict, prompt: Any = TEXT) -> dict:
    return {"model": "tiny", "max_tokens": 2, "prompt": prompt, "custom_params": custom_params}


def raw_generate(custom_params_json: str) -> bytes:
    return ('{"text": "Hello there", "sampling_params": {"max_new_tokens": 2, "custom_params": '
            + custom_params_json + "}}").encode()


def over_context_chunks() -> dict:
    # Forty essay paragraphs, each its own (small) chunk: ~4,200 tokens in all,
    # over the fixture's 4,096-token context although every chunk fits.
    prompt = marked_prompt("S.", documents(40, seed=8), "Q?")
    return gen({"relaxkv_chunks": prompt.offsets, "relaxkv_policy": "pic"}, text=prompt.text)


def chunk_over_context() -> dict:
    prompt = marked_prompt("S.", [" ".join(documents(40, seed=8))], "Q?")
    return gen({"relaxkv_chunks": prompt.offsets}, text=prompt.text)


def too_many_pairs() -> dict:
    text = "x" * 2100 + " Q?"
    return gen({"relaxkv_chunks": list(range(2050))}, text=text)


# Requests SGLang itself aborts before their prefill (set_finish_with_abort: the prompt becomes a
# one-token stub that still runs one prefill): under a repair policy with chunks they once killed
# the server. Now each gets SGLang's own 400 and the server lives (docs/reliability.md).
ABORT_TEXT = "Hi.\nThe quick brown fox jumps over the lazy dog.\nQ: what?"
ABORT_CHUNKS = [4, 48]


def aborted(policy: str, sampling: dict | None = None, **extra) -> dict:
    """A /generate body with one marked chunk under ``policy`` that SGLang aborts (``sampling``:
    extra sampling params such as a bad grammar; ``extra``: top-level fields)."""
    params = {"max_new_tokens": 4, "custom_params": {"relaxkv_policy": policy, "relaxkv_chunks": ABORT_CHUNKS},
              **(sampling or {})}
    return {"text": ABORT_TEXT, "sampling_params": params, **extra}


def long_sampling_list(custom_params: dict) -> dict:
    """A batch of one prompt with two sampling_params objects, the second carrying ``custom_params``."""
    return {"text": [TEXT], "sampling_params": [{"max_new_tokens": 2, "custom_params": custom_params},
                                                {"max_new_tokens": 2}]}


# A json_schema of 100,000 enum values (1.39 M characters): xgrammar compiled it for about 32 s on the
# 2-core test machine, blocking SGLang's grammar thread.
ENUM_100K = {"type": "string", "enum": [f"value{i}" for i in range(100_000)]}

UNICODE_TEXT = "Ünïcödé déjà vu, 日本語のテキスト. Question?"
EMOJI_TEXT = "😀😀 rocket 🚀 Question?"
G = "/generate"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JOIN = "/concate_and_append_request"

HTTP_CASES = [
    # --- native /generate: relaxkv_chunks
    BadCase("chunks_odd_count", G, "relaxkv_chunks: must hold start/end pairs", gen({"relaxkv_chunks": [0, 5, 3]})),
    BadCase("chunks_negative", G, "start is negative", gen({"relaxkv_chunks": [-1, 4]})),
    BadCase("chunks_unsorted", G, "chunks must be sorted", gen({"relaxkv_chunks": [6, 9, 0, 5]})),
    BadCase("chunks_overlapping", G, "overlaps or precedes chunk 0", gen({"relaxkv_chunks": [0, 5, 3, 8]})),
    BadCase("chunks_reversed", G, "start must be < end", gen({"relaxkv_chunks": [10, 5]})),
    BadCase("chunks_empty_pair", G, "start must be < end", gen({"relaxkv_chunks": [3, 3]})),
    BadCase("chunks_past_end", G, "end is past the end of the text (42 characters)",
            gen({"relaxkv_chunks": [0, 100000]})),
    BadCase("chunks_fraction", G, "relaxkv_chunks: offset at index 1 must be an integer",
            gen({"relaxkv_chunks": [0, 2.5]})),
    BadCase("chunks_integral_float", G, "offset at index 1 must be an integer, got 3.0",
            gen({"relaxkv_chunks": [0, 3.0]})),
    BadCase("chunks_bools", G, "offset at index 0 must be an integer, got False",
            gen({"relaxkv_chunks": [False, True]})),
    BadCase("chunks_strings", G, "offset at index 0 must be an integer, got '0'", gen({"relaxkv_chunks": ["0", "5"]})),
    BadCase("chunks_null_element", G, "offset at index 0 must be an integer, got None",
            gen({"relaxkv_chunks": [None, 4]})),
    BadCase("chunks_nested_pairs", G, "offset at index 0 must be an integer, got [0, 5]",
            gen({"relaxkv_chunks": [[0, 5], [6, 9]]})),
    BadCase("chunks_beyond_int64", G, "offset at index 1 must be an integer", gen({"relaxkv_chunks": [0, 10**30]})),
    BadCase("chunks_string", G, "relaxkv_chunks: must be a list", gen({"relaxkv_chunks": "0,5"})),
    BadCase("chunks_object", G, "relaxkv_chunks: must be a list", gen({"relaxkv_chunks": {"start": 0}})),
    BadCase("chunks_null", G, "relaxkv_chunks: must be a list", gen({"relaxkv_chunks": None, "relaxkv_policy": "pic"})),
    BadCase("chunks_100k_offsets", G, "at most 1024 chunks allowed, got 50000",
            gen({"relaxkv_chunks": list(range(100_000))})),
    BadCase("chunks_1025_pairs", G, "at most 1024 chunks allowed, got 1025", too_many_pairs),
    BadCase("chunk_longer_than_context", G, "more than the context length 4096", chunk_over_context),
    BadCase("chunks_total_over_context", G, "context length", over_context_chunks),
    BadCase("chunks_with_input_ids", G, "relaxkv_chunks: character offsets need the prompt as `text`",
            {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "custom_params": {"relaxkv_chunks": [0, 1]}}}),
    BadCase("chunks_on_empty_text", G, "past the end of the text (0 characters)",
            gen({"relaxkv_chunks": [0, 1]}, text="")),
    # Offsets count code points: UTF-8 byte or UTF-16 offsets overrun a text with wide characters.
    BadCase("chunks_as_utf8_byte_offsets", G, f"past the end of the text ({len(UNICODE_TEXT)} characters)",
            gen({"relaxkv_chunks": [0, len(UNICODE_TEXT.encode())]}, text=UNICODE_TEXT)),
    BadCase("chunks_as_utf16_offsets", G, f"past the end of the text ({len(EMOJI_TEXT)} characters)",
            gen({"relaxkv_chunks": [0, len(EMOJI_TEXT.encode("utf-16-le")) // 2]}, text=EMOJI_TEXT)),
    # --- native: relaxkv_policy
    BadCase("policy_unknown", G, "relaxkv_policy: unknown policy 'magic'", gen({"relaxkv_policy": "magic"})),
    BadCase("policy_wrong_case", G, "relaxkv_policy: unknown policy 'PIC'", gen({"relaxkv_policy": "PIC"})),
    BadCase("policy_number", G, "relaxkv_policy: unknown policy 3", gen({"relaxkv_policy": 3})),
    BadCase("policy_list", G, "relaxkv_policy: unknown policy ['pic']", gen({"relaxkv_policy": ["pic"]})),
    BadCase("policy_null", G, "relaxkv_policy: unknown policy None", gen({"relaxkv_policy": None})),
    BadCase("policy_with_nul", G, "relaxkv_policy: unknown policy 'pic\\x00'", gen({"relaxkv_policy": "pic\x00"})),
    # --- native: repair knobs
    BadCase("anchor_ratio_above_one", G, "relaxkv_anchor_ratio: must be a number in [0, 1], got 1.5",
            gen({"relaxkv_policy": "relaxkv", "relaxkv_anchor_ratio": 1.5})),
    BadCase("budget_above_one", G, "relaxkv_budget: must be a number in [0, 1] or 'auto', got 2",
            gen({"relaxkv_policy": "relaxkv", "relaxkv_budget": 2})),
    BadCase("budget_string", G, "relaxkv_budget: must be a number in [0, 1] or 'auto', got 'half'",
            gen({"relaxkv_budget": "half"})),
    BadCase("quality_unknown", G, "relaxkv_quality: must be one of low, medium, high or a target KL above 0, got 'best'",
            gen({"relaxkv_policy": "relaxkv", "relaxkv_budget": "auto", "relaxkv_quality": "best"})),
    BadCase("anchor_ratio_negative", G, "relaxkv_anchor_ratio: must be a number in [0, 1], got -0.1",
            gen({"relaxkv_anchor_ratio": -0.1})),
    BadCase("anchor_ratio_string", G, "relaxkv_anchor_ratio: must be a number in [0, 1], got '0.1'",
            gen({"relaxkv_anchor_ratio": "0.1"})),
    BadCase("anchor_ratio_nan", G, "JSON decode error", raw=raw_generate('{"relaxkv_anchor_ratio": NaN}')),
    BadCase("context_ratio_infinity", G, "JSON decode error", raw=raw_generate('{"relaxkv_context_ratio": Infinity}')),
    BadCase("context_ratio_above_one", G, "relaxkv_context_ratio: must be a number in [0, 1], got 2",
            gen({"relaxkv_context_ratio": 2})),
    BadCase("context_ratio_bool", G, "relaxkv_context_ratio: must be a number in [0, 1], got True",
            gen({"relaxkv_context_ratio": True})),
    BadCase("context_ratio_null", G, "relaxkv_context_ratio: must be a number in [0, 1], got None",
            gen({"relaxkv_context_ratio": None})),
    # --- native: custom_params itself
    BadCase("custom_params_list", G, "sampling_params.custom_params: must be an object, got list", gen([1, 2])),
    BadCase("custom_params_string", G, "sampling_params.custom_params: must be an object, got str", gen("pic")),
    BadCase("custom_params_number", G, "sampling_params.custom_params: must be an object, got int", gen(5)),
    BadCase("reserved_policy_key", G, "custom_params._relaxkv_policy: is reserved", gen({"_relaxkv_policy": "pic"})),
    BadCase("reserved_spans_key", G, "custom_params._relaxkv_token_spans: is reserved",
            gen({"_relaxkv_token_spans": [0, 3]})),
    BadCase("reserved_prefix_any_key", G, "custom_params._relaxkv_future: is reserved", gen({"_relaxkv_future": 1})),
    BadCase("misspelt_field", G, "custom_params.relaxkv_chunk: unknown field", gen({"relaxkv_chunk": [0, 5]})),
    # --- native: the body
    BadCase("text_and_input_ids", G, "input_ids: give the prompt as `text` or as `input_ids`, not both",
            dict(gen({"relaxkv_policy": "pic"}), input_ids=[1, 2, 3])),
    BadCase("batch_short_sampling_params", G, "sampling_params: a list needs one object per prompt (2), got 1",
            {"text": [TEXT, TEXT], "sampling_params": [{"max_new_tokens": 2, "custom_params": {"relaxkv_policy": "pic"}}]}),
    BadCase("batch_item_bad_chunks", G, "relaxkv_chunks: batch item 1: chunk 0",
            {"text": [TEXT, TEXT], "sampling_params": [
                {"max_new_tokens": 2}, {"max_new_tokens": 2, "custom_params": {"relaxkv_chunks": [0, 500]}}]}),
    BadCase("text_not_a_string", G, "'text'", gen({"relaxkv_policy": "pic"}, text=5)),
    BadCase("cache_salt_not_a_string", G, "'cache_salt'", gen({"relaxkv_policy": "pic"}, cache_salt=5)),
    BadCase("extra_key_list_for_one_prompt", G, "extra_key should be a string", gen({"relaxkv_policy": "pic"},
                                                                                   extra_key=["a"])),
    BadCase("malformed_json", G, "JSON decode error", raw=b'{"text": "abc", "sampling_params": '),
    BadCase("body_is_an_array", G, "GenerateReqInput", raw=b"[1, 2]"),
    BadCase("invalid_utf8", G, "not valid UTF-8", raw=b'{"text": "ab\xff\xfe", "sampling_params": {}}'),
    BadCase("lone_surrogate_escape", G, "surrogate",
            raw=b'{"text": "ab\\ud800cd", "sampling_params": {"custom_params": {"relaxkv_chunks": [0, 2]}}}'),
    # --- native: aborted by SGLang before the prefill, under repair policies (issue: server exit)
    BadCase("abort_bad_regex_relaxkv", G, "Failed to compile regex grammar", aborted("relaxkv", {"regex": "(["})),
    BadCase("abort_bad_json_schema_epic", G, "Failed to compile json grammar",
            aborted("epic", {"json_schema": "{not json"})),
    BadCase("abort_bad_ebnf_prophetkv", G, "Failed to compile ebnf grammar", aborted("prophetkv", {"ebnf": "root ::= ("})),
    BadCase("abort_logprob_start_past_prompt_relaxkv", G, "is higher than the number of input tokens",
            aborted("relaxkv", return_logprob=True, logprob_start_len=1000)),
    BadCase("abort_logprob_start_past_prompt_epic", G, "is higher than the number of input tokens",
            aborted("epic", return_logprob=True, logprob_start_len=1000)),
    BadCase("abort_unknown_session_cacheblend", G, "session id nope does not exist",
            aborted("cacheblend", session_params={"id": "nope"})),
    # --- native: what stops SGLang's own scheduler, refused by the plugin's checks
    BadCase("logprob_start_len_minus_two_prefix", G, "invalid logprob_start_len: must be -1 (none) or a token position",
            gen({"relaxkv_policy": "prefix"}, return_logprob=True, logprob_start_len=-2)),
    BadCase("logprob_start_len_minus_five_relaxkv", G, "invalid logprob_start_len", aborted(
        "relaxkv", return_logprob=True, logprob_start_len=-5)),
    BadCase("logprob_start_len_batch_item", G, "logprob_start_len: must be -1 (none) or a token position >= 0 (item 1)",
            {"text": [TEXT, TEXT], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
             "logprob_start_len": [0, -3]}),
    # --- native: a sampling_params list longer than the prompts (its tail skipped the checks)
    BadCase("batch_long_sampling_params_bad_policy", G, "sampling_params: a list needs one object per prompt (1), got 2",
            long_sampling_list({"relaxkv_policy": "bogus"})),
    BadCase("batch_long_sampling_params_bad_chunks", G, "sampling_params: a list needs one object per prompt (1), got 2",
            long_sampling_list({"relaxkv_chunks": [5, 1]})),
    # --- OpenAI chat
    BadCase("chat_policy_unknown", CHAT, "relaxkv_policy: unknown policy 'bogus'", chat({"relaxkv_policy": "bogus"})),
    BadCase("chat_policy_list", CHAT, "relaxkv_policy: unknown policy ['pic']", chat({"relaxkv_policy": ["pic"]})),
    BadCase("chat_policy_number", CHAT, "relaxkv_policy: unknown policy 1", chat({"relaxkv_policy": 1})),
    BadCase("chat_anchor_ratio_string", CHAT, "relaxkv_anchor_ratio: must be a number",
            chat({"relaxkv_policy": "relaxkv", "relaxkv_anchor_ratio": "x"})),
    BadCase("chat_context_ratio_above_one", CHAT, "relaxkv_context_ratio: must be a number",
            chat({"relaxkv_policy": "relaxkv", "relaxkv_context_ratio": 1.5})),
    BadCase("chat_offsets_given", CHAT, "relaxkv_chunks: character offsets need the prompt as `text`",
            chat({"relaxkv_policy": "pic", "relaxkv_chunks": [0, 3]})),
    BadCase("chat_custom_params_list", CHAT, "'custom_params'", chat([1])),
    BadCase("chat_reserved_key", CHAT, "custom_params._relaxkv_policy: is reserved", chat({"_relaxkv_policy": "pic"})),
    BadCase("chat_misspelt_field", CHAT, "custom_params.relaxkv_polcy: unknown field", chat({"relaxkv_polcy": "pic"})),
    BadCase("chat_empty_document", CHAT, "messages[0].content[0].text: a document",
            chat_doc({"type": "text", "text": ""})),
    BadCase("chat_part_without_text", CHAT, "'text'), 'msg': 'Field required'", chat_doc({"type": "text"})),
    BadCase("chat_part_text_not_a_string", CHAT, "'text'), 'msg': 'Input should be a valid string'",
            chat_doc({"type": "text", "text": 5})),
    BadCase("chat_unknown_part_type", CHAT, "'type'), 'msg': \"Input should be 'text'\"",
            chat_doc({"type": "document", "text": "x"})),
    BadCase("chat_document_over_context", CHAT, "relaxkv_chunks: chunk 0 has",
            lambda: chat_doc({"type": "text", "text": " ".join(documents(40, seed=8))})),
    BadCase("chat_cache_salt_not_a_string", CHAT, "'cache_salt'", chat(cache_salt=5)),
    BadCase("chat_no_messages", CHAT, "Messages cannot be empty", chat({"relaxkv_policy": "pic"}, messages=[])),
    BadCase("chat_documents_bad_regex_relaxkv", CHAT, "Failed to compile regex grammar",
            chat({"relaxkv_policy": "relaxkv"}, regex="([")),
    # --- OpenAI completions (the plugin sees them as /generate requests)
    BadCase("completions_policy_unknown", COMPLETIONS, "relaxkv_policy: unknown policy 'magic'",
            completion({"relaxkv_policy": "magic"})),
    BadCase("completions_chunks_past_end", COMPLETIONS, "relaxkv_chunks: chunk 0",
            completion({"relaxkv_chunks": [0, 500]})),
    BadCase("completions_token_prompt_with_offsets", COMPLETIONS, "relaxkv_chunks: character offsets need",
            completion({"relaxkv_chunks": [0, 1]}, prompt=[1, 2, 3])),
    BadCase("completions_bad_regex_relaxkv", COMPLETIONS, "Failed to compile regex grammar",
            dict(completion({"relaxkv_policy": "relaxkv", "relaxkv_chunks": [6, 27]}), regex="([")),
    BadCase("completions_reserved_key", COMPLETIONS, "custom_params._relaxkv_token_spans: is reserved",
            completion({"_relaxkv_token_spans": [0, 1]})),
    # --- request bounds on SGLang's own fields (served slowly or blocking before; docs/reliability.md, "Request bounds")
    BadCase("n_10000", G, "invalid sampling_params.n: must be at most 128 (OpenAI: `n`), got 10000",
            {"text": TEXT, "sampling_params": {"max_new_tokens": 1, "n": 10_000}}),
    BadCase("chat_n_10000", CHAT, "invalid sampling_params.n: must be at most 128", chat(n=10_000, max_tokens=1)),
    BadCase("completions_n_10000", COMPLETIONS, "invalid sampling_params.n: must be at most 128",
            {"model": "tiny", "prompt": TEXT, "max_tokens": 1, "n": 10_000}),
    BadCase("min_new_tokens_1000000", G, "invalid sampling_params.min_new_tokens: must be at most the context "
            "length 4096", {"text": TEXT, "sampling_params": {"max_new_tokens": None, "min_new_tokens": 10**6}}),
    BadCase("chat_min_tokens_1000000", CHAT, "invalid sampling_params.min_new_tokens",
            chat(min_tokens=10**6, max_tokens=None)),
    BadCase("json_schema_enum_100k", G, "invalid sampling_params.json_schema: must be at most 65536 characters",
            lambda: {"text": TEXT, "sampling_params": {"max_new_tokens": 2, "json_schema": json.dumps(ENUM_100K)}}),
    BadCase("chat_response_format_enum_100k", CHAT, "invalid sampling_params.json_schema: must be at most 65536",
            lambda: chat(response_format={"type": "json_schema", "json_schema": {"name": "e", "schema": ENUM_100K}})),
    # --- frontend: SGLang's parallel-encoding join route
    BadCase("join_src_rids_not_a_list", JOIN, "src_rids: must be a list of strings", {"src_rids": "a", "dst_rid": "b"}),
    BadCase("join_src_rids_numbers", JOIN, "src_rids: must be a list of strings", {"src_rids": [1, 2], "dst_rid": "b"}),
    BadCase("join_dst_rid_missing", JOIN, "dst_rid: must be a string", {"src_rids": ["a"]}),
    BadCase("join_dst_rid_number", JOIN, "dst_rid: must be a string", {"src_rids": ["a"], "dst_rid": 1}),
    BadCase("join_body_array", JOIN, "body: must be a JSON object", ["a"]),
    BadCase("join_body_string", JOIN, "body: must be a JSON object", "a"),
    BadCase("join_malformed_json", JOIN, "body: not JSON", raw=b'{"src_rids": ['),
    BadCase("join_empty_body", JOIN, "body: not JSON", raw=b""),
    BadCase("join_invalid_utf8", JOIN, "body: not JSON", raw=b'{"src_rids": ["\xff"], "dst_rid": "x"}'),
    BadCase("join_100k_branches", JOIN, "src_rids: at most 1024 branches, got 100000",
            {"src_rids": ["a"] * 100_000, "dst_rid": "x"}),
    # --- the X-RelaxKV-Policy header (every route)
    BadCase("policy_header_unknown", G, "header X-RelaxKV-Policy: unknown policy 'blend'", gen(),
            headers={"X-RelaxKV-Policy": "blend"}),
    BadCase("policy_header_empty", G, "header X-RelaxKV-Policy: unknown policy ''", gen(),
            headers={"X-RelaxKV-Policy": ""}),
    BadCase("policy_header_chat", CHAT, "header X-RelaxKV-Policy", chat(), headers={"x-relaxkv-policy": "PIC"}),
    BadCase("policy_header_completions", COMPLETIONS, "header X-RelaxKV-Policy", completion({}),
            headers={"X-RelaxKV-Policy": "cacheblend2"}),
]

# SGLang inputs that stop (or hang) SGLang 0.5.23's scheduler, on a stock server too: the server
# process exits (or stops answering) and every request in flight fails (docs/reliability.md, "SGLang
# inputs that stop its scheduler"). Each is refused with a 400 naming the field on every server the
# plugin is loaded into (request/sglang/sglang_fields.py); a stop regex that backtracks catastrophically
# in Python's re is matched by RE2 in linear time and served (STOP_REGEX_SERVED, request/sglang/stop_regex.py),
# one with no linear-time matcher (a backreference, lookaround) is refused with a 400 naming the field.
VOCAB = 2048  # the tiny model's vocabulary
GREEDY_AS = {"regex": "a{40}", "max_new_tokens": 40}  # a grammar forcing an output of "a"s
SCHEDULER_STOPPERS = [
    BadCase("top_logprobs_num_above_vocab", G, "invalid top_logprobs_num: must be at most the vocabulary size 2048",
            gen(return_logprob=True, top_logprobs_num=VOCAB + 1)),
    BadCase("top_logprobs_num_batch_item", G, "invalid top_logprobs_num: must be at most the vocabulary size 2048 "
            "(OpenAI: `logprobs` / `top_logprobs`) (item 1), got 1000000",
            {"text": [TEXT, TEXT], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
             "logprob_start_len": 0, "top_logprobs_num": [1, 10**6]}),
    BadCase("top_logprobs_num_with_chunks_relaxkv", G, "invalid top_logprobs_num",
            aborted("relaxkv", return_logprob=True, logprob_start_len=0, top_logprobs_num=VOCAB + 1)),
    BadCase("completions_logprobs_above_vocab", COMPLETIONS, "invalid top_logprobs_num",
            {"model": "tiny", "prompt": TEXT, "max_tokens": 2, "logprobs": VOCAB + 1}),
    BadCase("completions_echo_logprobs_above_vocab", COMPLETIONS, "invalid top_logprobs_num",
            {"model": "tiny", "prompt": TEXT, "max_tokens": 2, "echo": True, "logprobs": 10**6}),
    BadCase("chat_top_logprobs_above_vocab", CHAT, "invalid top_logprobs_num", chat(logprobs=True, top_logprobs=VOCAB + 1)),
    BadCase("top_k_above_int32", G, "invalid sampling_params.top_k: must be -1 (all tokens) or in [1, 2147483647], "
            "got 2147483648", {"text": TEXT, "sampling_params": {"max_new_tokens": 2, "top_k": 2**31}}),
    BadCase("chat_top_k_above_int32", CHAT, "invalid sampling_params.top_k", chat(top_k=2**31, temperature=1.0)),
    BadCase("completions_top_k_huge", COMPLETIONS, "invalid sampling_params.top_k",
            {"model": "tiny", "prompt": TEXT, "max_tokens": 2, "top_k": 10**12}),
    BadCase("input_ids_above_vocab", G, "invalid input_ids: token id 2058 at position 2 is outside the vocabulary "
            "[0, 2048)", {"input_ids": [1, 2, VOCAB + 10], "sampling_params": {"max_new_tokens": 2}}),
    BadCase("input_ids_negative", G, "invalid input_ids: token id -3 at position 1",
            {"input_ids": [1, -3, 2], "sampling_params": {"max_new_tokens": 2}}),
    BadCase("input_ids_batch_item", G, "invalid input_ids: token id 1000000 at position 1 (item 1)",
            {"input_ids": [[1, 2], [3, 10**6]], "sampling_params": {"max_new_tokens": 2}}),
    BadCase("completions_token_prompt_above_vocab", COMPLETIONS, "invalid input_ids: token id 2055",
            {"model": "tiny", "prompt": [1, 2, VOCAB + 7], "max_tokens": 2}),
    BadCase("chat_input_ids_above_vocab", CHAT, "invalid input_ids: token id 2051", chat(input_ids=[1, VOCAB + 3])),
    BadCase("positional_embed_overrides_json", G, "invalid positional_embed_overrides: takes SGLang's PositionalEmbeds",
            gen(positional_embed_overrides={"embeds": [[0.1]], "positions": [0]})),
    BadCase("stop_regex_backreference", G, "invalid sampling_params.stop_regex: '(a|aa)+\\\\1#' uses a construct "
            "with no linear-time matcher: a backreference",
            {"text": TEXT, "sampling_params": {**GREEDY_AS, "stop_regex": "(a|aa)+\\1#"}}),
    BadCase("stop_regex_lookahead_with_chunks_relaxkv", G, "invalid sampling_params.stop_regex: '(?=a)x' uses a "
            "construct with no linear-time matcher", aborted("relaxkv", {**GREEDY_AS, "stop_regex": ["x", "(?=a)x"]})),
    BadCase("stop_regex_not_compiling", G, "invalid sampling_params.stop_regex: '(' is not a valid regular expression",
            {"text": TEXT, "sampling_params": {"max_new_tokens": 2, "stop_regex": "("}}),
]

# Stop regexes that made Python's re backtrack exponentially on an output of "a"s (it hung the scheduler),
# matched by RE2 in linear time: (name, body, the pattern that stops it or None): served with 200 on both
# servers, the first two to the grammar's end (the pattern never matches), the third stopped by it.
STOP_REGEX_SERVED = [
    ("stop_regex_catastrophic", {"text": TEXT, "sampling_params": {**GREEDY_AS, "stop_regex": "(a|aa)+$#"}}, None),
    ("stop_regex_catastrophic_with_chunks_relaxkv", aborted("relaxkv", {**GREEDY_AS, "stop_regex": ["x", "(a|aa)+$#"]}),
     None),
    ("stop_regex_catastrophic_stops", {"text": TEXT, "sampling_params": {**GREEDY_AS, "stop_regex": "(a|aa)+a{9}$"}},
     "(a|aa)+a{9}$"),
]


def error_message(response: requests.Response) -> str:
    """The error text of SGLang's native ({"error": {"message"}}) or OpenAI ({"message"}) body."""
    try:
        body = response.json()
    except ValueError:
        return response.text
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(body.get("message"), str):
            return body["message"]
    return response.text


def post(url: str, case: BadCase) -> requests.Response:
    if case.raw is not None:
        return requests.post(url + case.route, data=case.raw, headers={"Content-Type": "application/json"}, timeout=60)
    return requests.post(url + case.route, json=case.build(), headers=case.headers, timeout=60)


@pytest.fixture(scope="module")
def probe_output(relaxkv_server) -> list[int]:
    """A fixed greedy request's output before the suite (from an empty cache)."""
    prompt = marked_prompt("Answer from the documents.", documents(2, seed=61), "Question: what is in them?")
    flush(relaxkv_server.url)
    out = generate(relaxkv_server.url, prompt, policy="pic")
    assert out["meta_info"]["relaxkv"]["chunks_seen"] == 2
    return out["output_ids"]


def test_case_names_are_unique():
    names = [c.name for c in HTTP_CASES + SCHEDULER_STOPPERS] + [c[0] for c in CLIENT_CASES + STOP_REGEX_SERVED]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("case", HTTP_CASES, ids=lambda c: c.name)
def test_bad_request_gets_4xx_naming_the_problem(relaxkv_server, probe_output, case):
    response = post(relaxkv_server.url, case)
    message = error_message(response)
    assert 400 <= response.status_code < 500, f"{case.name}: HTTP {response.status_code}: {response.text[:300]}"
    assert case.expect in message, f"{case.name}: {message[:500]!r}"
    TRIED.append(case.name)


# ------------------------------------------------------ frontend, client side


def _endpoint(url: str, **kwargs) -> RelaxKVEndpoint:
    return RelaxKVEndpoint(url, **kwargs)


CLIENT_CASES: list[tuple[str, Callable[[str], object], type[Exception], str]] = [
    # (name, call(url), exception, message substring)
    ("document_of_a_number", lambda url: document(5), TypeError, "document() takes a str, got int"),
    ("document_of_none", lambda url: document(None), TypeError, "document() takes a str, got NoneType"),
    ("document_of_bytes", lambda url: document(b"doc"), TypeError, "document() takes a str, got bytes"),
    ("document_empty", lambda url: document(""), ValueError, "document() needs a non-empty text"),
    ("document_holding_a_mark", lambda url: document("a\ufdd0b"), ValueError, "must not contain U+FDD0 / U+FDD1"),
    ("endpoint_unknown_policy", lambda url: _endpoint(url, policy="magic"), ValueError, "policy must be one of"),
    ("endpoint_policy_number", lambda url: _endpoint(url, policy=3), ValueError, "policy must be one of"),
    ("endpoint_custom_params_with_chunks", lambda url: _endpoint(url, custom_params={"relaxkv_chunks": [0, 1]}),
     ValueError, "custom_params must not hold relaxkv_chunks"),
    ("endpoint_custom_params_with_policy", lambda url: _endpoint(url, custom_params={"relaxkv_policy": "pic"}),
     ValueError, "custom_params must not hold relaxkv_policy"),
    ("endpoint_custom_params_not_a_dict", lambda url: _endpoint(url, custom_params=[("relaxkv_anchor_ratio", 0.2)]),
     TypeError, "custom_params must be a dict or None, got list"),
]


@sgl.function
def _rag(s, doc):
    s += "Sys.\n" + document(doc) + "\nQ?" + sgl.gen("answer", max_tokens=2, temperature=0)


def _program_error(url: str, custom_params: dict) -> None:
    """Run a program whose every request the server refuses; raise what the program reports."""
    state = _rag.run(doc="A document about ships.", backend=RelaxKVEndpoint(url, custom_params=custom_params))
    if state.error() is not None:
        raise RuntimeError(str(state.error()))


CLIENT_CASES += [
    # A program's requests refused by the server: the run reports the server's message.
    ("program_bad_knob", lambda url: _program_error(url, {"relaxkv_anchor_ratio": 2}), RuntimeError,
     "relaxkv_anchor_ratio: must be a number in [0, 1], got 2"),
    ("program_misspelt_field", lambda url: _program_error(url, {"relaxkv_anchor": 0.2}), RuntimeError,
     "custom_params.relaxkv_anchor: unknown field"),
]


@pytest.mark.parametrize("name,call,exc,expect", CLIENT_CASES, ids=[c[0] for c in CLIENT_CASES])
@pytest.mark.filterwarnings("ignore:Error in stream_executor")
def test_frontend_misuse_raises_one_clear_error(relaxkv_server, probe_output, name, call, exc, expect):
    with pytest.raises(exc) as info:
        call(relaxkv_server.url)
    assert expect in str(info.value), str(info.value)[:500]
    TRIED.append(name)


# ------------------------------------------------------ what the API accepts


def test_aborted_requests_in_a_batch_leave_the_others_repaired_as_alone(relaxkv_server):
    """Requests SGLang aborts (their one-token stubs) prefilled in one batch with repair requests:
    the stubs get SGLang's 400, the others are repaired and answer as when sent alone."""
    prompts = [marked_prompt(f"System {i}.", documents(3, seed=70 + i), "Question: what?") for i in range(3)]

    def body(prompt, **extra) -> dict:
        return {"text": prompt.text, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "custom_params": {
            "relaxkv_policy": "relaxkv", "relaxkv_chunks": prompt.offsets}, **extra.pop("sampling", {})}, **extra}

    flush(relaxkv_server.url)
    alone = [requests.post(relaxkv_server.url + G, json=body(p), timeout=120).json() for p in prompts]
    bad = [body(prompts[0], return_logprob=True, logprob_start_len=10_000), body(prompts[1], sampling={"regex": "(["}),
           body(prompts[2], session_params={"id": "nope"})]
    with concurrent.futures.ThreadPoolExecutor(len(bad) + len(prompts)) as pool:
        futures = [pool.submit(requests.post, relaxkv_server.url + G, json=b, timeout=120)
                   for b in bad + [body(p) for p in prompts]]
        answers = [f.result() for f in futures]
    assert [a.status_code for a in answers] == [400] * len(bad) + [200] * len(prompts), [a.text[:200] for a in answers]
    for first, again in zip(alone, (a.json() for a in answers[len(bad):])):
        assert again["output_ids"] == first["output_ids"]
        assert first["meta_info"]["relaxkv"]["repaired"] and again["meta_info"]["relaxkv"]["repaired"]
    assert requests.get(relaxkv_server.url + "/health", timeout=30).status_code == 200


def test_a_stock_server_refuses_what_would_stop_its_scheduler(server):
    """The plugin loads into every server: a stock one (no chunk tree) also gets the check of the
    fields that stop SGLang's own scheduler (it exited on logprob_start_len -2 before)."""
    response = requests.post(server.url + G, json=gen(return_logprob=True, logprob_start_len=-2), timeout=60)
    assert response.status_code == 400 and "invalid logprob_start_len" in error_message(response), response.text
    assert requests.get(server.url + "/health", timeout=30).status_code == 200


NORMAL = {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


@pytest.mark.parametrize("case", SCHEDULER_STOPPERS, ids=lambda c: c.name)
@pytest.mark.parametrize("which", ["relaxkv_server", "server"])
def test_what_stopped_sglangs_scheduler_gets_a_400_and_the_server_serves_on(request, which, case):
    """On the plugin's server and on a stock one (the plugin loaded, its chunk tree off): the case
    gets a 400 naming the field, then an ordinary request is served; on the plugin's server
    (strict idle memory check on) every KV slot is back after a flush."""
    srv = request.getfixturevalue(which)
    response = post(srv.url, case)
    assert response.status_code == 400, f"{case.name}: HTTP {response.status_code}: {response.text[:300]}"
    assert case.expect in error_message(response), f"{case.name}: {error_message(response)[:500]!r}"
    normal = requests.post(srv.url + G, json=NORMAL, timeout=60)
    assert normal.status_code == 200 and normal.json()["meta_info"]["completion_tokens"] == 4, normal.text[:300]
    if which == "relaxkv_server":
        check_idle(srv.url)
    assert srv.proc.poll() is None
    TRIED.append(f"{which}:{case.name}")


@pytest.mark.parametrize("name,body,stopped_by", STOP_REGEX_SERVED, ids=[c[0] for c in STOP_REGEX_SERVED])
@pytest.mark.parametrize("which", ["relaxkv_server", "server"])
def test_a_stop_regex_that_backtracked_is_served_and_the_server_serves_on(request, which, name, body, stopped_by):
    """On both servers: 200 (no time bound, so no abort whatever the load), the output of "a"s stopped
    only by a pattern that matches, then an ordinary request is served."""
    srv = request.getfixturevalue(which)
    response = requests.post(srv.url + G, json=body, timeout=60)
    assert response.status_code == 200, f"{name}: HTTP {response.status_code}: {response.text[:300]}"
    out = response.json()
    reason, text = out["meta_info"]["finish_reason"], out["text"]
    assert text and set(text) == {"a"}, f"{name}: {text!r}"
    if stopped_by is None:
        assert reason["type"] in ("length", "stop") and reason.get("matched") not in ("(a|aa)+$#", "x"), reason
        assert len(text) == 40, f"{name}: {text!r}"
    else:
        assert reason == {"type": "stop", "matched": stopped_by}, reason
        assert 10 <= len(text) < 40, f"{name}: {text!r}"
    normal = requests.post(srv.url + G, json=NORMAL, timeout=60)
    assert normal.status_code == 200 and normal.json()["meta_info"]["completion_tokens"] == 4, normal.text[:300]
    assert srv.proc.poll() is None
    TRIED.append(f"{which}:{name}")


@pytest.mark.parametrize("which", ["relaxkv_server", "server"])
def test_sglang_options_that_stopped_a_cpu_server_are_served(request, which):
    """A repetition penalty (its torch.compile'd scaling raised beside the CPU install's triton
    stub) and a stop regex that makes Python's re backtrack exponentially but not RE2: both
    served to their length, on both servers."""
    srv = request.getfixturevalue(which)
    for sampling in [{"repetition_penalty": 1.3}, {"stop_regex": "(.+)+\\Z#", "ignore_eos": True}]:
        body = {"text": TEXT, "sampling_params": {"max_new_tokens": 24, "temperature": 0, **sampling}}
        response = requests.post(srv.url + G, json=body, timeout=120)
        assert response.status_code == 200, f"{sampling}: {response.text[:300]}"
        assert response.json()["meta_info"]["finish_reason"]["type"] in ("length", "stop"), response.text[:300]
    assert requests.post(srv.url + G, json=NORMAL, timeout=60).status_code == 200

def test_streamed_bad_request_sends_the_400_as_its_first_event(relaxkv_server):
    body = dict(gen({"relaxkv_chunks": [0, 500]}), stream=True)
    with requests.post(relaxkv_server.url + "/generate", json=body, timeout=60, stream=True) as response:
        events = [line for line in response.iter_lines() if line.startswith(b"data: ")]
    first = json.loads(events[0][len(b"data: "):])
    assert first["error"]["code"] == 400
    assert "relaxkv_chunks: chunk 0 (offsets[0], offsets[1]) = (0, 500)" in first["error"]["message"]
    assert events[-1] == b"data: [DONE]"


def test_offsets_are_code_points_and_may_split_graphemes(relaxkv_server, tokenizer):
    # Documents holding wide characters, an emoji ZWJ sequence, a NUL, and a
    # boundary between a letter and its combining accent: all served, and each
    # document is the same chunk (same token ids) in a second prompt.
    docs = ["Ünïcödé 日本語のテキスト and 🚀 rockets", "a family 👨\u200d👩\u200d👧 and a NUL \x00 here",
            "the letter e"]
    tails = ["", "", "\u0301tude ends the third document"]  # the accent starts the glue after "e"

    def prompt(system: str, order: list[int]) -> tuple[str, list[int]]:
        text, offsets = system + "\n\n", []
        for i in order:
            offsets += [len(text), len(text) + len(docs[i])]
            text += docs[i] + tails[i] + "\n\n"
        return text + "Question?", offsets

    first_text, first_offsets = prompt("Sys one.", [0, 1, 2])
    second_text, second_offsets = prompt("Another system prompt.", [2, 0, 1])
    body = {"text": first_text, "sampling_params": {"max_new_tokens": 2, "custom_params": {
        "relaxkv_chunks": first_offsets, "relaxkv_policy": "pic"}}}
    first = requests.post(relaxkv_server.url + "/generate", json=body, timeout=60)
    assert first.status_code == 200, first.text
    body["text"], body["sampling_params"]["custom_params"]["relaxkv_chunks"] = second_text, second_offsets
    second = requests.post(relaxkv_server.url + "/generate", json=body, timeout=60).json()
    record = second["meta_info"]["relaxkv"]
    doc_tokens = sum(len(tokenizer.encode(d, add_special_tokens=False)) for d in docs)
    assert (record["chunks_seen"], record["chunks_hit"]) == (3, 3)
    assert record["chunk_tokens_reused"] == doc_tokens


# ------------------------------------------------------ after the suite


def test_server_still_serves_the_same_and_leaks_nothing(relaxkv_server, probe_output):
    assert relaxkv_server.proc.poll() is None, "the server process exited"
    prompt = marked_prompt("Answer from the documents.", documents(2, seed=61), "Question: what is in them?")
    flush(relaxkv_server.url)  # the same (empty) cache state as the probe before the suite
    again = generate(relaxkv_server.url, prompt, policy="pic")
    assert again["output_ids"] == probe_output
    check_idle(relaxkv_server.url)
    assert requests.get(relaxkv_server.url + "/health_generate", timeout=60).status_code == 200
    assert relaxkv_server.proc.poll() is None


def test_zz_report_how_many_cases_were_tried(capsys):
    """Last in the file: print the count (shown by pytest -q without -s)."""
    total = len(HTTP_CASES) + 2 * len(SCHEDULER_STOPPERS) + len(CLIENT_CASES) + 2 * len(STOP_REGEX_SERVED)
    routes: dict[str, int] = {}
    for case in HTTP_CASES + SCHEDULER_STOPPERS:
        routes[case.route] = routes.get(case.route, 0) + 1
    by_route = ", ".join(f"{route} {n}" for route, n in routes.items())
    with capsys.disabled():
        print(f"\nbad-input suite: {len(TRIED)} of {total} requests tried and answered as expected "
              f"({by_route}, client-side {len(CLIENT_CASES)}; the {len(SCHEDULER_STOPPERS)} that stopped SGLang's "
              f"scheduler on both servers; the {len(STOP_REGEX_SERVED)} backtracking stop_regex served on both)")
    assert total >= 40
