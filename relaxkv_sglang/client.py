"""A small client of the server's HTTP API with the project's request fields.

Used by the demo, the benchmarks and the end-to-end tests, so they all speak
to the server the same way any other client would: ``/generate``,
``/flush_cache`` and ``/get_server_info``.

Every ``/generate`` with documents carries the header ``x-smg-routing-key``, the MinHash of its
documents (:mod:`relaxkv_sglang.request.routing`), so behind the ``smg`` gateway's document routing
(``relaxkv-sglang serve --replicas N``) requests sharing their documents reach the same replica; a
single server ignores it. The gateway forwards ``/generate`` with its ``custom_params``, so one
client speaks to a server and to a cluster alike. ``routing=False``
sends none; ``splitter=HotKeySplitter(N)`` spreads hot keys over several of ``N`` replicas.
"""

from __future__ import annotations

import json
import time
from typing import Iterator

import requests

from relaxkv_sglang.request.routing import ROUTING_HEADER, HotKeySplitter, prompt_documents, routing_key_of_documents
from relaxkv_sglang.request.schema import ANCHOR_RATIO, BUDGET, CHUNKS, CONTEXT_RATIO, POLICY, QUALITY


def custom_params(policy: str | None = None, offsets: list[int] | None = None, *, anchor_ratio: float | None = None,
                  context_ratio: float | None = None, budget: float | str | None = None,
                  quality: float | str | None = None) -> dict:
    """The request's relaxkv fields as ``custom_params`` carries them (``request/schema.py``), unset ones out."""
    fields = ((POLICY, policy), (CHUNKS, offsets), (ANCHOR_RATIO, anchor_ratio), (CONTEXT_RATIO, context_ratio),
              (BUDGET, budget), (QUALITY, quality))
    return {field.name: value for field, value in fields if value is not None}


class ServerClient:
    def __init__(self, url: str, timeout: float = 600, *, routing: bool = True,
                 splitter: HotKeySplitter | None = None):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.routing = routing  # send the document routing key (x-smg-routing-key)
        self.splitter = splitter  # the load-aware fallback: hot keys spread over several replicas
        self.session = requests.Session()

    def generate(self, text: str, offsets: list[int] | None = None, policy: str | None = None, *,
                 max_new_tokens: int = 16, anchor_ratio: float | None = None, context_ratio: float | None = None,
                 budget: float | str | None = None, quality: str | float | None = None,
                 stop=None, top_logprobs: int = 0, token_ids_logprob: list[int] | None = None,
                 return_logprob: bool = False, **extra) -> dict:
        """POST /generate, greedy; ``client_latency_s`` is added to the response. ``budget`` may be
        ``"auto"`` (then ``quality``: a level or a target KL)."""
        body = self._body(text, offsets, policy, max_new_tokens=max_new_tokens, anchor_ratio=anchor_ratio,
                          context_ratio=context_ratio, budget=budget, quality=quality, stop=stop,
                          top_logprobs=top_logprobs, token_ids_logprob=token_ids_logprob,
                          return_logprob=return_logprob, **extra)
        out, elapsed = self._post_json("/generate", body, text, offsets)
        out["client_latency_s"] = elapsed
        return out

    def _stream_events(self, path: str, body: dict, text: str, offsets: list[int] | None) -> Iterator[dict]:
        """POST a streamed ``body`` to ``path`` with the routing header; yield each ``data:`` event's JSON."""
        with self.session.post(self.url + path, json=body, timeout=self.timeout, stream=True,
                               headers=self.headers(text, offsets)) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
            for line in response.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    yield json.loads(line[len(b"data: "):])

    def _post_json(self, path: str, body: dict, text: str, offsets: list[int] | None) -> tuple[dict, float]:
        """POST ``body`` to ``path`` with the routing header: (the JSON answer, seconds); non-200 raises."""
        start = time.perf_counter()
        response = self.session.post(self.url + path, json=body, timeout=self.timeout,
                                     headers=self.headers(text, offsets))
        elapsed = time.perf_counter() - start
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        return response.json(), elapsed

    def generate_stream(self, text: str, offsets: list[int] | None = None, policy: str | None = None, *,
                        max_new_tokens: int = 16, **extra) -> dict:
        """Streamed /generate: the final response plus ``ttft_s`` (first streamed event) and ``latency_s``."""
        body = self._body(text, offsets, policy, max_new_tokens=max_new_tokens, **extra)
        body["stream"] = True
        start = time.perf_counter()
        ttft, last = None, None
        for last in self._stream_events("/generate", body, text, offsets):
            if ttft is None:
                ttft = time.perf_counter() - start
        if last is None or "error" in last:
            raise RuntimeError(f"stream ended without a result: {last}")
        last["ttft_s"], last["latency_s"] = ttft, time.perf_counter() - start
        return last

    def headers(self, text: str, offsets: list[int] | None) -> dict[str, str]:
        """The routing header of a prompt (``{}`` without documents or with ``routing=False``)."""
        if not self.routing or not isinstance(text, str):
            return {}
        docs = prompt_documents(text, offsets)
        key = self.splitter.key(docs) if self.splitter is not None else routing_key_of_documents(docs)
        return {ROUTING_HEADER: key} if key else {}

    @staticmethod
    def _body(text, offsets, policy, *, max_new_tokens, anchor_ratio=None, context_ratio=None, budget=None,
              quality=None, stop=None, top_logprobs=0, token_ids_logprob=None, return_logprob=False, **extra) -> dict:
        custom = custom_params(policy, offsets, anchor_ratio=anchor_ratio, context_ratio=context_ratio, budget=budget,
                               quality=quality)
        sampling = {"max_new_tokens": max_new_tokens, "temperature": 0}
        if custom:
            sampling["custom_params"] = custom
        if stop is not None:
            sampling["stop"] = stop
        body = {"text": text, "sampling_params": sampling, **extra}
        if top_logprobs or token_ids_logprob or return_logprob:
            body.update(return_logprob=True, top_logprobs_num=top_logprobs)
            if token_ids_logprob:
                body["token_ids_logprob"] = token_ids_logprob
        return body

    def flush(self, wait_s: float = 60) -> None:
        """Empty the server's caches; SGLang waits up to ``wait_s`` for running requests to end."""
        response = self.session.post(self.url + "/flush_cache", params={"timeout": wait_s}, timeout=wait_s + 30)
        if response.status_code != 200:
            raise RuntimeError(f"the server refused to flush its cache: {response.text.strip()[:200]}")

    def relaxkv_state(self) -> dict:
        """The plugin's counters from /get_server_info ({} on a stock server)."""
        info = self.session.get(self.url + "/get_server_info", timeout=60).json()
        return info["internal_states"][0].get("relaxkv", {})

    def calibration(self) -> dict | None:
        """The repair calibration the server runs with (``relaxkv.calibration`` of /get_server_info:
        ``file``, ``model``, ``version``, ``knobs``; ``file`` None: the code defaults), or None from a
        stock server or one from before calibrations."""
        return self.relaxkv_state().get("calibration")
