"""Documents in OpenAI ``/v1/chat/completions`` requests become chunks.

Rule: in a message whose ``content`` is a list of parts, every text part except the message's
last is a document; string content, each message's last text part (the question) and non-text
parts never are::

    {"role": "user", "content": [
        {"type": "text", "text": DOC_1},           # document
        {"type": "text", "text": "Question: ..."}  # not a document
    ]}

Only under a chunk policy, and only if the re-rendered template (a placeholder per document)
tokenizes to exactly SGLang's ids, is the request rewritten to ``text`` + ``relaxkv_chunks``
(:mod:`.api`); otherwise it is served unchanged. Without document parts, documents are discovered
in the rendered prompt. Details: ``docs/api.md``.

SGLang file touched: ``entrypoints/openai/serving_chat.py`` (``OpenAIServingChat._convert_to_internal_request``)."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from relaxkv_sglang.runtime.hooks import Hook
from relaxkv_sglang.request.doc_index import discover_chunks
from relaxkv_sglang.request.schema import CHUNKS, POLICY, RequestError, header_policy
from relaxkv_sglang.runtime.settings import server_settings
from relaxkv_sglang.request.sglang.api import document_index, item_namespace, prompt_boundaries
from relaxkv_sglang.request.plan import chunk_tree_served

if TYPE_CHECKING:
    from fastapi import Request
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionMessageParam, ChatCompletionRequest
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.managers.io_struct import GenerateReqInput
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_PH_START = "\ufdd0"  # Unicode noncharacters: never in real text
_PH_END = "\ufdd1"
_PLACEHOLDER = re.compile(f"{_PH_START}(\\d+){_PH_END}")


def document_parts(messages: Sequence[ChatCompletionMessageParam]) -> list[tuple[int, int]]:
    """``(message index, part index)`` of every document, in prompt order."""
    found = []
    for mi, msg in enumerate(messages):
        content = getattr(msg, "content", None)
        if not isinstance(content, list):
            continue
        texts = [pi for pi, part in enumerate(content) if getattr(part, "type", None) == "text"]
        found.extend((mi, pi) for pi in texts[:-1])
    return found


def check_documents(messages: Sequence[ChatCompletionMessageParam]) -> None:
    """Reject an empty document part (HTTP 400): it would be a chunk of no text."""
    for mi, pi in document_parts(messages):
        if not getattr(messages[mi].content[pi], "text", None):
            raise RequestError(
                f"messages[{mi}].content[{pi}].text",
                "a document (a text part before the message's last text part) must not be empty",
            )


class _Skip(Exception):
    """This request keeps SGLang's own prompt (no chunk marks)."""


def _render(serving: OpenAIServingChat, request: ChatCompletionRequest, messages: list[dict]) -> tuple[str, list[dict]]:
    """The chat template rendered as SGLang renders it, and the messages as handed to it."""
    from sglang.srt.entrypoints.openai.serving_chat import normalize_tool_content
    from sglang.srt.parser.jinja_template_utils import process_content_for_template_format

    fmt = serving.template_manager.jinja_template_content_format
    processed = []
    for msg in messages:
        if msg.get("content") is None:
            msg["content"] = ""
        out = process_content_for_template_format(msg, fmt, [], [], [], [])
        out["content"] = normalize_tool_content(out["role"], out.get("content"))
        processed.append(out)
    add_generation_prompt = getattr(request, "_format_add_generation_prompt", None)
    if add_generation_prompt is None or request.continue_final_message:
        processed, assistant_prefix = serving._handle_last_assistant_message(processed, request)
        if assistant_prefix:
            raise _Skip("continue_final_message")
    kwargs = {}
    if request.reasoning_effort is not None:
        kwargs["reasoning_effort"] = request.reasoning_effort
    kwargs.update(request.chat_template_kwargs or {})
    rendered = serving.tokenizer_manager.tokenizer.apply_chat_template(
        processed, tokenize=False, add_generation_prompt=add_generation_prompt is not False,
        return_dict=False, **kwargs,
    )
    return rendered, processed


def marked_prompt(
    serving: OpenAIServingChat, request: ChatCompletionRequest, stock_ids: list[int],
) -> tuple[str, list[int]]:
    """The rendered prompt and its documents' flat character offsets; raises _Skip."""
    docs = document_parts(request.messages)
    messages = [m.model_dump() for m in request.messages]
    texts = []
    for k, (mi, pi) in enumerate(docs):
        part = messages[mi]["content"][pi]
        texts.append(part["text"])
        part["text"] = f"{_PH_START}{k}{_PH_END}"
    for m in request.messages:
        content = m.content if isinstance(m.content, str) else "".join(
            getattr(p, "text", None) or "" for p in (m.content or []))
        if _PH_START in content or _PH_END in content:
            raise _Skip("the messages contain U+FDD0/U+FDD1")
    rendered, _ = _render(serving, request, messages)
    pieces, offsets, pos, length = [], [], 0, 0
    expected = 0
    for match in _PLACEHOLDER.finditer(rendered):
        k = int(match.group(1))
        if k != expected:
            raise _Skip("the template reorders or repeats message content")
        glue = rendered[pos : match.start()]
        length += len(glue)
        pieces += [glue, texts[k]]
        offsets += [length, length + len(texts[k])]
        length += len(texts[k])
        pos = match.end()
        expected += 1
    if expected != len(texts):
        raise _Skip("the template drops message content")
    pieces.append(rendered[pos:])
    text = "".join(pieces)
    lead = _native_lead(serving.tokenizer_manager.tokenizer, text, stock_ids)
    if offsets[0] < lead:
        raise _Skip("cannot place the template's leading special tokens")
    return text[lead:], [o - lead for o in offsets]


