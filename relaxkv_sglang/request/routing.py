"""Document-affine routing keys: a MinHash of a request's document set, for SGLang's gateway.

Behind the ``smg`` gateway (``serve --replicas``) a request carrying ``x-smg-routing-key`` goes to the
replica its key was first assigned to (:data:`relaxkv_sglang.server.cluster.ROUTINGS`), so requests
sharing documents share a replica (the key, and why: docs/scaling.md, "What a client sends"). The
documents are the spans the server chunks, found without its index (a client has none); no documents, no
key: the router assigns by load. Standard library only (clients import it)."""

from __future__ import annotations

import hashlib
import math
import threading
from typing import Any, Iterable, Mapping, Optional, Sequence

from relaxkv_sglang.request.doc_index import discover_chunks

__all__ = [
    "ROUTING_HEADER", "document_hash", "minhash", "routing_key", "routing_key_of_documents",
    "chat_documents", "chat_routing_key", "routing_headers", "jaccard", "HotKeySplitter",
    "prompt_documents", "add_routing_header", "body_routing_key",
]

ROUTING_HEADER = "x-smg-routing-key"  # the smg gateway reads it (--routing-key-headers; case-insensitive)
_DOC_PERSON = b"relaxkv-doc"  # BLAKE2b personalization: these hashes never equal another use's


def document_hash(text: str) -> int:
    """``h(d)`` of a chunk's text exactly as sent, in ``[0, 2**64)``; unlike ``hash()``, the same in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8, person=_DOC_PERSON).digest(), "big")


def _permute(doc_hash: int, seed: int) -> int:
    key = seed.to_bytes(8, "big", signed=False) if seed else b""
    return int.from_bytes(hashlib.blake2b(doc_hash.to_bytes(8, "big"), digest_size=8, key=key).digest(), "big")


def minhash(doc_hashes: Iterable[int], seed: int = 0) -> Optional[int]:
    """``min_{d} g_s(h(d))``, None for no hashes; clients of one cluster must agree on ``seed``."""
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    values = [_permute(h, seed) for h in set(doc_hashes)]
    return min(values) if values else None


def routing_key_of_documents(documents: Iterable[str], seed: int = 0) -> Optional[str]:
    """``"%016x"`` of the :func:`minhash`, or None without a non-empty document."""
    value = minhash((document_hash(d) for d in documents if d), seed)
    return None if value is None else f"{value:016x}"


def routing_key(text: str, offsets: Optional[Sequence[int]] = None, seed: int = 0) -> Optional[str]:
    """A ``/generate`` prompt's key; ``offsets``: its ``relaxkv_chunks`` (None: unmarked). None without
    documents, or for offsets the server will answer 400 to."""
    return routing_key_of_documents(prompt_documents(text, offsets), seed)


def prompt_documents(text: str, offsets: Optional[Sequence[int]] = None) -> list[str]:
    """``[]`` for offsets that are not int pairs inside ``text``."""
    if offsets is None:
        spans = discover_chunks(text, None, None)
    else:
        if len(offsets) % 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in offsets):
            return []
        spans = [(offsets[i], offsets[i + 1]) for i in range(0, len(offsets), 2)]
        if any(not 0 <= s < e <= len(text) for s, e in spans):
            return []
    return [text[s:e] for s, e in spans]


def _message_texts(message: Any) -> list[str]:
    content = message.get("content") if isinstance(message, Mapping) else None
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        return []
    return [p.get("text") for p in content
            if isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)]


def chat_documents(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """By :mod:`relaxkv_sglang.request.sglang.chat`'s rules: every text part of a list ``content`` but
    its last; without such parts (inline documents, as LangChain and LlamaIndex send them) the block
    rules over the messages' text, each message a region, as the server searches its rendered template."""
    docs: list[str] = []
    for message in messages:
        if isinstance(message, Mapping) and isinstance(message.get("content"), list):
            docs += [t for t in _message_texts(message)[:-1] if t]
    if docs:
        return docs
    # What lies between regions (template markup there, a blank line here) is never searched.
    text, regions = "", []
    for message in messages:
        for part in _message_texts(message):
            if part.strip():
                regions.append((len(text), len(text) + len(part)))
                text += part + "\n\n"
    return [text[s:e] for s, e in discover_chunks(text, None, None, regions=regions)]


