"""Marking documents in SGLang frontend programs (``@sgl.function``)::

    import sglang as sgl
    from relaxkv_sglang.lang import RelaxKVEndpoint, document

    @sgl.function
    def rag(s, docs, question):
        s += "You answer from the documents.\\n"
        for d in docs:
            s += document(d) + "\\n"
        s += "Question: " + question + "\\nAnswer:" + sgl.gen("answer", max_tokens=32)

    sgl.set_default_backend(RelaxKVEndpoint("http://127.0.0.1:30000", policy="pic"))
    state = rag.run(docs=[...], question="...")

:func:`document` puts the text between two Unicode *noncharacters* (U+FDD0, U+FDD1: reserved for a
program's internal use, never a character), which travel through everything the interpreter does with
text (``fork``, ``join``, roles, ``select``, ``run_batch``'s prefix tracing); :class:`RelaxKVEndpoint`
removes them from every ``/generate`` it sends and turns each marked span into a ``relaxkv_chunks`` pair
of the text sent. So ``state.text()`` keeps the marks (:func:`strip_marks`); another backend would send
them to the model as text (do not mix ``document()`` with it); a lone mark is dropped and marks nothing.
A ``/generate`` with documents also carries ``x-smg-routing-key`` (:mod:`relaxkv_sglang.request.routing`),
so behind the ``smg`` gateway programs sharing documents reach the replica holding their chunks; the
gateway takes one prompt per ``/generate`` (a list ``text``, ``select``'s, is its 422: use a replica).
"""

from __future__ import annotations

import json as _json
import types
import urllib.error
import urllib.request
from typing import Optional

import requests

from sglang.lang.backend import runtime_endpoint as _runtime_endpoint
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.utils import HttpResponse

from relaxkv_sglang.repair.policies import Policy
from relaxkv_sglang.request.routing import ROUTING_HEADER, routing_key, routing_key_of_documents
from relaxkv_sglang.request.schema import CHUNKS, POLICY

__all__ = ["DOC_START", "DOC_END", "document", "strip_marks", "split_marks", "RelaxKVEndpoint"]

DOC_START = "\ufdd0"
DOC_END = "\ufdd1"
_MARKS = str.maketrans("", "", DOC_START + DOC_END)


def document(text: str) -> str:
    """``text`` marked as one document chunk: a ``str``. ``TypeError`` for a non-string (which also ends
    ``run_batch``'s prefix tracing here, as SGLang expects), ``ValueError`` for an empty or marked text."""
    if not isinstance(text, str):
        raise TypeError(f"document() takes a str, got {type(text).__name__}")
    if not text:
        raise ValueError("document() needs a non-empty text")
    if DOC_START in text or DOC_END in text:
        raise ValueError("document() text must not contain U+FDD0 / U+FDD1 (the document marks)")
    return DOC_START + text + DOC_END


def strip_marks(text: str) -> str:
    """E.g. ``strip_marks(state.text())``."""
    return text.translate(_MARKS)


def split_marks(text: str) -> tuple[str, list[tuple[int, int]]]:
    """``(text without marks, the documents' spans in it)``; lone or nested marks and empty documents
    mark nothing."""
    if DOC_START not in text and DOC_END not in text:
        return text, []
    out: list[str] = []
    spans: list[tuple[int, int]] = []
    n = 0  # characters written so far
    start: Optional[int] = None
    pos = 0
    for i, ch in enumerate(text):
        if ch != DOC_START and ch != DOC_END:
            continue
        out.append(text[pos:i])
        n += i - pos
        pos = i + 1
        if ch == DOC_START:
            start = n  # a second start before an end restarts the document
        elif start is not None:
            if n > start:
                spans.append((start, n))
            start = None
    out.append(text[pos:])
    return "".join(out), spans


def mark_payload(data: dict, policy: Optional[str], custom_params: Optional[dict] = None) -> dict:
    """Marks turned into ``relaxkv_chunks``; a batch ``text`` (``select``'s) gets one ``sampling_params``
    per item. ``policy`` and ``custom_params`` are added to every text item without overriding the body's."""
    texts = data.get("text")
    if texts is None:
        return data
    single = isinstance(texts, str)
    items = [texts] if single else list(texts)
    split = [split_marks(t) if isinstance(t, str) else (t, []) for t in items]
    if policy is None and not custom_params and not any(spans for _, spans in split):
        if any(t != s for t, (s, _) in zip(items, split)):  # lone marks only
            data = dict(data, text=split[0][0] if single else [s for s, _ in split])
        return data
    sps = data.get("sampling_params")
    if isinstance(sps, list):
        sp_items = [dict(sp or {}) for sp in sps]
    else:
        sp_items = [dict(sps or {}) for _ in items]
    for sp, (_, spans) in zip(sp_items, split):
        cp = dict(custom_params or {}, **(sp.get("custom_params") or {}))
        if spans:
            cp[CHUNKS.name] = [x for span in spans for x in span]
        if policy is not None:
            cp.setdefault(POLICY.name, policy)
        if cp:
            sp["custom_params"] = cp
    out = dict(data)
    out["text"] = split[0][0] if single else [s for s, _ in split]
    out["sampling_params"] = sp_items[0] if single else sp_items
    return out


