"""``bench_cache_hit --frameworks``: the RAG trace sent through each framework's prompt shape, unmarked.

The same trace as :mod:`benchmarks.bench_cache_hit` (:func:`benchmarks.replay.make_trace`: Zipf
document popularity, k documents per request in random order) is sent over the OpenAI-compatible
routes in the prompt shapes RAG frameworks write (:data:`SHAPES`), none of which marks a document,
so the server's chunk discovery (docs/api.md section 2) is all that reuses them:

* ``langchain-chat``: LangChain's RAG tutorial chain, a ``ChatPromptTemplate`` whose system message
  is the instruction then ``{context}`` (the documents' ``page_content`` joined by blank lines), the
  question as the human turn; rendered by ``langchain_core`` and converted to the request's
  messages by ``langchain_openai`` (what ``ChatOpenAI`` sends).
* ``llamaindex-chat`` / ``llamaindex-completion``: LlamaIndex's response synthesizer (``compact``)
  with its default text-QA template, ``CHAT_TEXT_QA_PROMPT`` for a chat model and
  ``DEFAULT_TEXT_QA_PROMPT`` for a completion model (``OpenAILike(is_chat_model=...)``); each node
  rendered by ``llama_index.core`` with its ``file_path:`` metadata line (``MetadataMode.LLM``), the
  nodes joined by blank lines as ``PromptHelper.repack`` joins them when they fit the window.
* ``openai-sdk``: the OpenAI SDK with the trace's system prompt, and one user message holding every
  document as a ``[n]`` list, then the question.

Beside them ``content-parts`` sends the same trace marked (docs/api.md section 3: one text part per
document, the question as the last part). The server (default policy ``pic``, so no client names
a policy, and ``--enable-cache-report``) is flushed before each shape, and each shape sends its own
``cache_salt`` (a fresh chunk namespace: the HTTP process's document index keeps the documents an
earlier shape planned, which would otherwise help a later one). Per shape: the hit rate the server
reports (``usage.prompt_tokens_details.cached_tokens`` over ``usage.prompt_tokens``), the shape's
best possible (every document token after the document's first appearance, over that shape's prompt
tokens), their ratio, and the difference to ``content-parts`` in points. Requests are sent in trace
order by ``--clients`` threads (:func:`benchmarks.replay.replay_in_order`).

    python -m benchmarks.bench_cache_hit --frameworks --model tiny-llama --max-total-tokens 32768
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

from tqdm import tqdm

from benchmarks import common, metrics, tables
from benchmarks.replay import (ReplayError, TraceRequest, document_tokens, make_trace, replay_in_order,
                               trace_workload, trace_words)
# LangChain's tutorial instruction, a LlamaIndex node's file path and the OpenAI-SDK document listing, shared
# with the quality benchmark's langchain, llamaindex and numbered prompt formats.
from benchmarks.prompt_formats import LANGCHAIN_SYSTEM, llamaindex_file_path, numbered_parts

DONE_WITHIN_POINTS = 5.0  # issue 33: every framework shape within 5 points of the content-parts hit rate


def question_of(req: TraceRequest) -> str:
    """The trace request's bare question (its block is ``Question: ...\\nAnswer:``)."""
    return req.question.removeprefix("Question: ").removesuffix("\nAnswer:").strip()


def langchain_chat(req: TraceRequest) -> tuple[str, dict]:
    """LangChain: ``ChatPromptTemplate([("system", ... {context}), ("human", "{input}")])`` as ``ChatOpenAI`` sends it."""
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai.chat_models.base import _convert_message_to_dict

    prompt = ChatPromptTemplate.from_messages([("system", LANGCHAIN_SYSTEM + "\n\n{context}"), ("human", "{input}")])
    docs = [Document(page_content=d) for d in req.documents]
    messages = prompt.format_messages(context="\n\n".join(d.page_content for d in docs), input=question_of(req))
    return "chat", {"messages": [_convert_message_to_dict(m) for m in messages]}


