"""The RAG trace of the cache benchmarks, and the one replay the demo and every benchmark use.

The trace (:func:`make_trace`): a pool of documents (HotpotQA or SQuAD paragraphs) whose
popularity follows a Zipf law with exponent ``s``; each request takes ``k`` distinct documents
in random order after one of a few system prompts, then a question; with ``--topics T`` the
pool is cut into topics and a request's documents all come from one. Everything is seeded.

The replay (:func:`replay_in_order`): ``clients`` threads pull request indices from one shared
queue, so requests start in trace order (what every reuse bound assumes) and each client has
at most one request in flight; the first failure stops the clients and is raised as
:class:`ReplayError`. :func:`replay` sends a trace that way over HTTP under one policy on a
flushed cache and sums what SGLang reports into the policy's row (hit rate split into radix
prefix and chunk parts, TTFT, throughput, chunk evictions); the demo sends its frontend
programs through the same driver.

The reuse bound (:func:`best_possible_pct`): every document token after the document's first
appearance in the trace, unlimited memory.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import queue
import random
import threading
import time
from typing import Any, Callable

from tqdm import tqdm

from benchmarks import common, metrics, prompt_formats, rag_documents
from relaxkv_sglang.client import ServerClient
from relaxkv_sglang.repair.policies import REPAIR_POLICIES


@dataclasses.dataclass
class TraceRequest:
    """One request of the trace: its parts, which pool documents it holds (``doc_ids``, one per
    document), and the prompt they make with its ``relaxkv_chunks`` offsets
    (:func:`prompt_formats.marked_text`)."""

    system: str
    documents: list[str]
    question: str
    doc_ids: list[int]
    text: str = dataclasses.field(init=False)
    offsets: list[int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.text, self.offsets = prompt_formats.marked_text(self.system, self.documents, self.question)


def add_trace_args(parser: argparse.ArgumentParser) -> None:
    """The flags :func:`make_trace` reads (shared with ``benchmarks.rag_dataset``)."""
    parser.add_argument("--source", choices=["hotpotqa", "squad"], default="hotpotqa")
    parser.add_argument("--pool", type=int, default=60, help="distinct documents")
    parser.add_argument("--zipf", type=float, default=1.0, help="popularity exponent s")
    parser.add_argument("--docs-per-request", type=int, default=5)
    parser.add_argument("--topics", type=int, default=0,
                        help="T > 0: the pool in T topics, a request's documents all from one (Zipf over topics)")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=8)


def check_trace_args(bench: str, args: argparse.Namespace) -> None:
    """One clear line for trace flags :func:`make_trace` cannot honour."""
    if args.topics < 0 or (args.topics and args.pool // args.topics < args.docs_per_request):
        common.fail(bench, f"--topics {args.topics}: needs 0, or topics of at least --docs-per-request "
                           f"({args.docs_per_request}) documents each (--pool {args.pool})")


def make_trace(args: argparse.Namespace) -> list[TraceRequest]:
    """A seeded trace: Zipf(s) document popularity, k documents per request, random order.

    With ``args.topics = T > 0`` the pool is cut into ``T`` topics of ``pool // T`` consecutive
    documents; a request draws its topic by Zipf(s) and ``k`` distinct documents of it uniformly
    (related questions retrieving overlapping document sets, in another order each time).
    """
    docs = rag_documents.document_pool(args.source, args.pool, args.seed)
    rng = random.Random(args.seed)
    topics = getattr(args, "topics", 0) or 0
    weights = [1.0 / (rank + 1) ** args.zipf for rank in range(topics or len(docs))]
    questions = ["What do these documents have in common?", "Summarize the key fact.", "Who is mentioned first?"]
    trace = []
    for _ in range(args.requests):
        chosen: list[int] = []
        if topics:
            size = len(docs) // topics
            topic = rng.choices(range(topics), weights)[0]
            chosen = rng.sample(range(topic * size, (topic + 1) * size), args.docs_per_request)
        while len(chosen) < args.docs_per_request:
            pick = rng.choices(range(len(docs)), weights)[0]
            if pick not in chosen:
                chosen.append(pick)
        system, documents = rng.choice(prompt_formats.SYSTEM_PROMPTS), [docs[i] for i in chosen]
        trace.append(TraceRequest(system, documents, prompt_formats.question_text(rng.choice(questions)), chosen))
    return trace


class ReplayError(RuntimeError):
    """A request of a replay failed; ``index`` is its place in the trace, ``cause`` what it raised."""

    def __init__(self, index: int, cause: BaseException):
        super().__init__(f"request {index}: {cause}")
        self.index, self.cause = index, cause


def replay_in_order(send: Callable[[int, int, float], dict], count: int, clients: int,
                    on_done: Callable[[int, dict], None] | None = None) -> tuple[list[dict], float]:
    """Send requests ``0..count-1`` from ``clients`` threads; (their records in trace order, wall seconds).

    ``send(index, client, sent_at)`` serves one request and returns its record; ``sent_at`` is
    when the client took it, in seconds since the replay began. ``on_done(index, record)`` runs
    under a lock after each request (progress output). The clients pull from one queue, so
    requests start in trace order; after a failure no client takes another request, and the
    first failure is raised as :class:`ReplayError` once every client has stopped.
    """
    todo: queue.Queue[int] = queue.Queue()
    for i in range(count):
        todo.put(i)
    records: list[dict | None] = [None] * count
    failures: list[ReplayError] = []
    lock = threading.Lock()
    start = time.perf_counter()

    def client(cid: int) -> None:
        while not failures:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                record = send(i, cid, time.perf_counter() - start)
            except Exception as exc:
                failures.append(ReplayError(i, exc))
                return
            records[i] = record
            if on_done is not None:
                with lock:
                    on_done(i, record)

    threads = [threading.Thread(target=client, args=(c,), name=f"client-{c}", daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return records, time.perf_counter() - start  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """A policy as the benchmarks name it: ``<policy>``, ``<policy>-auto`` (the prompts sent
    unmarked, chunked by content on the server) or ``<policy>@<budget>`` (``relaxkv_budget``,
    e.g. ``relaxkv@auto``).

    Attributes: server_policy: the ``relaxkv_policy`` sent; unmarked: no ``relaxkv_chunks``;
    knobs: the repair's fields as :func:`~relaxkv_sglang.client.custom_params` takes them.
    """

    server_policy: str
    unmarked: bool
    knobs: dict


def policy_spec(policy: str, anchor_ratio: float | None) -> PolicySpec:
    """``policy`` parsed (:class:`PolicySpec`); a repair policy without a budget gets ``anchor_ratio``."""
    name, _, budget = policy.partition("@")
    server_policy = name.removesuffix("-auto")
    if budget:
        knobs = {"budget": budget}  # 'auto' or a number (the server's field checks it)
        with contextlib.suppress(ValueError):
            knobs["budget"] = float(budget)
    else:
        knobs = {"anchor_ratio": anchor_ratio} if server_policy in REPAIR_POLICIES and anchor_ratio is not None else {}
    return PolicySpec(server_policy, name.endswith("-auto"), knobs)


def replay(client: ServerClient, trace: list[TraceRequest], policy: str, clients: int,
           args: argparse.Namespace, desc: str = "bench_cache_hit") -> dict:
    """Send the whole trace under ``policy`` from ``clients`` threads on a flushed cache; the policy's row.

    ``policy`` ``"<policy>-auto"`` sends the same prompts unmarked, chunked by content on the
    server; ``"<policy>@auto"`` asks for ``relaxkv_budget: auto`` (the server's quality) instead of
    ``args.anchor_ratio``. ``args`` gives ``max_new_tokens``, ``anchor_ratio`` and ``pressure`` (keep the
    responses in the row); ``desc`` labels the progress bar.
    """
    client.flush()
    before = client.relaxkv_state()
    spec = policy_spec(policy, args.anchor_ratio)

    def one(i: int, _client: int, sent_at: float) -> dict:
        req = trace[i]
        out = client.generate_stream(req.text, None if spec.unmarked else req.offsets, spec.server_policy,
                                     max_new_tokens=args.max_new_tokens, **spec.knobs)
        out["sent_at"], out["first_token_at"] = sent_at, sent_at + out["ttft_s"]
        return out

    with tqdm(total=len(trace), desc=f"{desc} {policy}", unit="req") as bar:
        results, wall = replay_in_order(one, len(trace), clients, on_done=lambda i, r: bar.update())
    after = client.relaxkv_state()
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in results)
    cached = sum(r["meta_info"]["cached_tokens"] for r in results)
    chunk = sum(common.relaxkv_report(r).get("chunk_tokens_reused", 0) for r in results)
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    ttft = metrics.latency_summary(r["ttft_s"] for r in results)
    return {
        "policy": policy, "requests": len(results), "prompt_tokens": prompt,
        "total_cached_tokens": cached, "cache_hit_rate_pct": 100.0 * metrics.hit_rate(cached, prompt),
        "prefix_hit_rate_pct": 100.0 * metrics.hit_rate(cached - chunk, prompt),
        "chunk_hit_rate_pct": 100.0 * metrics.hit_rate(chunk, prompt),
        "requests_per_s": len(results) / wall, "tokens_per_s": (prompt + completion) / wall, "wall_s": wall,
        "ttft_s": ttft,
        "anchor_ratio_mean": metrics.mean(rep["anchor_ratio"] for rep in map(common.relaxkv_report, results)
                                          if "anchor_ratio" in rep),
        "chunk_evictions": after.get("chunk_evictions", 0) - before.get("chunk_evictions", 0),
        "chunk_evicted_tokens": after.get("chunk_evicted_tokens", 0) - before.get("chunk_evicted_tokens", 0),
        **repair_time(before, after),
        "per_request": [{"prompt_tokens": r["meta_info"]["prompt_tokens"], "cached_tokens": r["meta_info"]["cached_tokens"],
                         "chunk_tokens_reused": common.relaxkv_report(r).get("chunk_tokens_reused", 0),
                         "sent_at": r["sent_at"], "first_token_at": r["first_token_at"],
                         "ttft_s": r["ttft_s"], "latency_s": r["latency_s"]} for r in results],
        **({"results": results, "duplicates_before": before.get("chunk_duplicate_computes", 0)}
           if args.pressure else {}),
    }


def repair_time(before: dict, after: dict) -> dict:
    """Rank 0's repair stages between two server states: their count, wall seconds, and the plugin's collectives
    in them (tensor parallelism: calls, seconds, and their share of the repair's time)."""
    collectives = [state.get("tensor_parallel", {}).get("collectives", {}) for state in (before, after)]
    stages = after.get("repair_stages", 0) - before.get("repair_stages", 0)
    seconds = after.get("repair_seconds", 0.0) - before.get("repair_seconds", 0.0)
    calls = collectives[1].get("calls", 0) - collectives[0].get("calls", 0)
    in_collectives = collectives[1].get("seconds", 0.0) - collectives[0].get("seconds", 0.0)
    return {"tp_size": after.get("tensor_parallel", {}).get("size", 1), "repair_stages": stages,
            "repair_seconds": seconds, "collective_calls": calls, "collective_seconds": in_collectives,
            "collective_share_of_repair": in_collectives / seconds if seconds > 0 else None}


def document_tokens(trace: list[TraceRequest], tokenizer: Any) -> dict[int, int]:
    """Tokens of each document of the trace, tokenized on its own as the server tokenizes a chunk."""
    doc_tokens: dict[int, int] = {}
    for req in trace:
        for i, doc in zip(req.doc_ids, prompt_formats.chunk_texts(req.text, req.offsets)):
            if i not in doc_tokens:
                doc_tokens[i] = prompt_formats.token_count(tokenizer, doc)
    return doc_tokens


def best_possible_pct(trace: list[TraceRequest], doc_tokens: dict[int, int], prompt_tokens: int) -> float:
    """Every document token after its first appearance in the trace, over all prompt tokens."""
    reusable = metrics.reusable_tokens([(i, doc_tokens[i]) for i in req.doc_ids] for req in trace)
    return 100.0 * metrics.hit_rate(reusable, prompt_tokens)


def prompt_tokens(trace: list[TraceRequest], tokenizer: Any) -> list[int]:
    """Tokens of each request's prompt (as one text; the server's per-part count differs by a few)."""
    return [prompt_formats.token_count(tokenizer, req.text) for req in trace]


def trace_workload(args: argparse.Namespace) -> dict:
    """The trace's flags and the replay's clients, as every result's ``workload`` starts."""
    return {"source": args.source, "pool": args.pool, "zipf": args.zipf, "k": args.docs_per_request,
            "topics": args.topics, "requests": args.requests, "clients": args.clients, "seed": args.seed}


def trace_words(w: dict) -> str:
    """The trace's shape as every printed summary words it (``w``: a result's ``workload``)."""
    if w.get("given"):
        return "a trace given by the caller"
    if w.get("topics"):
        return (f"{w['k']} of {w['pool']} {w['source']} documents per request from one of {w['topics']} topics "
                f"(Zipf s={w['zipf']} over topics), seed {w['seed']}")
    return f"{w['k']} of {w['pool']} {w['source']} documents per request (Zipf s={w['zipf']}), seed {w['seed']}"

