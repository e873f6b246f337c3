"""Request fields of the native API, validated and tokenized in the HTTP process.

A request opts in through ``sampling_params.custom_params``:

``relaxkv_chunks``
    Flat list of character offsets ``[s0, e0, s1, e1, ...]`` into ``text``; each
    pair is one document. Text before the first chunk is the prefix, after the
    last the query.
``relaxkv_policy``
    ``full`` (no reuse), ``prefix`` (SGLang's radix cache only), ``pic``
    (chunk reuse, no repair), or a repair policy: ``epic``, ``cacheblend``,
    ``prophetkv``, ``relaxkv``, ``relaxkv_fullctx``, ``relaxkv_randctx``;
    default: the server's (``RELAXKV_DEFAULT_POLICY``, ``prefix`` unless set).
``relaxkv_anchor_ratio`` / ``relaxkv_context_ratio``
    Repair knobs, numbers in [0, 1]: the mean share of reusable chunk tokens
    recomputed per layer (default 0.15), and the share of each anchor's causal
    prefix it attends to under ``relaxkv`` (default 0.25).

Without ``relaxkv_chunks``, a request whose policy reuses chunks is chunked
automatically (:func:`~relaxkv_sglang.core.segments.auto_chunk`). Each part is
tokenized on its own, so a document always gets the same token ids, and the
request reaches the scheduler as ``input_ids`` plus the internal plan entries
read by :mod:`relaxkv_sglang.srt.plan`. Invalid input raises ``ValueError``
naming the field, which SGLang's HTTP server answers with status 400.

SGLang file touched: ``sglang/srt/managers/tokenizer_manager.py``
(``TokenizerManager.generate_request``, wrapped).
"""

from __future__ import annotations

import os

from relaxkv_sglang.core.segments import ChunkSpecError, auto_chunk, parse_chunk_offsets, split_text, tokenize_parts
from relaxkv_sglang.srt.plan import (
    CHUNK_POLICIES,
    PLAN_ANCHOR_KEY,
    PLAN_CONTEXT_KEY,
    PLAN_POLICY_KEY,
    PLAN_SPANS_KEY,
    RECORD_KEY,
    SERVER_POLICIES,
    chunk_tree_served,
)

CHUNKS_FIELD = "relaxkv_chunks"
POLICY_FIELD = "relaxkv_policy"
ANCHOR_FIELD = "relaxkv_anchor_ratio"
CONTEXT_FIELD = "relaxkv_context_ratio"
USER_FIELDS = (CHUNKS_FIELD, POLICY_FIELD, ANCHOR_FIELD, CONTEXT_FIELD)
USER_PREFIX = "relaxkv_"  # a custom_params key with this prefix must be one of USER_FIELDS (typos are errors)
RESERVED_PREFIX = "_relaxkv_"  # the server's internal plan entries (plan.PLAN_KEYS and any future ones)
DEFAULT_POLICY_ENV = "RELAXKV_DEFAULT_POLICY"


def default_policy() -> str:
    policy = os.environ.get(DEFAULT_POLICY_ENV, "prefix")
    if policy not in SERVER_POLICIES:
        raise SystemExit(f"relaxkv-sglang: {DEFAULT_POLICY_ENV}={policy!r} is not one of {', '.join(SERVER_POLICIES)}")
    return policy


class RequestError(ValueError):
    """A client error; SGLang's HTTP layer answers ValueError with status 400."""

    def __init__(self, field: str, message: str):
        super().__init__(f"invalid {field}: {message}")
        self.field = field
        self.message = message


def _custom_params(sampling_params: dict) -> dict:
    cp = sampling_params.get("custom_params")
    if cp is None:
        return {}
    if not isinstance(cp, dict):
        raise RequestError("sampling_params.custom_params", f"must be an object, got {type(cp).__name__}")
    for key in cp:
        if not isinstance(key, str):
            continue
        if key.startswith(RESERVED_PREFIX):
            raise RequestError(f"custom_params.{key}", "is reserved for the server")
        if key.startswith(USER_PREFIX) and key not in USER_FIELDS:
            # A misspelt field would otherwise be ignored and the request served without reuse.
            raise RequestError(f"custom_params.{key}", f"unknown field; the relaxkv fields are {', '.join(USER_FIELDS)}")
    return cp


