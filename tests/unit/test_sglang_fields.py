"""The checks of SGLang's own request fields (request/sglang/sglang_fields.py) and the time bound on its
stop-regex matching (request/sglang/stop_regex.py), without a server (tests/e2e/test_bad_input.py sends each
case to real servers)."""

from __future__ import annotations

import re
import time
import types

import pytest

from relaxkv_sglang.request.schema import RequestError
from relaxkv_sglang.request.sglang.sglang_fields import (GRAMMAR_FIELDS, INT32_MAX, MAX_GRAMMAR_CHARS, MAX_N,
                                                         check_sglang_fields)
from relaxkv_sglang.request.sglang.stop_regex import SEARCH_TIMEOUT_S, BoundedRe, StopRegexTimeout, around_check_str_based_finish

VOCAB = 2048
CONTEXT = 4096  # the server's context length


def request(**fields) -> types.SimpleNamespace:
    """A GenerateReqInput as SGLang's HTTP server parsed it (only the fields the check reads)."""
    base = dict(logprob_start_len=None, top_logprobs_num=None, input_ids=None, positional_embed_overrides=None,
                sampling_params=None)
    return types.SimpleNamespace(**{**base, **fields})


ACCEPTED = [
    dict(top_logprobs_num=VOCAB), dict(top_logprobs_num=-1), dict(top_logprobs_num=[0, VOCAB]),
    dict(input_ids=[0, 5, VOCAB - 1]), dict(input_ids=[[1, 2], [VOCAB - 1]]), dict(input_ids=[]),
    dict(input_ids=[[1], []]),
    dict(sampling_params={"top_k": INT32_MAX}), dict(sampling_params={"top_k": -1}),
    dict(sampling_params=[{"top_k": 5}, {"stop_regex": ["a+", "[0-9]{2}"]}]),
    dict(sampling_params={"stop_regex": "(.+)+\\Z#"}),  # compiles; bounded where it runs
    dict(logprob_start_len=-1), dict(logprob_start_len=[0, 7]),
    dict(sampling_params={"n": MAX_N}), dict(sampling_params=[{"n": 1}, {"n": MAX_N}]),
    dict(sampling_params={"min_new_tokens": CONTEXT, "max_new_tokens": None}),
    dict(sampling_params=[{"min_new_tokens": 0}, {"min_new_tokens": CONTEXT}]),
    *(dict(sampling_params={field: "x" * MAX_GRAMMAR_CHARS}) for field in GRAMMAR_FIELDS),
    dict(sampling_params={"json_schema": {"not": "a string"}}),  # SGLang's parser refuses other types
]

REFUSED = [
    (dict(top_logprobs_num=VOCAB + 1), r"^invalid top_logprobs_num: must be at most the vocabulary size 2048 "
                                       r"\(OpenAI: `logprobs` / `top_logprobs`\), got 2049$"),
    (dict(top_logprobs_num=[1, 10**6]), r"top_logprobs_num: .* \(item 1\), got 1000000"),
    (dict(input_ids=[1, 2, VOCAB]), r"^invalid input_ids: token id 2048 at position 2 is outside the vocabulary "
                                    r"\[0, 2048\)$"),
    (dict(input_ids=[1, -3]), r"token id -3 at position 1 is outside"),
    (dict(input_ids=[[1], [2, 10**6]]), r"token id 1000000 at position 1 \(item 1\) is outside"),
    (dict(sampling_params={"top_k": 2**31}), r"^invalid sampling_params.top_k: must be -1 \(all tokens\) or in "
                                              r"\[1, 2147483647\], got 2147483648$"),
    (dict(sampling_params=[{}, {"top_k": 10**12}]), r"sampling_params.top_k: .*\(item 1\), got 1000000000000"),
    (dict(sampling_params={"stop_regex": "("}), r"^invalid sampling_params.stop_regex: '\(' is not a valid regular "
                                                r"expression: missing \)"),
    (dict(sampling_params={"stop_regex": ["ok", "a{2,1}"]}), r"sampling_params.stop_regex: 'a\{2,1\}'"),
    (dict(positional_embed_overrides={"a": 1}), r"^invalid positional_embed_overrides: takes SGLang's "
                                                r"PositionalEmbeds objects .* got dict$"),
    (dict(positional_embed_overrides=[[0, [0.1]]]), r"positional_embed_overrides: .* got list"),
    (dict(logprob_start_len=-2), r"^invalid logprob_start_len: must be -1 \(none\) or a token position >= 0, got -2$"),
    (dict(logprob_start_len=[0, -3]), r"\(item 1\), got -3"),
    (dict(sampling_params={"n": MAX_N + 1}), r"^invalid sampling_params.n: must be at most 128 \(OpenAI: `n`\), "
                                             r"got 129$"),
    (dict(sampling_params=[{"n": 2}, {"n": 10_000}]), r"sampling_params.n: .* \(item 1\), got 10000$"),
    (dict(sampling_params={"min_new_tokens": CONTEXT + 1}), r"^invalid sampling_params.min_new_tokens: must be at "
                                                            r"most the context length 4096 \(OpenAI: `min_tokens`\), "
                                                            r"got 4097$"),
    (dict(sampling_params=[{}, {"min_new_tokens": 10**6}]), r"min_new_tokens: .* \(item 1\), got 1000000$"),
    *((dict(sampling_params={field: "x" * (MAX_GRAMMAR_CHARS + 1)}),
       rf"^invalid sampling_params.{field}: must be at most 65536 characters .*, got 65537$") for field in GRAMMAR_FIELDS),
    (dict(sampling_params=[{"regex": "a"}, {"json_schema": "x" * 10**6}]),
     r"sampling_params.json_schema: .* \(item 1\), got 1000000$"),
]