def llamaindex_context(req: TraceRequest) -> str:
    """The nodes as LlamaIndex's ``compact`` synthesizer packs them: each with its metadata, blank lines between."""
    from llama_index.core.schema import MetadataMode, TextNode

    nodes = [TextNode(text=d, metadata={"file_path": llamaindex_file_path(d)}) for d in req.documents]
    chunks = [n.get_content(metadata_mode=MetadataMode.LLM) for n in nodes]
    return "\n\n".join(c.strip() for c in chunks if c.strip())


def llamaindex_chat(req: TraceRequest) -> tuple[str, dict]:
    """LlamaIndex, a chat model: ``CHAT_TEXT_QA_PROMPT`` (its system message, the template as the user turn)."""
    from llama_index.core.prompts.chat_prompts import CHAT_TEXT_QA_PROMPT

    messages = CHAT_TEXT_QA_PROMPT.format_messages(context_str=llamaindex_context(req), query_str=question_of(req))
    return "chat", {"messages": [{"role": m.role.value, "content": m.content} for m in messages]}


def llamaindex_completion(req: TraceRequest) -> tuple[str, dict]:
    """LlamaIndex, a completion model: ``DEFAULT_TEXT_QA_PROMPT`` as the prompt."""
    from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT

    return "completion", {"prompt": DEFAULT_TEXT_QA_PROMPT.format(context_str=llamaindex_context(req),
                                                                  query_str=question_of(req))}


def openai_sdk(req: TraceRequest) -> tuple[str, dict]:
    """The OpenAI SDK: the system prompt, then one user string with the documents as a ``[n]`` list and the question."""
    user = "".join(text for text, _ in numbered_parts(req.documents, f"Question: {question_of(req)}"))
    return "chat", {"messages": [{"role": "system", "content": req.system}, {"role": "user", "content": user}]}


def content_parts(req: TraceRequest) -> tuple[str, dict]:
    """The marked reference: one text part per document, the question as the last part (docs/api.md section 3)."""
    parts = [{"type": "text", "text": d} for d in req.documents] + [{"type": "text", "text": question_of(req)}]
    return "chat", {"messages": [{"role": "system", "content": req.system}, {"role": "user", "content": parts}]}


SHAPES: dict[str, Callable[[TraceRequest], tuple[str, dict]]] = {
    "content-parts": content_parts, "langchain-chat": langchain_chat, "llamaindex-chat": llamaindex_chat,
    "llamaindex-completion": llamaindex_completion, "openai-sdk": openai_sdk,
}
ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def replay_shape(client, model: str, trace: list[TraceRequest], shape: str, args: argparse.Namespace,
                 routed: bool = False) -> dict:
    """Send the trace in one shape on a flushed cache under a fresh ``cache_salt``; the shape's sums.

    ``routed``: each request carries the routing key of the documents in its body, as
    :func:`relaxkv_sglang.request.routing.add_routing_header` sets it on an unchanged framework's HTTP
    client (the gateway's document routing)."""
    from relaxkv_sglang.request.routing import ROUTING_HEADER, body_routing_key

    client.flush()
    salt = f"{shape}-{os.urandom(4).hex()}"
    bodies = [SHAPES[shape](req) for req in trace]
    keys = [body_routing_key(body) if routed else None for _, body in bodies]

    def one(i: int, _client: int, sent_at: float) -> dict:
        route, body = bodies[i]
        body = {**body, "model": model, "max_tokens": args.max_new_tokens, "temperature": 0, "cache_salt": salt}
        headers = {ROUTING_HEADER: keys[i]} if keys[i] else None
        start = time.perf_counter()
        response = client.session.post(client.url + ROUTES[route], json=body, timeout=client.timeout, headers=headers)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        usage = response.json()["usage"]
        details = usage.get("prompt_tokens_details") or {}
        if "cached_tokens" not in details:
            raise RuntimeError("no usage.prompt_tokens_details.cached_tokens: start the server with --enable-cache-report")
        return {"prompt_tokens": usage["prompt_tokens"], "cached_tokens": details["cached_tokens"],
                "latency_s": time.perf_counter() - start, "sent_at": sent_at}

    with tqdm(total=len(trace), desc=f"bench_cache_hit {shape}", unit="req") as bar:
        records, wall = replay_in_order(one, len(trace), args.clients, on_done=lambda i, r: bar.update())
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    return {"shape": shape, "route": bodies[0][0], "requests": len(records), "prompt_tokens": prompt,
            "routing_keys": len({k for k in keys if k}), "requests_per_s": len(records) / wall,
            "total_cached_tokens": cached, "cache_hit_rate_pct": 100.0 * metrics.hit_rate(cached, prompt),
            "latency_mean_s": statistics.mean(r["latency_s"] for r in records), "wall_s": wall,
            "per_request": records}


