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

    python -m benchmarks.bench_cache_hit --quick
    python -m benchmarks.bench_cache_hit --requests 200 --clients 8
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from benchmarks.common import add_server_args, fail, server_url, write_result
from relaxkv_sglang import assets, metrics, workloads
from relaxkv_sglang.client import ServerClient

BENCH = "bench_cache_hit"


@dataclasses.dataclass
class TraceRequest:
    text: str
    offsets: list[int]
    doc_ids: list[int]


def document_pool(source: str, n: int, seed: int) -> list[str]:
    data = assets.load_data(source)
    rng = random.Random(seed)
    if source == "hotpotqa":
        paragraphs = [workloads.format_paragraph(t, s) for ex in data[:2000] for t, s in ex["context"]]
    else:  # SQuAD v2 dev: {"data": [{"paragraphs": [{"context": ...}]}]}
        paragraphs = [p["context"] for art in data["data"] for p in art["paragraphs"]]
    return rng.sample(sorted(set(paragraphs)), n)


def make_trace(args) -> list[TraceRequest]:
    """A seeded trace: Zipf(s) document popularity, k documents per request, random order."""
    docs = document_pool(args.source, args.pool, args.seed)
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


def replay(client: ServerClient, trace: list[TraceRequest], policy: str, clients: int, args) -> dict:
    client.flush()
    before = client.relaxkv_state()

    # "<policy>-auto": the same prompts sent unmarked, chunked by content on the server.
    server_policy, auto = policy.removesuffix("-auto"), policy.endswith("-auto")

    def one(req: TraceRequest) -> dict:
        return client.generate_stream(
            req.text, None if auto else req.offsets, server_policy, max_new_tokens=args.max_new_tokens,
            anchor_ratio=args.anchor_ratio if server_policy not in ("prefix", "pic") else None)

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(tqdm(pool.map(one, trace), total=len(trace), desc=f"{BENCH} {policy}", unit="req"))
    wall = time.perf_counter() - start
    after = client.relaxkv_state()
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in results)
    cached = sum(r["meta_info"]["cached_tokens"] for r in results)
    chunk = sum((r["meta_info"].get("relaxkv") or {}).get("chunk_tokens_reused", 0) for r in results)
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    ttft = metrics.latency_summary(r["ttft_s"] for r in results)
    return {
        "policy": policy, "requests": len(results), "prompt_tokens": prompt,
        "total_cached_tokens": cached, "cache_hit_rate_pct": 100.0 * cached / prompt,
        "prefix_hit_rate_pct": 100.0 * (cached - chunk) / prompt, "chunk_hit_rate_pct": 100.0 * chunk / prompt,
        "requests_per_s": len(results) / wall, "tokens_per_s": (prompt + completion) / wall, "wall_s": wall,
        "ttft_s": ttft,
        "chunk_evictions": after.get("chunk_evictions", 0) - before.get("chunk_evictions", 0),
        "chunk_evicted_tokens": after.get("chunk_evicted_tokens", 0) - before.get("chunk_evicted_tokens", 0),
        "per_request": [{"prompt_tokens": r["meta_info"]["prompt_tokens"], "cached_tokens": r["meta_info"]["cached_tokens"],
                         "ttft_s": r["ttft_s"], "latency_s": r["latency_s"]} for r in results],
    }


def best_possible_pct(trace: list[TraceRequest], tokenizer, prompt_tokens: int) -> float:
    """Every document token after its first appearance in the trace, over all prompt tokens."""
    doc_tokens = {}
    for req in trace:
        for i, (s, e) in zip(req.doc_ids, zip(req.offsets[::2], req.offsets[1::2])):
            if i not in doc_tokens:
                doc_tokens[i] = len(tokenizer.encode(req.text[s:e], add_special_tokens=False))
    reusable = metrics.reusable_tokens([(i, doc_tokens[i]) for i in req.doc_ids] for req in trace)
    return 100.0 * reusable / prompt_tokens


def run(args) -> dict:
    from transformers import AutoTokenizer

    trace = make_trace(args)
    model = str(assets.model_path(args.model)) if args.model in assets.MODELS else args.model
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = []
    with server_url(args, BENCH) as url:
        client = ServerClient(url)
        for policy in args.policies:
            rows.append(replay(client, trace, policy, args.clients, args))
    best = best_possible_pct(trace, tokenizer, rows[0]["prompt_tokens"])
    for row in rows:
        row["best_possible_hit_rate_pct"] = best
        row["hit_rate_lost_pct"] = best - row["chunk_hit_rate_pct"] if row["policy"] != "prefix" else None
    return {"workload": {"source": args.source, "pool": args.pool, "zipf": args.zipf, "k": args.docs_per_request,
                         "requests": args.requests, "clients": args.clients, "seed": args.seed},
            "results": rows}


def print_table(result: dict) -> None:
    w = result["workload"]
    print(f"\n{w['requests']} requests, {w['clients']} clients, {w['k']} of {w['pool']} {w['source']} documents "
          f"per request (Zipf s={w['zipf']}), seed {w['seed']}")
    head = (f"{'policy':<10}{'hit rate':>9}{'prefix':>8}{'chunk':>8}{'best':>8}{'req/s':>7}{'tok/s':>8}"
            f"{'TTFT mean':>10}{'p50':>7}{'p90':>7}{'p99':>7}{'evicted':>9}")
    print(head)
    print("-" * len(head))
    for r in result["results"]:
        t = r["ttft_s"]
        print(f"{r['policy']:<10}{r['cache_hit_rate_pct']:>8.1f}%{r['prefix_hit_rate_pct']:>7.1f}%{r['chunk_hit_rate_pct']:>7.1f}%"
              f"{r['best_possible_hit_rate_pct']:>7.1f}%{r['requests_per_s']:>7.2f}{r['tokens_per_s']:>8.0f}"
              f"{t['mean']:>10.2f}{t['p50']:>7.2f}{t['p90']:>7.2f}{t['p99']:>7.2f}{r['chunk_evictions']:>9}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_cache_hit", description=__doc__.split("\n\n")[0])
    add_server_args(parser)
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
    parser.add_argument("--quick", action="store_true", help="40 requests, 2 clients")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.clients = 40, 2
    try:
        result = run(args)
    except (RuntimeError, assets.AssetError) as exc:
        fail(BENCH, str(exc))
    print_table(result)
    write_result(BENCH, args, result)


if __name__ == "__main__":
    main()
