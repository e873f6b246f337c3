"""The checks of SGLang's own request fields (request/sglang/sglang_fields.py) and its stop-regex
matching by RE2, bounded by work (request/sglang/stop_regex.py), without a server (tests/e2e/test_bad_input.py sends each
case to real servers)."""

from __future__ import annotations

import re
import time
import types

import pytest

from relaxkv_sglang.request.schema import RequestError
from relaxkv_sglang.request.sglang.sglang_fields import (GRAMMAR_FIELDS, INT32_MAX, MAX_GRAMMAR_CHARS, MAX_N,
                                                         check_sglang_fields)
from relaxkv_sglang.request.linear_regex import compile_re2, to_re2
from relaxkv_sglang.request.sglang.stop_regex import BoundedRe

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
    dict(sampling_params={"stop_regex": "(.+)+\\Z#"}),  # backtracks catastrophically in re; linear in RE2
    dict(sampling_params={"stop_regex": ["(a|aa)+#", r"(?x) \bEND \s* $", r"\d{,3}\.", r"(?i)stop(?-i:X)"]}),
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
    (dict(sampling_params={"stop_regex": r"(a)\1"}), r"^invalid sampling_params.stop_regex: '\(a\)\\\\1' uses a "
                                                   r"construct with no linear-time matcher: a backreference "
                                                   r"\(RE2: invalid escape sequence: \\1\)$"),
    (dict(sampling_params=[{}, {"stop_regex": ["x", "(?P<q>.)(?P=q)"]}]), r"stop_regex: .* \(item 1\): a backreference"),
    (dict(sampling_params={"stop_regex": "END(?=\n)"}), r"no linear-time matcher: a lookahead or lookbehind "
                                                         r"\(RE2: invalid perl operator: \(\?=\)"),
    (dict(sampling_params={"stop_regex": "(?<!x)END"}), r"no linear-time matcher: a negative lookahead"),
    (dict(sampling_params={"stop_regex": "(?>a+)b"}), r"no linear-time matcher: an atomic group"),
    (dict(sampling_params={"stop_regex": "a++b"}), r"no linear-time matcher: a possessive quantifier "
                                                   r"\(RE2: bad repetition operator: \+\+\)"),
    (dict(sampling_params={"stop_regex": "(a)?(?(1)b|c)"}), r"no linear-time matcher: a conditional group"),
    (dict(sampling_params={"stop_regex": "a{2000}"}), r"no linear-time matcher: RE2: invalid repetition size"),
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


SAME_AS_RE = [(r"\d+\.", "ab 12. c"), (r"\w+ \w+$", "one two"), (r"^x", "yx"), (r"(?i)STOP", "a stop"),
              (r"[^\x00-\x7f]", "naïve"), (r"a|b", ""), (r"\w+", "naïve ünï"), (r"\d", "x٣"), (r"\s", "a\u3000b"),
              (r"\s", "\v"), (r"(?a)\w+", "naïve"), (r"a{,3}", "aaaa"), (r"[[:alpha:]]", "x:"), (r"(?x) a b # c", "ab"),
              (r"a\Z", "a\n"), (r"\Z", "ab"), (r"(?m)^b$", "a\nb\nc"), (r"(?s)a.b", "a\nb"), (r"a.b", "a\nb"),
              (r"\N{LATIN SMALL LETTER E WITH ACUTE}", "é"), (r"\u00e9|\x41|\101|\0", "A"), (r"[\b]", "\b"),
              (r"(?i)a(?-i:B)", "AB"), (r"(?i)a(?-i:B)", "Ab"), (r"(?i)[^a]", "AAa"), (r"[^\W\d]+", "12_é"),
              (r"(ab)+?c", "ababc"), (r"\bend\b", "the end."), (r"(?:(a|aa)+)+b", "aaab"), (r"(a|aa)+#", "aa#"),
              (r"\.\*\+\?\(\)\[\]\{\}\|\^\$\\", ".*+?()[]{}|^$\\"), (r"x*", ""), (r"END", "x\ud800END")]


@pytest.mark.filterwarnings("ignore:Possible nested set:FutureWarning")
@pytest.mark.parametrize("pattern,text", SAME_AS_RE, ids=repr)
def test_the_re2_search_gives_the_span_re_gives(pattern, text):
    ours, theirs = BoundedRe.search(pattern, text), re.search(pattern, text)
    assert (ours and ours.span()) == (theirs and theirs.span()), to_re2(pattern)


def test_the_known_differences_from_re():
    # Python's `$` matches before a final newline; RE2's match takes the newline (SGLang reads only
    # whether there is a match).
    assert BoundedRe.search(r"END$", "x END\n").span() == (2, 6)
    # `\b` is an ASCII word boundary (Python's: Unicode, unless `(?a)`).
    assert BoundedRe.search(r"é\b", "é") is None and re.search(r"é\b", "é")
    assert BoundedRe.search(r"(?a)é\b", "é") is None and re.search(r"(?a)é\b", "é") is None


def test_bounded_re_is_re_but_for_search():
    bounded = BoundedRe()
    assert bounded.compile is re.compile and bounded.error is re.error
    for pattern in ["(", r"(a)\1", "(?<=a)b"]:  # what the HTTP check refuses: SGLang's handler aborts it (400)
        with pytest.raises(re.error):
            bounded.search(pattern, "x")
    assert compile_re2("END") is compile_re2("END")  # cached


@pytest.mark.parametrize("pattern,text,matching", [
    (r"(a|aa)+#", "a" * 20_000, "a" * 19_999 + "#"), (r"(a|aa)+$#", "a" * 20_000, None),
    (r"(.+)+\Z#", "x" * 20_000, None), (r"(\w+\s?)*#", "ab " * 10_000, "ab " * 9_999 + "#"),
    (r"(?:(a|aa)+)+b", "a" * 20_000, "a" * 19_999 + "b")])
def test_a_catastrophic_pattern_is_answered_at_once_and_right(pattern, text, matching):
    """re alone: exponential (hours on 40 characters); RE2: linear, whatever the machine's load."""
    start = time.perf_counter()
    assert BoundedRe.search(pattern, text) is None
    assert time.perf_counter() - start < 1.0  # about 1 ms; a loose bound for a loaded test machine
    if matching is not None:
        assert BoundedRe.search(pattern, matching).span() == (0, len(matching))


def test_install_rebinds_schedule_batchs_re():
    from sglang.srt.managers import schedule_batch

    from relaxkv_sglang.request.sglang.stop_regex import install

    saved = schedule_batch.re
    try:
        schedule_batch.re = re
        install()
        install()  # idempotent
        assert isinstance(schedule_batch.re, BoundedRe)
    finally:
        schedule_batch.re = saved
