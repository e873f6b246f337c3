"""Cache hit rate of a RAG workload under each policy, with TTFT and throughput.

The workload: a pool of documents (HotpotQA or SQuAD paragraphs) whose
popularity follows a Zipf law with exponent ``s``; each request takes ``k``
distinct documents in random order after one of a few system prompts, then a
question. ``R`` requests are replayed by ``C`` concurrent clients, once per
policy against the same server (cache flushed in between). Reported per
policy: the hit rate SGLang itself reports (``meta_info.cached_tokens`` over
prompt tokens), split into the radix prefix part and the chunk part, beside
the workload's best possible hit rate (every document token after the
document's first appearance, unlimited memory), requests/s, tokens/s, TTFT
mean/p50/p90/p99, and chunk evictions. ``pic-auto`` replays the same prompts
unmarked, so the server finds the documents by content-defined chunking: how
close it comes to explicit marking is its hit rate against ``pic``'s. ``total_cached_tokens`` and
``cache_hit_rate_pct`` have the meaning of ``python -m sglang.benchmark.serving``.

Under a KV pool smaller than the working set (``--max-total-tokens``), chunks
are evicted and later repeats miss. For the chunk policies the hit rate lost
(best possible minus the chunk hit rate) is split as far as the trace allows:
*lost to evictions* counts, per request, the tokens of its documents that an
earlier request had already computed (its first token reached the client
before this request was sent, so its chunks had been stored, if there was
room) minus the chunk tokens the request reused: at least that many
seen-before tokens missed (evicted, or never stored for lack of room). The
rest is *lost in flight*: repeats sent while the document's first request was
still being prefilled (concurrency), which no cache size recovers.

    python -m benchmarks.bench_cache_hit --quick
    python -m benchmarks.bench_cache_hit --requests 200 --clients 8
    python -m benchmarks.bench_cache_hit --quick --max-total-tokens 4096 --policies pic relaxkv  # evictions
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

from benchmarks import common
from relaxkv_sglang import metrics, workloads
from relaxkv_sglang.client import ServerClient

BENCH = "bench_cache_hit"


@dataclasses.dataclass
class TraceRequest:
    """One request of the trace: its prompt, its ``relaxkv_chunks`` offsets and which pool documents it holds."""

    text: str
    offsets: list[int]
    doc_ids: list[int]


def make_trace(args: argparse.Namespace) -> list[TraceRequest]:
    """A seeded trace: Zipf(s) document popularity, k documents per request, random order."""
    docs = workloads.document_pool(args.source, args.pool, args.seed)
    rng = random.Random(args.seed)
    weights = [1.0 / (rank + 1) ** args.zipf for rank in range(len(docs))]
    questions = ["What do these documents have in common?", "Summarize the key fact.", "Who is mentioned first?"]
    trace = []
    for _ in range(args.requests):
        chosen: list[int] = []
        while len(chosen) < args.docs_per_request:
            pick = rng.choices(range(len(docs)), weights)[0]
            if pick not in chosen:
                chosen.append(pick)
        text, offsets = workloads.marked_text(rng.choice(workloads.SYSTEM_PROMPTS), [docs[i] for i in chosen],
                                              workloads.question_text(rng.choice(questions)))
        trace.append(TraceRequest(text, offsets, chosen))
    return trace


def replay(client: ServerClient, trace: list[TraceRequest], policy: str, clients: int,
           args: argparse.Namespace) -> dict:
    """Send the whole trace under ``policy`` from ``clients`` threads on a flushed cache; the policy's row."""
    client.flush()
    before = client.relaxkv_state()

    # "<policy>-auto": the same prompts sent unmarked, chunked by content on the server.
    server_policy, auto = policy.removesuffix("-auto"), policy.endswith("-auto")

    def one(req: TraceRequest) -> dict:
        sent = time.perf_counter()
        out = client.generate_stream(
            req.text, None if auto else req.offsets, server_policy, max_new_tokens=args.max_new_tokens,
            anchor_ratio=args.anchor_ratio if server_policy not in ("prefix", "pic") else None)
        out["sent_at"], out["first_token_at"] = sent - start, sent - start + out["ttft_s"]
        return out

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(tqdm(pool.map(one, trace), total=len(trace), desc=f"{BENCH} {policy}", unit="req"))
    wall = time.perf_counter() - start
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
        "chunk_evictions": after.get("chunk_evictions", 0) - before.get("chunk_evictions", 0),
        "chunk_evicted_tokens": after.get("chunk_evicted_tokens", 0) - before.get("chunk_evicted_tokens", 0),
        "per_request": [{"prompt_tokens": r["meta_info"]["prompt_tokens"], "cached_tokens": r["meta_info"]["cached_tokens"],
                         "chunk_tokens_reused": common.relaxkv_report(r).get("chunk_tokens_reused", 0),
                         "sent_at": r["sent_at"], "first_token_at": r["first_token_at"],
                         "ttft_s": r["ttft_s"], "latency_s": r["latency_s"]} for r in results],
    }