def _native_lead(tokenizer: PreTrainedTokenizerBase, text: str, stock_ids: list[int]) -> int:
    """How many leading characters (a BOS rendered as text) the native path drops, after checking
    that the rest tokenizes to SGLang's ``stock_ids``; raises _Skip when it does not."""
    if tokenizer.encode(text, add_special_tokens=False) == stock_ids:
        specials = tokenizer.encode("", add_special_tokens=True)
        if specials and stock_ids[: len(specials)] == specials:
            lead = tokenizer.decode(specials)
            if not (text.startswith(lead)
                    and tokenizer.encode(text[len(lead):], add_special_tokens=True) == stock_ids):
                raise _Skip("cannot place the template's leading special tokens")
            return len(lead)
    elif tokenizer.encode(text, add_special_tokens=True) != stock_ids:
        raise _Skip("the re-rendered template does not match SGLang's prompt")
    return 0


def message_regions(text: str, processed: Sequence[dict]) -> list[tuple[int, int]]:
    """Where each message's text parts lie in the rendered ``text``, in order (as given, else stripped)."""
    regions, pos = [], 0
    for msg in processed:
        content = msg.get("content")
        parts = [content] if isinstance(content, str) else [
            part.get("text") for part in content or [] if isinstance(part, dict) and part.get("type") == "text"]
        for part in parts:
            for piece in (part, part.strip()) if isinstance(part, str) and part.strip() else ():
                at = text.find(piece, pos)
                if at >= 0:
                    regions.append((at, at + len(piece)))
                    pos = at + len(piece)
                    break
    return regions


def discovered_prompt(
    serving: OpenAIServingChat, request: ChatCompletionRequest, stock_ids: list[int], namespace: str | None,
) -> tuple[str, list[int]]:
    """The rendered prompt and the flat offsets of the documents found in it; raises _Skip."""
    rendered, processed = _render(serving, request, [m.model_dump() for m in request.messages])
    lead = _native_lead(serving.tokenizer_manager.tokenizer, rendered, stock_ids)
    text = rendered[lead:]
    regions = message_regions(text, processed)
    if not regions:
        raise _Skip("no message text found in the rendered template")
    boundaries = prompt_boundaries(serving.tokenizer_manager.tokenizer, text)
    if boundaries is None:
        raise _Skip("the tokenizer gives no character offsets")
    index = document_index(serving.tokenizer_manager)
    spans = discover_chunks(text, index, namespace, regions=regions, boundaries=boundaries,
                            max_chunks=CHUNKS.max_chunks)
    if index is not None:
        index.remember(namespace, [text[s:e] for s, e in spans])
    return text, [x for span in spans for x in span]


def mark_documents(serving: OpenAIServingChat, request: ChatCompletionRequest, adapted: GenerateReqInput,
                   requested_policy: str | None = None) -> bool:
    """Rewrite ``adapted`` to text + ``relaxkv_chunks`` when ``request`` reuses chunks and holds
    documents; whether it did. ``requested_policy``: the ``X-RelaxKV-Policy`` header (validated)."""
    if not chunk_tree_served(serving.tokenizer_manager.server_args):
        return False
    sp = adapted.sampling_params
    if not isinstance(sp, dict):
        return False
    cp = sp.get("custom_params")
    if cp is not None and not isinstance(cp, dict):
        return False  # the native path reports it
    cp = cp or {}
    if CHUNKS.name in cp:
        return False
    if not POLICY.reuses_chunks(cp.get(POLICY.name, requested_policy or server_settings().default_policy)):
        return False  # a malformed policy is reported by the native path
    parts = bool(document_parts(request.messages))
    if parts:
        check_documents(request.messages)
    try:
        if adapted.text is not None or not isinstance(adapted.input_ids, list) or not adapted.input_ids:
            raise _Skip("SGLang built this prompt as text (multimodal model)")
        if any(getattr(adapted, f, None) for f in ("image_data", "video_data", "audio_data")):
            raise _Skip("media content")
        if request.tools and request.tool_choice != "none":
            raise _Skip("tools")
        if serving.template_manager.chat_template_name is not None:
            raise _Skip(f"conversation template {serving.template_manager.chat_template_name!r}")
        if parts:
            text, offsets = marked_prompt(serving, request, list(adapted.input_ids))
        else:
            text, offsets = discovered_prompt(serving, request, list(adapted.input_ids), item_namespace(adapted))
    except _Skip as why:
        logger.info("relaxkv: chat documents served without chunk reuse: %s", why)
        return False
    if not offsets:
        return False  # nothing found: SGLang's own prompt
    adapted.text = text
    adapted.input_ids = None
    adapted.sampling_params = dict(sp, custom_params=dict(cp, **{CHUNKS.name: offsets}))
    return True


def around_convert_to_internal_request(
    original: Callable[..., Any], serving: OpenAIServingChat, request: ChatCompletionRequest,
    raw_request: Optional[Request] = None, *args: Any, **kwargs: Any,
) -> Any:
    """Hook on ``OpenAIServingChat._convert_to_internal_request``."""
    result = original(serving, request, raw_request, *args, **kwargs)
    adapted, _ = result
    mark_documents(serving, request, adapted, header_policy(getattr(raw_request, "headers", None)))
    return result


#: the SGLang functions this module wraps (registered by ``server/sglang/plugin.py``)
HOOKS = (
    Hook("sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"
         "._convert_to_internal_request",
         around_convert_to_internal_request, ("self", "request", "raw_request")),
)
