"""A streamed chat keeps every token's logprob: one whose step sends no chunk rides on the next.

SGLang 0.5.23's streamed ``/v1/chat/completions`` attaches a step's logprobs to the chunk that step
emits; on the plain path (no reasoning or tool-call parser) a step whose text delta is empty emits
none, so the logprobs of a token that decodes to no text of its own (an incomplete UTF-8 character
the detokenizer holds back, a special token it skips) are lost, depending on how tokens fall into
steps (timing), not on the request. :func:`around_generate_stream_content` carries them to the
next chunk of that choice; a finishing step that emits no chunk sends them in one chunk of empty
content, so the stream's logprobs are the non-streamed answer's, token for token.

SGLang file touched: ``sglang/srt/entrypoints/openai/serving_chat.py``
(``OpenAIServingChat._generate_stream_content``, wrapped).
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Optional

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


async def around_generate_stream_content(original: Callable[..., AsyncIterator[str]], serving: Any,
                                         *args: Any, **kwargs: Any) -> AsyncIterator[str]:
    """Hook on ``OpenAIServingChat._generate_stream_content`` (an async generator, called with
    keyword arguments): logprobs of a step that emitted no chunk are held in ``stream_offsets``
    (the request's own dict, keyed by choice index there) and given to the choice's next step."""
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
