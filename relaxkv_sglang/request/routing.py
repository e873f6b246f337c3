"""Document-affine routing keys: a MinHash of a request's document set, for SGLang's gateway.

Behind the ``smg`` gateway as ``serve --replicas`` starts it, every request carrying the header
``x-smg-routing-key`` goes to the replica its key was first assigned to (sticky; a new key takes
the gateway's next round-robin turn, :data:`relaxkv_sglang.server.cluster.ROUTINGS`). The key
computed here makes requests that share their documents share a replica, so a document's chunks
are computed once per cluster instead of once per replica, whatever the documents' order, system
prompt or question.

The maths. Each document ``d`` (a chunk's text, UTF-8) gets a 64-bit content hash
``h(d) = BLAKE2b-64(d)``, the same in every process and on every machine (no Python ``hash()``,
whose strings are salted per process). A request ``A`` (its set of documents) gets the key

    key(A) = min_{d in A} g_s(h(d)),     g_s(x) = BLAKE2b-64(x, key = s)

with ``g_s`` a seeded hash of the document hash (seed ``s``, default 0): a fixed pseudo-random
permutation of documents. For two requests ``A`` and ``B`` the smallest ``g_s`` over ``A ∪ B``
belongs to one document, uniformly at random among the ``|A ∪ B|``; the two keys are equal exactly
when that document is in both sets (collisions of the 64-bit values aside, ~2⁻⁶⁴), so over the
seed

    P[key(A) = key(B)] = |A ∩ B| / |A ∪ B| = J(A, B),

the Jaccard similarity of the document sets (Broder's min-wise hashing). Two requests with the same
documents in any order share the key surely; one differing document out of five shares it with
probability 4/6. The key names one document of the request (the one with the smallest ``g_s``),
so every request routed under it finds at least that document's chunk cached on its replica.

Which documents: the same spans the server chunks. A request with ``relaxkv_chunks`` offsets
``[s0, e0, s1, e1, ...]`` has the documents ``text[s_i:e_i]``; an unmarked prompt has the
documents the server's block rules find in it (:func:`relaxkv_sglang.request.doc_index.discover_chunks`
without the server's index of documents seen before, which a client does not have: a document the
server finds only through that index, one with no structure around it, is not in the key); a chat
request has the documents :mod:`relaxkv_sglang.request.sglang.chat` finds: its document parts (every text
part of a list ``content`` but its last) or, when it has none, the documents the same block rules
find in its messages' text, each message's content a region (documents inline in string content,
as LangChain and LlamaIndex send them; :func:`chat_documents`). A request without documents gets
no key (:func:`routing_key` returns None): the router then assigns it by load alone.
:func:`add_routing_header` sets the header on an ``httpx`` request of an OpenAI-compatible client
(an event hook), so frameworks that build the messages themselves send the key unchanged.

Standard library only; no SGLang, no torch (clients import it).
"""

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
    """``h(d)``: the 64-bit BLAKE2b hash of a document's UTF-8 text, stable across processes.

    Args:
        text: the document (a chunk's text exactly as sent).

    Returns:
        An int in ``[0, 2**64)``.
    """
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8, person=_DOC_PERSON).digest(), "big")


def _permute(doc_hash: int, seed: int) -> int:
    """``g_s(x)``: the seeded 64-bit hash of a document hash (a pseudo-random permutation per seed)."""
    key = seed.to_bytes(8, "big", signed=False) if seed else b""
    return int.from_bytes(hashlib.blake2b(doc_hash.to_bytes(8, "big"), digest_size=8, key=key).digest(), "big")


def minhash(doc_hashes: Iterable[int], seed: int = 0) -> Optional[int]:
    """``min_{d} g_s(h(d))`` over a set of document hashes; None for an empty set.

    Args:
        doc_hashes: ``h(d)`` of each document (ints in ``[0, 2**64)``; duplicates do not matter).
        seed: ``s``, which permutation (``0 <= s < 2**64``); clients of one cluster must agree on it.

    Returns:
        The smallest permuted hash (an int in ``[0, 2**64)``), or None.
    """
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    values = [_permute(h, seed) for h in set(doc_hashes)]
    return min(values) if values else None


def routing_key_of_documents(documents: Iterable[str], seed: int = 0) -> Optional[str]:
    """The routing key of a set of documents: :func:`minhash` of their :func:`document_hash`, as 16 hex digits.

    Args:
        documents: the documents' texts (order and repeats do not matter).
        seed: the MinHash seed.

    Returns:
        ``"%016x"`` of the MinHash, or None when there is no non-empty document.
    """
    value = minhash((document_hash(d) for d in documents if d), seed)
    return None if value is None else f"{value:016x}"


def routing_key(text: str, offsets: Optional[Sequence[int]] = None, seed: int = 0) -> Optional[str]:
    """The routing key of a ``/generate`` prompt: its documents as the server chunks them.

    Args:
        text: the prompt.
        offsets: its ``relaxkv_chunks`` value (flat ``[s0, e0, s1, e1, ...]``), or None for an
            unmarked prompt (then the documents the server's block rules find, module doc).
        seed: the MinHash seed.

    Returns:
        The key, or None without documents (or with offsets that are not int pairs inside
        ``text``: the server will answer 400, and the key does not matter).
    """
    return routing_key_of_documents(prompt_documents(text, offsets), seed)