def document_tokens(trace: list[TraceRequest], tokenizer: Any) -> dict[int, int]:
    """Tokens of each document of the trace, tokenized on its own as the server tokenizes a chunk."""
    doc_tokens: dict[int, int] = {}
    for req in trace:
        for i, doc in zip(req.doc_ids, workloads.chunk_texts(req.text, req.offsets)):
            if i not in doc_tokens:
                doc_tokens[i] = workloads.token_count(tokenizer, doc)
    return doc_tokens


def best_possible_pct(trace: list[TraceRequest], doc_tokens: dict[int, int], prompt_tokens: int) -> float:
    """Every document token after its first appearance in the trace, over all prompt tokens."""
    reusable = metrics.reusable_tokens([(i, doc_tokens[i]) for i in req.doc_ids] for req in trace)
    return 100.0 * metrics.hit_rate(reusable, prompt_tokens)


def seen_before_missed_tokens(doc_ids: list[list[int]], per_request: list[dict], doc_tokens: dict[int, int]) -> int:
    """Document tokens computed by an earlier request that a later one still did not reuse (a lower bound).

    ``per_request[i]`` (for the request with documents ``doc_ids[i]``) has
    ``sent_at``, ``first_token_at`` (client clock) and ``chunk_tokens_reused``.
    A document counts as seen before a request when a request holding it had
    its first token back before this one was sent: its prefill, which stores
    the chunk when there is room, was over. The server reports how many chunk
    tokens a request reused, not which chunks, so a request contributes
    ``max(0, seen-before tokens - reused tokens)``: exact when its other
    documents all missed, a lower bound otherwise.
    """
    done = sorted(range(len(per_request)), key=lambda i: per_request[i]["first_token_at"])
    missed, seen, k = 0, set(), 0
    for i in sorted(range(len(per_request)), key=lambda i: per_request[i]["sent_at"]):
        while k < len(done) and per_request[done[k]]["first_token_at"] < per_request[i]["sent_at"]:
            seen.update(doc_ids[done[k]])
            k += 1
        expected = sum(doc_tokens[d] for d in set(doc_ids[i]) & seen)
        missed += max(0, expected - per_request[i]["chunk_tokens_reused"])
    return missed


