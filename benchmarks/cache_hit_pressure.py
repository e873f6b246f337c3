"""``bench_cache_hit --pressure``: the chunk tree under memory pressure.

The KV pool is sized to 25% of the trace's working set (its distinct document tokens;
``--pressure-fraction``; never below what two requests need), and the same ``pic`` trace is
replayed one request at a time and then by 16 clients (``--clients``), cache flushed before
each. Reported: chunk hits (count and tokens) concurrent vs sequential, and vs the best possible
with that pool, an offline replay of the trace in order that keeps, after each request, the
chunks whose next use comes soonest (Belady's farthest-next-use rule) in the pool minus that
request's own tokens.

    python -m benchmarks.bench_cache_hit --pressure --model tiny-llama
"""

from __future__ import annotations

import argparse

from benchmarks import common, tables
from benchmarks.replay import TraceRequest, document_tokens, make_trace, prompt_tokens, replay, trace_workload, trace_words

BENCH = "bench_cache_hit"


def best_with_pool(trace: list[TraceRequest], doc_tokens: dict[int, int], room: list[int]) -> tuple[int, int]:
    """Chunk hits (count, tokens) of an offline cache that knows the future, one request at a time.

    Before request ``i`` the cache holds at most ``room[i]`` document tokens (the
    pool minus that request's own copy); after it, it keeps the documents whose
    next use comes soonest (Belady's rule; optimal for equal sizes, a close bound
    for the near-equal document sizes here).
    """
    uses: dict[int, list[int]] = {}
    for i, req in enumerate(trace):
        for d in req.doc_ids:
            uses.setdefault(d, []).append(i)
    cached: set[int] = set()
    hits = hit_tokens = 0
    for i, req in enumerate(trace):
        for d in req.doc_ids:
            if d in cached:
                hits += 1
                hit_tokens += doc_tokens[d]
        if i + 1 == len(trace):
            break
        candidates = cached | set(req.doc_ids)

        def next_use(d: int) -> int:
            later = [j for j in uses[d] if j > i]
            return later[0] if later else len(trace)

        kept, used = set(), 0
        for d in sorted(candidates, key=next_use):
            if next_use(d) < len(trace) and used + doc_tokens[d] <= room[i + 1]:
                kept.add(d)
                used += doc_tokens[d]
        cached = kept
    return hits, hit_tokens


def sized_trace(args: argparse.Namespace):
    """(trace, tokenizer, tokens per document, working set in document tokens, each request's
    prompt + answer tokens) of the benchmark's trace."""
    trace = make_trace(args)
    tokenizer = common.tokenizer(args)
    doc_tokens = document_tokens(trace, tokenizer)
    lengths = [n + args.max_new_tokens for n in prompt_tokens(trace, tokenizer)]
    return trace, tokenizer, doc_tokens, sum(doc_tokens.values()), lengths


def context_length_for(tokens: int) -> int:
    """A context length for ``tokens``, with room for the per-part tokenization's few extra tokens."""
    return -(-(tokens + 64) // 64) * 64


def run_pressure(args: argparse.Namespace) -> dict:
    """The same pic trace, sequential and concurrent, on a pool at 25% of its working set."""
    trace, tokenizer, doc_tokens, working_set, lengths = sized_trace(args)
    context = context_length_for(max(lengths))
    pool = max(int(args.pressure_fraction * working_set), 2 * context)
    args.max_total_tokens = pool
    with common.bench_client(args, BENCH, extra_args=["--context-length", str(context)]) as client:
        rows = {}
        for name, clients in (("sequential", 1), ("concurrent", args.clients)):
            row = replay(client, trace, "pic", clients, args)
            state = client.relaxkv_state()
            row["chunk_hits"] = sum(common.relaxkv_report(r).get("chunks_hit", 0) for r in row.pop("results"))
            row["chunk_tokens_reused"] = sum(r["chunk_tokens_reused"] for r in row["per_request"])
            row["chunks_computed_twice"] = state.get("chunk_duplicate_computes", 0) - row.pop("duplicates_before")
            row["chunk_locked_entries_after"] = state.get("chunk_locked_entries")
            row["chunk_store_target_tokens"] = state.get("chunk_target_tokens")
            row["clients"] = clients
            rows[name] = row
    room = [pool - n for n in lengths]
    best_hits, best_tokens = best_with_pool(trace, doc_tokens, room)
    seq, conc = rows["sequential"], rows["concurrent"]
    return {
        "workload": {**trace_workload(args), "kv_pool_tokens": pool, "distinct_document_tokens": working_set,
                     "chunk_lookups": sum(len(r.doc_ids) for r in trace), "context_length": context},
        "pressure": {
            "sequential": {k: v for k, v in seq.items() if k != "per_request"},
            "concurrent": {k: v for k, v in conc.items() if k != "per_request"},
            "best_with_pool": {"chunk_hits": best_hits, "chunk_tokens_reused": best_tokens},
            "concurrent_over_sequential": conc["chunk_hits"] / seq["chunk_hits"] if seq["chunk_hits"] else None,
            "concurrent_over_best": conc["chunk_hits"] / best_hits if best_hits else None,
            "sequential_over_best": seq["chunk_hits"] / best_hits if best_hits else None,
        },
    }



def print_pressure(result: dict) -> None:
    """The pressure result: chunk hits concurrent vs sequential vs the best with that pool."""
    w, p = result["workload"], result["pressure"]
    print(f"\n{w['requests']} requests ({w['chunk_lookups']} chunk lookups), {trace_words(w)}; working set {w['distinct_document_tokens']} "
          f"document tokens, KV pool {w['kv_pool_tokens']} tokens")
    columns = [tables.left("replay", 22), tables.right("clients", 8), tables.right("chunk hits", 11),
               tables.right("tokens", 9), tables.right("req/s", 7), tables.right("TTFT p50", 9), tables.right("twice", 7)]
    rows = [[name, str(p[name]["clients"]), str(p[name]["chunk_hits"]), str(p[name]["chunk_tokens_reused"]),
             f"{p[name]['requests_per_s']:.2f}", f"{p[name]['ttft_s']['p50']:.2f}", str(p[name]["chunks_computed_twice"])]
            for name in ("sequential", "concurrent")]
    b = p["best_with_pool"]  # an offline bound: no throughput, TTFT or duplicates
    rows.append(["best with this pool", "", str(b["chunk_hits"]), str(b["chunk_tokens_reused"]), "", "", ""])
    tables.print_text_table(columns, rows)
    print(f"concurrent / sequential: {common.fmt(p['concurrent_over_sequential'], '.0%')}; "
          f"concurrent / best: {common.fmt(p['concurrent_over_best'], '.0%')}; "
          f"sequential / best: {common.fmt(p['sequential_over_best'], '.0%')}")
