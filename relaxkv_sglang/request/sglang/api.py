"""Request fields of the native API (``sampling_params.custom_params``: :mod:`relaxkv_sglang.request.schema`,
``docs/api.md``), validated and tokenized in the HTTP process. Each part (prefix, chunk, glue, query) is
tokenized on its own, so a document always gets the same ids; the request reaches the scheduler as
``input_ids`` and its :class:`~relaxkv_sglang.request.plan.RequestPlan`. Invalid input raises
:class:`~relaxkv_sglang.request.schema.RequestError` (HTTP 400).

SGLang files touched (wrapped): ``managers/tokenizer_manager.py`` (``TokenizerManager.generate_request``),
``managers/tokenizer_control_mixin.py`` (``TokenizerControlMixin.flush_cache``: the discovery index too)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional, Sequence, Union

from relaxkv_sglang.runtime.hooks import Hook
from relaxkv_sglang.repair.policies import CHUNK_POLICIES, Policy
from relaxkv_sglang.request.doc_index import DocumentIndex, discover_chunks, token_boundaries
from relaxkv_sglang.request.segments import split_text, tokenize_parts
from relaxkv_sglang.request.schema import (
    CHUNKS,
    PLAN_KEY,
    POLICY,
    RECORD_KEY,
    REPAIR_KNOBS,
    RequestError,
    check_keys,
    header_policy,
    mentions_fields,
)
from relaxkv_sglang.runtime.settings import server_settings
from relaxkv_sglang.runtime import records
from relaxkv_sglang.request.plan import RequestPlan, chunk_tree_served, request_namespace
from relaxkv_sglang.request.sglang.gate_refusal import chunk_refusal
from relaxkv_sglang.request.sglang.sglang_fields import check_sglang_fields

if TYPE_CHECKING:
    from fastapi import Request
    from sglang.srt.managers.io_struct import EmbeddingReqInput, GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from transformers import PreTrainedTokenizerBase

__all__ = ["RequestError", "check_sglang_fields", "document_index", "item_namespace",
           "plan_item", "prepare_generate", "prompt_boundaries", "around_generate_request", "around_flush_cache"]

logger = logging.getLogger(__name__)

Encode = Callable[[str, bool], list[int]]  # (text, add_special_tokens) -> token ids
# text -> the sorted character offsets of its token boundaries, or None if the tokenizer cannot tell
Boundaries = Callable[[str], Optional[Sequence[int]]]
def document_index(tokenizer_manager: TokenizerManager) -> Optional[DocumentIndex]:
    """The HTTP process's :class:`DocumentIndex` (kept on the ``TokenizerManager``); None unless
    ``RELAXKV_DISCOVERY_INDEX`` is set."""
    if not server_settings().discovery_index:
        return None
    held = records.record(tokenizer_manager, DocumentIndex, create=False)
    return held if held is not None else records.attach(tokenizer_manager, DocumentIndex())


def prompt_boundaries(tokenizer: PreTrainedTokenizerBase, text: str) -> Optional[list[int]]:
    """The token boundaries of ``text`` under the server's ``tokenizer`` (its offset mapping); None
    when it gives no offsets (a slow tokenizer)."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
        spans = enc["offset_mapping"]
    except (NotImplementedError, KeyError, TypeError, ValueError) as exc:
        logger.warning("relaxkv: the tokenizer gives no character offsets (%s): unmarked prompts are not chunked",
                       exc)
        return None
    return token_boundaries(spans, len(text))


async def around_flush_cache(original: Callable[..., Any], tokenizer_manager: TokenizerManager, *args: Any,
                             **kwargs: Any) -> Any:
    """Hook on ``TokenizerControlMixin.flush_cache``: a successful flush also empties the discovery index."""
    result = await original(tokenizer_manager, *args, **kwargs)
    index = records.record(tokenizer_manager, DocumentIndex, create=False)
    if index is not None and getattr(result, "success", False):
        index.clear()
    return result


class _Tenant:
    """The two SGLang fields naming a request's chunk namespace (:func:`request_namespace`)."""

    def __init__(self, extra_key: Optional[str], cache_salt: Optional[str]) -> None:
        self.extra_key, self.cache_salt = extra_key, cache_salt


def item_namespace(obj: GenerateReqInput, i: int = 0) -> Optional[str]:
    """The chunk namespace of item ``i`` of a ``GenerateReqInput``, as the scheduler will name it."""

    def value(name: str) -> Optional[str]:
        """Item ``i``'s value of the field ``name``."""
        v = getattr(obj, name, None)
        if isinstance(v, list):
            v = v[i] if i < len(v) else None
        return v if isinstance(v, str) and v else None

    return request_namespace(_Tenant(value("extra_key"), value("cache_salt")))