def server_model(client) -> str:
    """The model id the server lists (``GET /v1/models``), as a framework user configures it."""
    return client.session.get(client.url + "/v1/models", timeout=60).json()["data"][0]["id"]


def run_frameworks(args: argparse.Namespace) -> dict:
    """Every shape of :data:`SHAPES` over one trace against one server (default policy ``pic``)."""
    trace = make_trace(args)
    tokenizer = common.tokenizer(args)
    doc_tokens = document_tokens(trace, tokenizer)
    reusable = metrics.reusable_tokens([(i, doc_tokens[i]) for i in req.doc_ids] for req in trace)
    with common.bench_client(args, "bench_cache_hit", policy="pic", extra_args=["--enable-cache-report"]) as client:
        model = server_model(client)
        try:
            rows = [replay_shape(client, model, trace, shape, args) for shape in args.shapes]
        except ReplayError as exc:
            raise RuntimeError(f"a request failed: {exc}") from exc
    reference = next((r for r in rows if r["shape"] == "content-parts"), None)
    for row in rows:
        row["reusable_document_tokens"] = reusable
        row["best_possible_hit_rate_pct"] = 100.0 * metrics.hit_rate(reusable, row["prompt_tokens"])
        row["share_of_best_pct"] = 100.0 * row["cache_hit_rate_pct"] / row["best_possible_hit_rate_pct"]
        if reference is not None:
            row["vs_content_parts_points"] = row["cache_hit_rate_pct"] - reference["cache_hit_rate_pct"]
            row["share_vs_content_parts_points"] = row["share_of_best_pct"] - reference["share_of_best_pct"]
            row["within_5_points"] = abs(row["vs_content_parts_points"]) <= DONE_WITHIN_POINTS
    return {"mode": "frameworks",
            "workload": {**trace_workload(args), "kv_pool_tokens": None if args.url else args.max_total_tokens,
                         "distinct_document_tokens": sum(doc_tokens.values()), "server_policy": "pic"},
            "results": rows}


def framework_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    """The table's header and rows (shared by the text and the Markdown rendering)."""
    heads = ["shape", "route", "hit rate", "best", "hit/best", "vs parts", "hit/best vs parts", "latency s"]
    rows = []
    for r in result["results"]:
        points = [common.fmt(r.get(k), "+.1f") for k in ("vs_content_parts_points", "share_vs_content_parts_points")]
        rows.append([r["shape"], r["route"], f"{r['cache_hit_rate_pct']:.1f}%", f"{r['best_possible_hit_rate_pct']:.1f}%",
                     f"{r['share_of_best_pct']:.1f}%"] + points + [f"{r['latency_mean_s']:.2f}"])
    return heads, rows


def print_frameworks(result: dict) -> None:
    """The text table, then the same as Markdown (for docs/performance.md)."""
    w = result["workload"]
    pool = f"KV pool {w['kv_pool_tokens']} tokens" if w.get("kv_pool_tokens") else "KV pool of the given server"
    print(f"\n{w['requests']} requests, {w['clients']} clients, {trace_words(w)}; {w['distinct_document_tokens']} "
          f"distinct document tokens, {pool}; server default policy pic, no request names one")
    heads, rows = framework_rows(result)
    columns = [tables.left(heads[0], 22), tables.left(heads[1], 11)] + [tables.right(h, len(h) + 2) for h in heads[2:]]
    tables.print_text_table(columns, rows)
    print("vs parts = hit rate - content-parts' hit rate (points); done when within "
          f"{DONE_WITHIN_POINTS:g} points for every shape\n")
    print("\n".join(tables.markdown_table(heads, rows)))