def chat_routing_key(messages: Sequence[Mapping[str, Any]], seed: int = 0) -> Optional[str]:
    """None without documents. With the OpenAI Python client::

        key = chat_routing_key(messages)
        client.chat.completions.create(model=..., messages=messages,
                                       extra_headers={ROUTING_HEADER: key} if key else None,
                                       extra_body={"custom_params": {"relaxkv_policy": "pic"}})
    """
    return routing_key_of_documents(chat_documents(messages), seed)


def routing_headers(text: str, offsets: Optional[Sequence[int]] = None, seed: int = 0) -> dict[str, str]:
    """``{}`` without documents."""
    key = routing_key(text, offsets, seed)
    return {ROUTING_HEADER: key} if key else {}


def body_routing_key(body: Any, seed: int = 0) -> Optional[str]:
    """The key of a decoded JSON body: ``messages`` (chat), ``prompt`` (completions) or ``text``
    (``/generate``), with their ``relaxkv_chunks``; None for anything else, or without documents."""
    if not isinstance(body, Mapping):
        return None
    if isinstance(body.get("messages"), list):
        return chat_routing_key(body["messages"], seed)
    prompt, custom = body.get("prompt"), body.get("custom_params")
    if not isinstance(prompt, str):
        prompt, sp = body.get("text"), body.get("sampling_params")
        custom = sp.get("custom_params") if isinstance(sp, Mapping) else None
    if not isinstance(prompt, str):
        return None
    offsets = custom.get("relaxkv_chunks") if isinstance(custom, Mapping) else None
    return routing_key(prompt, offsets if isinstance(offsets, list) else None, seed)


def add_routing_header(request: Any) -> None:
    """An ``httpx`` event hook setting :data:`ROUTING_HEADER` from the body, for clients that build the
    messages themselves (OpenAI SDK, LangChain's ``ChatOpenAI``, LlamaIndex's ``OpenAILike``)::

        http_client=httpx.Client(event_hooks={"request": [add_routing_header]})
    """
    import json

    if ROUTING_HEADER in request.headers:
        return
    try:
        body = json.loads(request.content or b"null")
    except (ValueError, RuntimeError):  # not JSON, or a streamed body not read yet
        return
    key = body_routing_key(body)
    if key:
        request.headers[ROUTING_HEADER] = key


def jaccard(a: Iterable[Any], b: Iterable[Any]) -> float:
    """1.0 for two empty sets."""
    a, b = set(a), set(b)
    union = a | b
    return len(a & b) / len(union) if union else 1.0


class HotKeySplitter:
    """Spreads a hot key over replicas: the gateway balances keys, not their traffic, so a document set
    over ``1/N`` of it overloads its replica. A key with share ``p`` of the last ``window`` requests gets
    ``r = min(N, ceil(p · N / max_load))`` sub-keys ``key/j`` (``j`` uniform), one replica carrying about
    ``max_load`` times the mean load of it, at ``r`` misses instead of one. Thread-safe."""

    def __init__(self, replicas: int, window: int = 1000, max_load: float = 0.5, seed: Optional[int] = None) -> None:
        import random
        from collections import Counter, deque

        if replicas < 1 or window < 1 or max_load <= 0:
            raise ValueError(f"need replicas >= 1, window >= 1, max_load > 0; got {replicas}, {window}, {max_load}")
        self.replicas, self.window, self.max_load = replicas, window, max_load
        self._recent: deque[str] = deque()
        self._counts: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def splits(self, key: str) -> int:
        """``r`` now (1 for a key not in the window)."""
        share = self._counts[key] / max(1, len(self._recent))
        return max(1, min(self.replicas, math.ceil(share * self.replicas / self.max_load)))

    def key(self, documents: Iterable[str]) -> Optional[str]:
        """Records the request."""
        hashes = {document_hash(d) for d in documents if d}
        if not hashes:
            return None
        with self._lock:
            return self._record_and_split(f"{minhash(hashes):016x}")

    def _record_and_split(self, base: str) -> str:
        """Under the lock."""
        self._recent.append(base)
        self._counts[base] += 1
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]
        r = self.splits(base)
        return base if r == 1 else f"{base}/{self._rng.randrange(r)}"