def _custom_params(sampling_params: dict) -> dict:
    cp = sampling_params.get("custom_params")
    if cp is None:
        return {}
    if not isinstance(cp, dict):
        raise RequestError("sampling_params.custom_params", f"must be an object, got {type(cp).__name__}")
    check_keys(cp)
    return cp


def plan_item(
    text: Optional[str], sampling_params: dict, encode: Encode, context_len: int, policy_default: str,
    chunks_refused: str = "", index: Optional[DocumentIndex] = None, namespace: Optional[str] = None,
    boundaries_of: Optional[Boundaries] = None,
) -> Optional[tuple[Optional[list[int]], dict]]:
    """Validate one request item; return (input_ids, custom_params with the plan under
    :data:`~relaxkv_sglang.request.schema.PLAN_KEY`) or None to leave it as is.

    ``chunks_refused``: why the startup gate refuses chunk policies, "" if served. An unmarked text
    under a chunk policy is split at the documents discovered on ``boundaries_of(text)`` (it
    returning None: nothing found; ``boundaries_of`` None: every offset is a boundary); those are
    remembered in ``index`` under ``namespace`` (a client's marks never are).

    Example (a tokenizer of one token per character):

    >>> encode = lambda text, add_special_tokens: [ord(c) for c in text]
    >>> ids, params = plan_item("Doc one. Doc two. Question?",
    ...     {"custom_params": {"relaxkv_policy": "pic", "relaxkv_chunks": [0, 9, 9, 18]}},
    ...     encode, context_len=4096, policy_default="prefix")
    >>> params["_relaxkv_plan"].chunk_spans, params["_relaxkv_plan"].prompt_len
    (((0, 9), (9, 18)), 27)
    >>> plan_item("Hello", {}, encode, context_len=4096, policy_default="prefix") is None
    True
    """
    cp = _custom_params(sampling_params)
    policy = POLICY.validate(cp.get(POLICY.name, policy_default))
    if chunks_refused and policy in CHUNK_POLICIES:
        raise POLICY.error(f"{policy!r} is refused by this server: its startup correctness gate failed "
                           f"({chunks_refused}); 'full' and 'prefix' are served")
    knobs = {f.config_attr: f.validate(cp[f.name]) for f in REPAIR_KNOBS if f.name in cp}
    spans = CHUNKS.validate(cp[CHUNKS.name], text=text) if CHUNKS.name in cp else None  # null is not "absent"
    if text is None:
        if policy == Policy.FULL:
            return None, dict(cp, **{PLAN_KEY: RequestPlan(policy, (), **knobs)})
        return None
    discovered = spans is None and policy in CHUNK_POLICIES
    if spans is None:
        spans = []
        boundaries = boundaries_of(text) if discovered and boundaries_of is not None else None
        if discovered and (boundaries_of is None or boundaries is not None):
            spans = discover_chunks(text, index, namespace, boundaries=boundaries, max_chunks=CHUNKS.max_chunks)
    if not spans and policy == Policy.PREFIX:
        return None
    segments = split_text(text, spans)
    if spans and not segments.query:
        # SGLang needs one computed token for the first logits: the last chunk stays uncached.
        spans = spans[:-1]
        segments = split_text(text, spans)
    try:
        layout = tokenize_parts(segments, encode)
    except ValueError as exc:
        raise CHUNKS.error(str(exc)) from exc
    for i, (s, e) in enumerate(layout.chunk_spans):
        if e - s > context_len:
            raise CHUNKS.error(f"chunk {i} has {e - s} tokens, more than the context length {context_len}")
    if index is not None and discovered:
        index.remember(namespace, segments.chunks)
    spans = tuple((int(s), int(e)) for s, e in layout.chunk_spans)
    plan = RequestPlan(policy, spans, prompt_len=len(layout.input_ids), **knobs)
    return layout.input_ids, dict(cp, **{PLAN_KEY: plan})