def run(args: argparse.Namespace) -> dict:
    """Replay one trace under every policy against one server; rows with their hit rate lost, and the workload."""
    trace = make_trace(args)
    tokenizer = common.tokenizer(args)
    with common.bench_client(args, BENCH) as client:
        rows = [replay(client, trace, policy, args.clients, args) for policy in args.policies]
    doc_tokens = document_tokens(trace, tokenizer)
    best = best_possible_pct(trace, doc_tokens, rows[0]["prompt_tokens"])
    doc_ids = [req.doc_ids for req in trace]
    for row in rows:
        row["best_possible_hit_rate_pct"] = best
        chunk_policy = row["policy"] != "prefix"
        row["hit_rate_lost_pct"] = best - row["chunk_hit_rate_pct"] if chunk_policy else None
        if chunk_policy:
            missed = seen_before_missed_tokens(doc_ids, row["per_request"], doc_tokens)
            row["lost_to_evictions_pct"] = 100.0 * missed / row["prompt_tokens"]
            row["lost_in_flight_pct"] = row["hit_rate_lost_pct"] - row["lost_to_evictions_pct"]
        else:
            row["lost_to_evictions_pct"] = row["lost_in_flight_pct"] = None
    return {"workload": {"source": args.source, "pool": args.pool, "zipf": args.zipf, "k": args.docs_per_request,
                         "requests": args.requests, "clients": args.clients, "seed": args.seed,
                         "kv_pool_tokens": None if args.url else args.max_total_tokens,
                         "distinct_document_tokens": sum(doc_tokens.values())},
            "results": rows}


def print_table(result: dict) -> None:
    """The result as a plain-text table, one row per policy."""
    w = result["workload"]
    pool = f"KV pool {w['kv_pool_tokens']} tokens" if w.get("kv_pool_tokens") else "KV pool of the given server"
    print(f"\n{w['requests']} requests, {w['clients']} clients, {w['k']} of {w['pool']} {w['source']} documents "
          f"per request (Zipf s={w['zipf']}), seed {w['seed']}; {w['distinct_document_tokens']} distinct document "
          f"tokens, {pool}")
    head = (f"{'policy':<10}{'hit rate':>9}{'prefix':>8}{'chunk':>8}{'best':>8}{'req/s':>7}{'tok/s':>8}"
            f"{'TTFT mean':>10}{'p50':>7}{'p90':>7}{'p99':>7}{'evicted':>9}"
            f"{'lost':>8}{'evictions':>10}{'in flight':>10}")
    print(head)
    print("-" * len(head))
    for r in result["results"]:
        t = r["ttft_s"]
        print(f"{r['policy']:<10}{r['cache_hit_rate_pct']:>8.1f}%{r['prefix_hit_rate_pct']:>7.1f}%{r['chunk_hit_rate_pct']:>7.1f}%"
              f"{r['best_possible_hit_rate_pct']:>7.1f}%{r['requests_per_s']:>7.2f}{r['tokens_per_s']:>8.0f}"
              f"{t['mean']:>10.2f}{t['p50']:>7.2f}{t['p90']:>7.2f}{t['p99']:>7.2f}{r['chunk_evictions']:>9}"
              + "".join(f"{r[k]:>{width}.1f}%" if r[k] is not None else f"{'-':>{width + 1}}"
                        for k, width in (("hit_rate_lost_pct", 7), ("lost_to_evictions_pct", 9),
                                         ("lost_in_flight_pct", 9))))
    print("lost = best possible - chunk hit rate; evictions = seen-before document tokens missed (at least); "
          "in flight = the rest")


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.bench_cache_hit``: parse the flags, measure, print, write the JSON."""
    parser = common.bench_parser(BENCH, __doc__, quick_help="40 requests, 2 clients")
    parser.add_argument("--source", choices=["hotpotqa", "squad"], default="hotpotqa")
    parser.add_argument("--pool", type=int, default=60, help="distinct documents")
    parser.add_argument("--zipf", type=float, default=1.0, help="popularity exponent s")
    parser.add_argument("--docs-per-request", type=int, default=5)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--anchor-ratio", type=float, default=0.15)
    parser.add_argument("--policies", nargs="+", default=["prefix", "pic", "pic-auto", "relaxkv"],
                        help="server policies; '<policy>-auto' sends the prompts unmarked (content-defined chunking)")
    parser.epilog = ("A KV pool smaller than the working set shows evictions and the hit rate they cost, e.g. "
                     "--quick --max-total-tokens 4096 --policies pic relaxkv")
    args = common.parse_args(parser, argv, quick={"requests": 40, "clients": 2})
    common.run_bench(BENCH, args, run, report=print_table)


if __name__ == "__main__":
    main()