def prompt_documents(text: str, offsets: Optional[Sequence[int]] = None) -> list[str]:
    """The documents of a ``/generate`` prompt as the server chunks them (see :func:`routing_key`);
    ``[]`` for offsets that are not int pairs inside ``text``."""
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
    """A chat message's text: its string ``content``, or the text parts of a list ``content``."""
    content = message.get("content") if isinstance(message, Mapping) else None
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        return []
    return [p.get("text") for p in content
            if isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)]


def chat_documents(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The documents of an OpenAI chat request, by :mod:`relaxkv_sglang.request.sglang.chat`'s rules.

    In a message whose ``content`` is a list of parts, every text part but the message's last
    text part is a document. A request with no such part (the documents inline in string content,
    as LangChain and LlamaIndex send them) has the documents the server discovers in it: the block
    rules over its messages' text, each message's string content (or text part) a region, as the
    server searches the rendered chat template (:func:`~relaxkv_sglang.request.doc_index.discover_chunks`
    without token boundaries or the index, as for an unmarked prompt: module doc).

    Args:
        messages: the ``messages`` list of ``/v1/chat/completions``.

    Returns:
        The documents' texts, in order.
    """
    docs: list[str] = []
    for message in messages:
        if isinstance(message, Mapping) and isinstance(message.get("content"), list):
            docs += [t for t in _message_texts(message)[:-1] if t]
    if docs:
        return docs
    # Discovery: the regions' text joined; what lies between regions (the template's markup on the
    # server, a blank line here) is never searched, so the blocks found are the server's.
    text, regions = "", []
    for message in messages:
        for part in _message_texts(message):
            if part.strip():
                regions.append((len(text), len(text) + len(part)))
                text += part + "\n\n"
    return [text[s:e] for s, e in discover_chunks(text, None, None, regions=regions)]


def chat_routing_key(messages: Sequence[Mapping[str, Any]], seed: int = 0) -> Optional[str]:
    """The routing key of an OpenAI chat request (None without documents).

    With the OpenAI Python client::

        key = chat_routing_key(messages)
        client.chat.completions.create(model=..., messages=messages,
                                       extra_headers={ROUTING_HEADER: key} if key else None,
                                       extra_body={"custom_params": {"relaxkv_policy": "pic"}})
    """
    return routing_key_of_documents(chat_documents(messages), seed)


def routing_headers(text: str, offsets: Optional[Sequence[int]] = None, seed: int = 0) -> dict[str, str]:
    """``{ROUTING_HEADER: key}`` for a ``/generate`` prompt, or ``{}`` when it has no documents."""
    key = routing_key(text, offsets, seed)
    return {ROUTING_HEADER: key} if key else {}


def body_routing_key(body: Any, seed: int = 0) -> Optional[str]:
    """The routing key of a request body of the OpenAI routes or ``/generate`` (a decoded JSON
    object): ``messages`` (chat), ``prompt`` (completions, with ``custom_params.relaxkv_chunks``
    if given) or ``text`` (``/generate``, with ``sampling_params.custom_params.relaxkv_chunks``);
    None for anything else, or without documents."""
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
    """An ``httpx`` request event hook: set :data:`ROUTING_HEADER` from the JSON body's documents
    (:func:`body_routing_key`), unless the request sets it already or has none. With the clients
    that take an ``http_client`` (the OpenAI SDK, LangChain's ``ChatOpenAI``, LlamaIndex's
    ``OpenAILike``)::

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
    """``|A ∩ B| / |A ∪ B|`` of two sets (1.0 for two empty sets)."""
    a, b = set(a), set(b)
    union = a | b
    return len(a & b) / len(union) if union else 1.0


class HotKeySplitter:
    """Client-side load-aware fallback: spread a hot routing key over several replicas.

    A sticky key sends all of its requests to one replica, so a document set more popular than
    ``1/N`` of the traffic overloads its replica (the gateway balances *keys*, not their traffic).
    This splitter keeps the base keys of the last ``w = min(window, requests seen)`` requests; a key
    with ``c`` of them has the share ``p = c / w`` and is split into

        r = min(N, ceil(p · N / max_load))

    sub-keys ``key/j``, ``j`` uniform in ``[0, r)`` per request, so one replica carries about
    ``max_load`` times the mean load of it. The price: a split key's documents are computed and
    cached on ``r`` replicas (``r`` misses each instead of one, small against a hot key's traffic).

    Thread-safe (one lock around :meth:`key`), so client threads may share one. ``N`` is the
    number of replicas behind the router.
    """

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
        """``r``: the sub-keys ``key`` is spread over now (1 for a key not seen in the window)."""
        share = self._counts[key] / max(1, len(self._recent))
        return max(1, min(self.replicas, math.ceil(share * self.replicas / self.max_load)))

    def key(self, documents: Iterable[str]) -> Optional[str]:
        """The (possibly split) routing key of a request's documents; records the request."""
        hashes = {document_hash(d) for d in documents if d}
        if not hashes:
            return None
        with self._lock:
            return self._record_and_split(f"{minhash(hashes):016x}")

    def _record_and_split(self, base: str) -> str:
        """Count ``base`` in the window and pick its sub-key (under the lock)."""
        self._recent.append(base)
        self._counts[base] += 1
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]
        r = self.splits(base)
        return base if r == 1 else f"{base}/{self._rng.randrange(r)}"
