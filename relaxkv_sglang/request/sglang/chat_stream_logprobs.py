"""A streamed chat keeps every token's logprob: one whose step sends no chunk rides on the next.

SGLang 0.5.23's streamed chat attaches a step's logprobs to the chunk it emits, and a step with an empty text
delta (a UTF-8 character held back, a skipped special token; which steps depends on timing) emits none. Carried
to the choice's next chunk (a finishing step sends one of empty content), the stream's logprobs are the
non-streamed answer's, token for token.

SGLang file touched: ``entrypoints/openai/serving_chat.py`` (``OpenAIServingChat._generate_stream_content``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional

from relaxkv_sglang.runtime.hooks import Hook

if TYPE_CHECKING:
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat

__all__ = ["around_generate_stream_content", "merged_logprobs"]

_PENDING = "relaxkv_pending_logprobs"  # key prefix in the request's stream_offsets dict (module doc)


def merged_logprobs(pending: Optional[dict], step: Optional[dict]) -> Optional[dict]:
    """``ChoiceLogprobs.model_dump()`` dicts of two steps as one (either may be None).

    >>> merged_logprobs({"content": [{"token": "a"}]}, {"content": [{"token": "b"}]})
    {'content': [{'token': 'a'}, {'token': 'b'}]}
    >>> merged_logprobs(None, {"content": []})
    {'content': []}
    """
    if pending is None or step is None:
        return step if pending is None else pending
    return dict(step, content=list(pending.get("content") or []) + list(step.get("content") or []))


async def around_generate_stream_content(original: Callable[..., AsyncIterator[str]], serving: OpenAIServingChat,
                                         *args: Any, **kwargs: Any) -> AsyncIterator[str]:
    """Hook: a step's logprobs without a chunk wait in ``stream_offsets`` (the request's own dict)."""
    offsets, index = kwargs["stream_offsets"], kwargs["index"]
    key = (_PENDING, index)
    kwargs["choice_logprobs"] = merged_logprobs(offsets.pop(key, None), kwargs.get("choice_logprobs"))
    emitted = False
    async for chunk in original(serving, *args, **kwargs):
        emitted = True
        yield chunk
    logprobs = kwargs["choice_logprobs"]
    if emitted or logprobs is None:
        return
    if kwargs.get("finish_reason_type") is None:
        offsets[key] = logprobs
        return
    from sglang.srt.entrypoints.openai.serving_chat import build_sse_content  # only a finishing step needs it

    content, request = kwargs["content"], kwargs["request"]
    yield build_sse_content(chunk_id=content["meta_info"]["id"], created=kwargs["created"], model=request.model,
                            index=index, content="", logprobs=logprobs)


#: the SGLang functions this module wraps (registered by ``server/sglang/plugin.py``)
HOOKS = (
    Hook("sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"
         "._generate_stream_content",
         around_generate_stream_content, ("self", "content", "index", "request", "created", "stream_offsets",
                                          "reasoning_parser_dict", "parser_dict", "has_tool_calls", "choice_logprobs",
                                          "finish_reason_type")),
)