def plan_item(text: str | None, sampling_params: dict, encode, context_len: int, policy_default: str):
    """Validate one request item; return (input_ids, custom_params) or None to leave it as is.

    encode(text, add_special_tokens) -> list[int] is the server's tokenizer.
    """
    cp = _custom_params(sampling_params)
    policy = cp.get(POLICY_FIELD, policy_default)
    if not isinstance(policy, str) or policy not in SERVER_POLICIES:
        raise RequestError(POLICY_FIELD, f"unknown policy {policy!r}; choose one of {', '.join(SERVER_POLICIES)}")
    knobs = {key: _ratio(cp, field) for key, field in ((PLAN_ANCHOR_KEY, ANCHOR_FIELD), (PLAN_CONTEXT_KEY, CONTEXT_FIELD))
             if field in cp}
    has_chunks = CHUNKS_FIELD in cp  # null is not "absent": like every field, it must be a valid value
    if has_chunks and text is None:
        raise RequestError(CHUNKS_FIELD, "character offsets need the prompt as `text`, not `input_ids`")
    if text is None:
        if policy == "full":
            return None, dict(cp, **{PLAN_POLICY_KEY: policy, PLAN_SPANS_KEY: []})
        return None
    try:
        spans = parse_chunk_offsets(text, cp[CHUNKS_FIELD], field=CHUNKS_FIELD) if has_chunks else (
            auto_chunk(text) if policy in CHUNK_POLICIES else []
        )
    except ChunkSpecError as exc:
        raise RequestError(exc.field, exc.message) from exc
    if not spans and policy == "prefix":
        return None
    segments = split_text(text, spans)
    if spans and not segments.query:
        # SGLang needs at least one computed token for the first output's
        # logits: a prompt ending in a chunk keeps that last chunk uncached.
        spans = spans[:-1]
        segments = split_text(text, spans)
    try:
        layout = tokenize_parts(segments, encode)
    except ValueError as exc:
        raise RequestError(CHUNKS_FIELD, str(exc)) from exc
    for i, (s, e) in enumerate(layout.chunk_spans):
        if e - s > context_len:
            raise RequestError(CHUNKS_FIELD, f"chunk {i} has {e - s} tokens, more than the context length {context_len}")
    flat = [x for span in layout.chunk_spans for x in span]
    return layout.input_ids, dict(cp, **{PLAN_POLICY_KEY: policy, PLAN_SPANS_KEY: flat}, **knobs)


def _ratio(cp: dict, field: str) -> float:
    value = cp[field]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise RequestError(field, f"must be a number in [0, 1], got {value!r}")
    return float(value)


def prepare_generate(tokenizer_manager, obj) -> None:
    """Rewrite a ``GenerateReqInput`` in place: chunked items become input_ids + plan."""
    texts = obj.text
    single = isinstance(texts, str) or (texts is None and not _is_batch_ids(obj.input_ids))
    n = 1 if single else len(texts if texts is not None else obj.input_ids)
    sps = obj.sampling_params
    if isinstance(sps, list):
        if len(sps) < n:
            # SGLang 0.5.23 fails with an IndexError (HTTP 500) on a short list.
            raise RequestError("sampling_params", f"a list needs one object per prompt ({n}), got {len(sps)}")
        if len(sps) != n:
            return  # longer: SGLang's own handling
        sp_items = [dict(sp or {}) for sp in sps]
    else:
        sp_items = [dict(sps or {}) for _ in range(n)]
    text_items = [texts] if single else (list(texts) if texts is not None else [None] * n)
    policy = default_policy()
    if not any(_wants_plan(sp) for sp in sp_items) and policy == "prefix":
        return
    if obj.text is not None and obj.input_ids is not None:
        # SGLang would serve input_ids and the plan would be built from text: refuse the ambiguity.
        raise RequestError("input_ids", "give the prompt as `text` or as `input_ids`, not both")
    tokenizer = tokenizer_manager.tokenizer

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    context_len = int(getattr(tokenizer_manager, "context_len", 1 << 30))
    planned = []
    for i, (t, sp) in enumerate(zip(text_items, sp_items)):
        try:
            planned.append(plan_item(t, sp, encode, context_len, policy))
        except RequestError as exc:
            if single:
                raise
            raise RequestError(exc.field, f"batch item {i}: {exc.message}") from exc
    if all(p is None for p in planned):
        return
    ids = []
    for i, (text, sp, p) in enumerate(zip(text_items, sp_items, planned)):
        if p is not None:
            item_ids, sp["custom_params"] = p
        else:
            item_ids = None
        if item_ids is None:
            item_ids = encode(text, True) if text is not None else (obj.input_ids if single else obj.input_ids[i])
        ids.append(item_ids)
    obj.text = None
    obj.input_ids = ids[0] if single else ids
    obj.sampling_params = sp_items[0] if single else sp_items


def _wants_plan(sampling_params: dict) -> bool:
    """Whether the item must go through plan_item (which also rejects reserved keys)."""
    cp = sampling_params.get("custom_params")
    if cp is None:
        return False
    if not isinstance(cp, dict):
        return True
    return any(isinstance(k, str) and k.startswith((USER_PREFIX, RESERVED_PREFIX)) for k in cp)


def _is_batch_ids(input_ids) -> bool:
    return isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)


async def around_generate_request(original, tokenizer_manager, obj, request=None, *args, **kwargs):
    """Hook on ``TokenizerManager.generate_request`` (an async generator)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    if isinstance(obj, GenerateReqInput) and chunk_tree_served(tokenizer_manager.server_args):
        prepare_generate(tokenizer_manager, obj)
    async for out in original(tokenizer_manager, obj, request, *args, **kwargs):
        yield _one_record(out)


def _one_record(out):
    """``meta_info.relaxkv`` as one record: SGLang carries it as a list (customized_info)."""
    for item in out if isinstance(out, list) else [out]:
        meta = item.get("meta_info") if isinstance(item, dict) else None
        records = meta.get(RECORD_KEY) if meta else None
        if isinstance(records, list):
            meta[RECORD_KEY] = records[-1] if records else None
    return out