@pytest.mark.parametrize("fields", ACCEPTED, ids=repr)
def test_accepted(fields):
    check_sglang_fields(request(**fields), VOCAB, CONTEXT)


@pytest.mark.parametrize("fields,message", REFUSED, ids=lambda x: repr(x)[:60])
def test_refused_naming_the_field(fields, message):
    with pytest.raises(RequestError, match=message):
        check_sglang_fields(request(**fields), VOCAB, CONTEXT)


def test_without_a_context_length_only_the_min_new_tokens_bound_is_skipped():
    check_sglang_fields(request(sampling_params={"min_new_tokens": 10**6}), VOCAB)
    with pytest.raises(RequestError, match="sampling_params.n"):
        check_sglang_fields(request(sampling_params={"min_new_tokens": 10**6, "n": 10_000}), VOCAB)


def test_a_100k_value_enum_is_refused_before_xgrammar_sees_it():
    """The schema that blocked SGLang's grammar thread (about 32 s of compiling on the 2-core test machine)."""
    import json

    schema = json.dumps({"type": "string", "enum": [f"value{i}" for i in range(100_000)]})
    with pytest.raises(RequestError, match=rf"sampling_params.json_schema: .*, got {len(schema)}$"):
        check_sglang_fields(request(sampling_params={"json_schema": schema}), VOCAB, CONTEXT)


def test_without_a_vocabulary_size_only_the_vocabulary_checks_are_skipped():
    check_sglang_fields(request(top_logprobs_num=10**6, input_ids=[10**6]), None)
    with pytest.raises(RequestError, match="sampling_params.top_k"):
        check_sglang_fields(request(sampling_params={"top_k": 2**40}), None)


def test_bounded_search_matches_as_re_does():
    bounded = BoundedRe()
    for pattern, text in [(r"\d+\.", "ab 12. c"), (r"\w+ \w+$", "one two"), (r"^x", "yx"), (r"(?i)STOP", "a stop"),
                          (r"[^\x00-\x7f]", "naïve"), (r"a|b", "")]:
        ours, theirs = bounded.search(pattern, text), re.search(pattern, text)
        assert (ours and ours.span()) == (theirs and theirs.span()), pattern
    assert bounded.compile is re.compile and bounded.error is re.error
    with pytest.raises(re.error):
        bounded.search("(", "x")


def test_a_catastrophic_search_stops_near_its_bound():
    start = time.perf_counter()
    with pytest.raises(StopRegexTimeout, match=r"stop_regex '\(a\|aa\)\+\$#': matching it on 400 characters"):
        BoundedRe().search(r"(a|aa)+$#", "a" * 400)
    assert time.perf_counter() - start < 10 * SEARCH_TIMEOUT_S  # re alone: exponential (hours)


def test_the_hook_aborts_the_request_with_400_on_a_timeout_and_keeps_sglangs_abort():
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH

    req = types.SimpleNamespace(finished_reason=None, finished_len=7)

    def times_out(r, new_accepted_len=1):
        raise StopRegexTimeout("(a|aa)+#", 400)

    assert around_check_str_based_finish(times_out, req, 1) is True
    assert isinstance(req.finished_reason, FINISH_ABORT) and req.finished_reason.status_code == 400
    assert "stop_regex '(a|aa)+#'" in req.finished_reason.message and req.finished_len is None

    def sglang_aborted(r, new_accepted_len=1):  # SGLang's handler of a pattern re cannot compile
        r.finished_reason = FINISH_ABORT("invalid stop_regex", 400)
        return False

    req = types.SimpleNamespace(finished_reason=None, finished_len=None)
    assert around_check_str_based_finish(sglang_aborted, req, 1) is True
    req = types.SimpleNamespace(finished_reason=FINISH_LENGTH(length=3), finished_len=None)
    assert around_check_str_based_finish(lambda r, n=1: False, req, 1) is False
