"""A small client of the server's HTTP API with the project's request fields.

Used by the demo, the benchmarks and the end-to-end tests, so they all speak
to the server the same way any other client would: ``/generate``,
``/flush_cache`` and ``/get_server_info``.
"""

from __future__ import annotations

import json
import time

import requests

from relaxkv_sglang.schema import ANCHOR_RATIO, BUDGET, CHUNKS, CONTEXT_RATIO, POLICY


class ServerClient:
    def __init__(self, url: str, timeout: float = 600):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.session = requests.Session()

    def generate(self, text: str, offsets: list[int] | None = None, policy: str | None = None, *,
                 max_new_tokens: int = 16, anchor_ratio: float | None = None, context_ratio: float | None = None,
                 budget: float | None = None,
                 stop=None, top_logprobs: int = 0, token_ids_logprob: list[int] | None = None,
                 return_logprob: bool = False, **extra) -> dict:
        """POST /generate, greedy; ``client_latency_s`` is added to the response."""
        body = self._body(text, offsets, policy, max_new_tokens=max_new_tokens, anchor_ratio=anchor_ratio,
                          context_ratio=context_ratio, budget=budget, stop=stop, top_logprobs=top_logprobs,
                          token_ids_logprob=token_ids_logprob, return_logprob=return_logprob, **extra)
        start = time.perf_counter()
        response = self.session.post(self.url + "/generate", json=body, timeout=self.timeout)
        elapsed = time.perf_counter() - start
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        out = response.json()
        out["client_latency_s"] = elapsed
        return out

    def generate_stream(self, text: str, offsets: list[int] | None = None, policy: str | None = None, *,
                        max_new_tokens: int = 16, **extra) -> dict:
        """Streamed /generate: the final response plus ``ttft_s`` (first streamed event) and ``latency_s``."""
        body = self._body(text, offsets, policy, max_new_tokens=max_new_tokens, **extra)
        body["stream"] = True
        start = time.perf_counter()
        ttft, last = None, None
        with self.session.post(self.url + "/generate", json=body, timeout=self.timeout, stream=True) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
            for line in response.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - start
                last = json.loads(line[len(b"data: "):])
        if last is None or "error" in last:
            raise RuntimeError(f"stream ended without a result: {last}")
        last["ttft_s"], last["latency_s"] = ttft, time.perf_counter() - start
        return last

    @staticmethod
    def _body(text, offsets, policy, *, max_new_tokens, anchor_ratio=None, context_ratio=None, budget=None,
              stop=None, top_logprobs=0, token_ids_logprob=None, return_logprob=False, **extra) -> dict:
        fields = ((POLICY, policy), (CHUNKS, offsets), (ANCHOR_RATIO, anchor_ratio), (CONTEXT_RATIO, context_ratio),
                  (BUDGET, budget))
        custom = {field.name: value for field, value in fields if value is not None}
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
