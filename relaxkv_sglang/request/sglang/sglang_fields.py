"""SGLang's own request fields whose bad values stop its scheduler or cost unbounded work: refused in the HTTP process.

Some values pass SGLang 0.5.23's checks and then raise in the scheduler, ending the server; others cost
far more than any use needs. :func:`check_sglang_fields` (from :mod:`.api`'s hook, every server) refuses
them with HTTP 400; each bound and why: ``docs/reliability.md`` ("Request bounds"). Wrong JSON types
are left to SGLang's parser.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Optional

from relaxkv_sglang.request.linear_regex import Unsupported, compile_re2
from relaxkv_sglang.request.schema import RequestError

if TYPE_CHECKING:
    from sglang.srt.managers.io_struct import GenerateReqInput

__all__ = ["GRAMMAR_FIELDS", "INT32_MAX", "MAX_GRAMMAR_CHARS", "MAX_N", "check_sglang_fields"]

INT32_MAX = 2**31 - 1  # SGLang builds its per-batch top_k tensor as int32
MAX_N = 128  # OpenAI's limit; SGLang copies the request n times, unbounded
MAX_GRAMMAR_CHARS = 65_536  # xgrammar's compile time grows faster than the text, in SGLang's one grammar thread
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")  # SamplingParams' grammar fields


def check_sglang_fields(obj: GenerateReqInput, vocab_size: Optional[int] = None,
                        context_len: Optional[int] = None) -> None:
    """Raises :class:`RequestError`. ``obj`` before SGLang normalizes it (an OpenAI route's ``n``, ``min_tokens``,
    ``response_format`` in its ``sampling_params``); a None ``vocab_size`` / ``context_len`` skips their checks.

    >>> from types import SimpleNamespace
    >>> check_sglang_fields(SimpleNamespace(input_ids=[1, 5], sampling_params={"stop_regex": "END"}), 100)
    >>> check_sglang_fields(SimpleNamespace(input_ids=[1, 500]), vocab_size=100)
    Traceback (most recent call last):
    ...
    relaxkv_sglang.request.schema.RequestError: invalid input_ids: token id 500 at position 1 is outside ... [0, 100)
    """
    _check_logprob_start_len(getattr(obj, "logprob_start_len", None))
    if vocab_size is not None:
        _check_top_logprobs_num(getattr(obj, "top_logprobs_num", None), vocab_size)
        _check_input_ids(getattr(obj, "input_ids", None), vocab_size)
    _check_positional_embed_overrides(getattr(obj, "positional_embed_overrides", None))
    sampling_params = getattr(obj, "sampling_params", None)
    items = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    for i, sp in enumerate(items):
        if isinstance(sp, dict):
            where = f" (item {i})" if isinstance(sampling_params, list) else ""
            _check_top_k(sp.get("top_k"), where)
            _check_stop_regex(sp.get("stop_regex"), where)
            _check_n(sp.get("n"), where)
            if context_len is not None:
                _check_min_new_tokens(sp.get("min_new_tokens"), context_len, where)
            for field in GRAMMAR_FIELDS:
                _check_grammar(field, sp.get(field), where)


def _where(value: Any, i: int) -> str:
    return f" (item {i})" if isinstance(value, list) else ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_logprob_start_len(value: Any) -> None:
    """-2 and below fail an assertion in SGLang's logprob processing (a stock server's too)."""
    for i, item in enumerate(value if isinstance(value, list) else [value]):
        if item is None:
            continue
        if not _is_int(item) or item < -1:
            raise RequestError("logprob_start_len",
                               f"must be -1 (none) or a token position >= 0{_where(value, i)}, got {item!r}")


def _check_top_logprobs_num(value: Any, vocab_size: int) -> None:
    """``torch.topk`` raises above the vocabulary, whatever ``return_logprob`` says."""
    for i, item in enumerate(value if isinstance(value, list) else [value]):
        if _is_int(item) and item > vocab_size:
            raise RequestError("top_logprobs_num", f"must be at most the vocabulary size {vocab_size} (OpenAI: "
                                                   f"`logprobs` / `top_logprobs`){_where(value, i)}, got {item}")


def _check_input_ids(value: Any, vocab_size: int) -> None:
    """The embedding lookup raises outside ``[0, vocab_size)``."""
    if not isinstance(value, list) or not value:
        return
    batch = isinstance(value[0], list)
    for i, ids in enumerate(value if batch else [value]):
        if not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids):
            continue  # SGLang's own parser refuses a malformed list; an empty one may be a session turn
        low, high = min(ids), max(ids)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            where = f" (item {i})" if batch else ""
            raise RequestError("input_ids", f"token id {bad} at position {ids.index(bad)}{where} is outside the "
                                            f"vocabulary [0, {vocab_size})")


def _check_positional_embed_overrides(value: Any) -> None:
    if value is None:
        return
    from sglang.srt.managers.embed_types import PositionalEmbeds

    items = value if isinstance(value, list) else [value]
    for item in items:
        if item is not None and not isinstance(item, PositionalEmbeds):
            raise RequestError("positional_embed_overrides",
                               f"takes SGLang's PositionalEmbeds objects (the Engine API), which JSON cannot "
                               f"express; got {type(item).__name__}")


def _check_top_k(value: Any, where: str) -> None:
    if _is_int(value) and value > INT32_MAX:
        raise RequestError("sampling_params.top_k", f"must be -1 (all tokens) or in [1, {INT32_MAX}]{where}, "
                                                    f"got {value}")


def _check_stop_regex(value: Any, where: str) -> None:
    """It must compile with ``re`` (else SGLang answers 500) and with RE2 (:mod:`.stop_regex` matches with it)."""
    for pattern in value if isinstance(value, list) else [value]:
        if not isinstance(pattern, str):
            continue  # SGLang's parser refuses other types
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as exc:
            raise RequestError("sampling_params.stop_regex", f"{pattern!r} is not a valid regular expression"
                                                             f"{where}: {exc}") from exc
        try:
            compile_re2(pattern)
        except (re.error, RecursionError) as exc:
            raise RequestError("sampling_params.stop_regex", f"{pattern!r} is not a valid regular expression"
                                                             f"{where}: {exc}") from exc
        except Unsupported as exc:
            raise RequestError("sampling_params.stop_regex", f"{pattern!r} uses a construct with no linear-time "
                                                             f"matcher{where}: {exc}") from exc


def _check_n(value: Any, where: str) -> None:
    if _is_int(value) and value > MAX_N:
        raise RequestError("sampling_params.n", f"must be at most {MAX_N} (OpenAI: `n`){where}, got {value}")


def _check_min_new_tokens(value: Any, context_len: int, where: str) -> None:
    """SGLang checks it against ``max_new_tokens`` only when given; above the context it cannot be met
    and only makes the request run to the context's end."""
    if _is_int(value) and value > context_len:
        raise RequestError("sampling_params.min_new_tokens", f"must be at most the context length {context_len} "
                                                             f"(OpenAI: `min_tokens`){where}, got {value}")


def _check_grammar(field: str, value: Any, where: str) -> None:
    if isinstance(value, str) and len(value) > MAX_GRAMMAR_CHARS:
        raise RequestError(f"sampling_params.{field}", f"must be at most {MAX_GRAMMAR_CHARS} characters (OpenAI: "
                                                        f"`response_format`, tool schemas){where}, got {len(value)}")