def prepare_generate(tokenizer_manager: TokenizerManager, obj: GenerateReqInput, chunks_refused: str = "",
                     requested_policy: Optional[str] = None) -> None:
    """Rewrite ``obj`` in place: chunked items become input_ids + plan. ``requested_policy``: the
    ``X-RelaxKV-Policy`` header (validated), the default of every item."""
    _check_batch_shape(obj)
    single, n = _batch_shape(obj)
    sps = obj.sampling_params
    if isinstance(sps, list):
        sp_items = [dict(sp or {}) for sp in sps]
    else:
        sp_items = [dict(sps or {}) for _ in range(n)]
    texts = obj.text
    text_items = [texts] if single else (list(texts) if texts is not None else [None] * n)
    policy = requested_policy or server_settings().default_policy
    if chunks_refused and policy in CHUNK_POLICIES and not requested_policy:
        policy = Policy.PREFIX.value  # the gate failed: a request naming no policy gets SGLang's radix cache
    if not any(_wants_plan(sp) for sp in sp_items) and policy == Policy.PREFIX:
        return
    if obj.text is not None and obj.input_ids is not None:
        # SGLang would serve input_ids and the plan would be built from text: refuse the ambiguity.
        raise RequestError("input_ids", "give the prompt as `text` or as `input_ids`, not both")
    tokenizer = tokenizer_manager.tokenizer

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        """The server's tokenizer, as :func:`plan_item` calls it."""
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def boundaries_of(text: str) -> Optional[list[int]]:
        """The text's token boundaries with the server's tokenizer, as :func:`plan_item` calls it."""
        return prompt_boundaries(tokenizer, text)

    context_len = int(getattr(tokenizer_manager, "context_len", 1 << 30))
    index = document_index(tokenizer_manager)
    planned = []
    for i, (t, sp) in enumerate(zip(text_items, sp_items)):
        try:
            planned.append(plan_item(t, sp, encode, context_len, policy, chunks_refused, index, item_namespace(obj, i),
                                     boundaries_of))
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


def _check_batch_shape(obj: GenerateReqInput) -> None:
    """One ``sampling_params`` object per prompt: SGLang fails on a short list (500) and ignores a
    long list's tail, which the per-item checks would then skip."""
    _, n = _batch_shape(obj)
    if isinstance(obj.sampling_params, list) and len(obj.sampling_params) != n:
        raise RequestError("sampling_params",
                           f"a list needs one object per prompt ({n}), got {len(obj.sampling_params)}")


def _batch_shape(obj: GenerateReqInput) -> tuple[bool, int]:
    """(whether the request is one prompt, how many prompts it holds), from text or input_ids."""
    texts = obj.text
    single = isinstance(texts, str) or (texts is None and not _is_batch_ids(obj.input_ids))
    if single:
        return True, 1
    prompts = texts if texts is not None else obj.input_ids
    return False, len(prompts) if isinstance(prompts, list) else 1


def _wants_plan(sampling_params: dict) -> bool:
    """Whether the item must go through plan_item (which also rejects reserved keys)."""
    cp = sampling_params.get("custom_params")
    if cp is None:
        return False
    if not isinstance(cp, dict):
        return True
    return mentions_fields(cp)


def _is_batch_ids(input_ids: Any) -> bool:
    return isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)


async def around_generate_request(
    original: Callable[..., AsyncIterator[Any]], tokenizer_manager: TokenizerManager,
    obj: Union[GenerateReqInput, EmbeddingReqInput], request: Optional[Request] = None, *args: Any, **kwargs: Any,
) -> AsyncIterator[Any]:
    """Hook on ``TokenizerManager.generate_request`` (an async generator)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    try:
        if isinstance(obj, GenerateReqInput):
            check_sglang_fields(obj, getattr(getattr(tokenizer_manager, "model_config", None), "vocab_size", None),
                                getattr(tokenizer_manager, "context_len", None))
        if isinstance(obj, GenerateReqInput) and chunk_tree_served(tokenizer_manager.server_args):
            requested = header_policy(getattr(request, "headers", None))
            prepare_generate(tokenizer_manager, obj, await chunk_refusal(tokenizer_manager), requested)
    except BaseException:  # any planning failure, not only a RequestError (a 400): SGLang's abort task runs on it
        _shape_for_abort_task(obj)
        raise
    async for out in original(tokenizer_manager, obj, request, *args, **kwargs):
        yield _one_record(out)


def _shape_for_abort_task(obj: Union[GenerateReqInput, EmbeddingReqInput]) -> None:
    """Set ``is_single``, which SGLang's abort task (``create_abort_task``, ``tokenizer_manager.py``)
    reads and a request refused before ``normalize_batch_and_arguments`` lacks (docs/reliability.md)."""
    if not hasattr(obj, "is_single"):
        obj.is_single = not isinstance(getattr(obj, "rid", None), list)


def _one_record(out: Any) -> Any:
    """``meta_info.relaxkv`` as one record: SGLang carries it as a list (customized_info)."""
    for item in out if isinstance(out, list) else [out]:
        meta = item.get("meta_info") if isinstance(item, dict) else None
        records = meta.get(RECORD_KEY) if meta else None
        if isinstance(records, list):
            meta[RECORD_KEY] = records[-1] if records else None
    return out


#: the SGLang functions this module wraps (registered by ``server/sglang/plugin.py``)
HOOKS = (
    Hook("sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
         around_generate_request, ("self", "obj", "request")),
    Hook("sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.flush_cache",
         around_flush_cache, ("self",)),
)