def payload_routing_key(data: dict) -> Optional[str]:
    """Of a body :func:`mark_payload` made; a batch: the MinHash of all items' documents. None without
    documents (``input_ids`` requests included)."""
    texts = data.get("text")
    if texts is None:
        return None
    items = [texts] if isinstance(texts, str) else list(texts)
    sps = data.get("sampling_params")
    sp_items = sps if isinstance(sps, list) else [sps] * len(items)
    docs: list[str] = []
    for text, sp in zip(items, sp_items):
        if not isinstance(text, str):
            continue
        offsets = ((sp or {}).get("custom_params") or {}).get(CHUNKS.name) if isinstance(sp, dict) else None
        if len(items) == 1:
            return routing_key(text, offsets)
        if isinstance(offsets, list) and len(offsets) % 2 == 0 and all(isinstance(v, int) for v in offsets):
            docs += [text[offsets[i]:offsets[i + 1]] for i in range(0, len(offsets), 2)]
    return routing_key_of_documents(docs)


def _http_request_with_headers(url, json=None, stream=False, api_key=None, verify=None, method=None, *,
                               headers: dict):
    """``sglang.utils.http_request`` (its two paths: requests when streaming, urllib otherwise),
    with extra ``headers``."""
    headers = {"Content-Type": "application/json; charset=utf-8", **headers}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    if stream:
        return requests.post(url, json=json, stream=True, headers=headers)
    req = urllib.request.Request(url, headers=headers, method=method)
    data = None if json is None else _json.dumps(json).encode("utf-8")
    try:
        return HttpResponse(urllib.request.urlopen(req, data=data, cafile=verify))
    except urllib.error.HTTPError as exc:
        return HttpResponse(exc)


def _rebind(fn: types.FunctionType, namespace: dict) -> types.FunctionType:
    new = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__doc__ = fn.__doc__
    new.__qualname__ = fn.__qualname__
    return new


# RuntimeEndpoint methods that post to the server (every one that sends text), run with their
# `http_request` as :meth:`RelaxKVEndpoint._http_request`.
_POSTING_METHODS = tuple(
    name
    for name, fn in vars(RuntimeEndpoint).items()
    if isinstance(fn, types.FunctionType) and name != "__init__" and fn.__closure__ is None
    and "http_request" in fn.__code__.co_names
)
# A release that adds a `/generate` call elsewhere must be looked at: fail at import, not send marks.
_EXPECTED = {"cache_prefix", "commit_lazy_operations", "fill_image", "generate", "generate_stream",
             "_generate_http_request", "concatenate_and_append"}
if not _EXPECTED <= set(_POSTING_METHODS):
    raise ImportError(
        f"relaxkv_sglang.lang: sglang's RuntimeEndpoint changed (posting methods {sorted(_POSTING_METHODS)}, "
        f"expected {sorted(_EXPECTED)}); written for sglang 0.5.23"
    )


class RelaxKVEndpoint(RuntimeEndpoint):
    """``sgl.RuntimeEndpoint`` sending :func:`document` marks as ``relaxkv_chunks``: every request goes out
    as the stock one's, but a ``/generate`` with ``text`` (``gen``, ``select``, ``fork``/``join`` commits,
    ``run_batch``'s prefix caching) loses its marks and gets ``custom_params`` ``{"relaxkv_chunks": [...],
    "relaxkv_policy": policy, **custom_params}``. ``policy`` None: the server default applies.
    ``routing``: send ``x-smg-routing-key`` (module doc)."""

    def __init__(
        self,
        base_url: str,
        policy: Optional[str] = Policy.PIC.value,
        custom_params: Optional[dict] = None,
        api_key: Optional[str] = None,
        verify: Optional[str] = None,
        chat_template_name: Optional[str] = None,
        routing: bool = True,
    ):
        if policy is not None and not POLICY.is_valid(policy):
            raise ValueError(f"policy must be one of {', '.join(POLICY.choices)} or None, got {policy!r}")
        self.policy = policy
        self.routing = routing
        if custom_params is not None and not isinstance(custom_params, dict):
            raise TypeError(f"custom_params must be a dict or None, got {type(custom_params).__name__}")
        self.custom_params = dict(custom_params or {})
        for key in (CHUNKS.name, POLICY.name):
            if key in self.custom_params:
                raise ValueError(f"custom_params must not hold {key} (use document() / policy=)")
        super().__init__(base_url, api_key=api_key, verify=verify, chat_template_name=chat_template_name)
        namespace = dict(vars(_runtime_endpoint), http_request=self._http_request)
        for name in _POSTING_METHODS:
            setattr(self, name, types.MethodType(_rebind(vars(RuntimeEndpoint)[name], namespace), self))

    def _http_request(self, url, json=None, **kwargs):
        if json is not None and url == self.base_url + "/generate":
            json = mark_payload(json, self.policy, self.custom_params)
            key = payload_routing_key(json) if self.routing else None
            if key:
                return _http_request_with_headers(url, json=json, headers={ROUTING_HEADER: key}, **kwargs)
        return _runtime_endpoint.http_request(url, json=json, **kwargs)
