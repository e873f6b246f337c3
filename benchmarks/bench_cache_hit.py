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

``--pressure`` measures the chunk tree under memory pressure instead: the KV
pool is sized to 25% of the trace's working set (its distinct document tokens;
never below what two requests need), and the same ``pic`` trace is replayed one
request at a time and then by 16 clients (``--clients``), cache flushed before
each. Reported: chunk hits (count and tokens) concurrent vs sequential, and vs
the best possible with that pool, an offline replay of the trace in order that
keeps, after each request, the chunks whose next use comes soonest (Belady's
farthest-next-use rule) in the pool minus that request's own tokens.

    python -m benchmarks.bench_cache_hit --pressure --model tiny-llama

``--tiers`` measures the chunk store's lower tiers instead (docs/performance.md): on a KV pool
of 25% of the working set (``--pressure-fraction``) the ``pic`` trace is replayed (1) with the
pool alone, (2) with a host-memory tier (``--host-cache-gb``) below it, each against the best
possible with unlimited memory; then (3) the trace's documents are pre-encoded into a fresh
``--chunk-dir`` with ``relaxkv-sglang encode``'s code, the server restarted on that folder and
the trace replayed once: its chunk hit rate against the best possible with every document
pre-encoded (all document tokens); and (4), on the flushed restarted server, document sets of
about ``--disk-load-tokens`` tokens are sent twice side by side: loaded from disk (default
namespace) and computed cold (``pic`` in a fresh ``cache_salt``), TTFT medians and their ratio.

    python -m benchmarks.bench_cache_hit --tiers --quick --model tiny-llama

``--replicas N`` (N >= 2) measures routing instead: N servers, each with the KV pool
``--max-total-tokens``, and the ``smg`` gateway in front (:class:`relaxkv_sglang.server.Cluster`).
The same trace is replayed under ``pic`` (``--policies``) once against one replica alone (the
single-server reference) and once through the gateway per ``--routings``: ``document`` (sticky
routing keyed by the MinHash of each request's documents, which the client sends as
``x-smg-routing-key``, a new key placed by the gateway's round-robin turn;
:mod:`relaxkv_sglang.routing`), ``document_split`` (the same
with the client spreading a hot key over several replicas: :class:`~relaxkv_sglang.routing.HotKeySplitter`,
the load-aware fallback), ``cache_aware`` and ``round_robin``, every replica flushed before each. Reported per routing: the hit rate, its share
of the single-server one, and the requests each replica served, read from each replica's own
``/metrics`` (``sglang:num_requests_total``), not from the router.

    python -m benchmarks.bench_cache_hit --replicas 2 --model tiny-llama --quick

With ``--shared-chunk-dir`` the replicas share one disk tier folder (``RELAXKV_CHUNK_DIR``, emptied
before each run): a chunk one replica computed is a disk hit on the others.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import pathlib
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

from benchmarks import common
from relaxkv_sglang import metrics, workloads
from relaxkv_sglang.client import ServerClient
from relaxkv_sglang.routing import HotKeySplitter

BENCH = "bench_cache_hit"


@dataclasses.dataclass
class TraceRequest:
    """One request of the trace: its parts, which pool documents it holds (``doc_ids``, one per
    document), and the prompt they make with its ``relaxkv_chunks`` offsets
    (:func:`workloads.marked_text`)."""

    system: str
    documents: list[str]
    question: str
    doc_ids: list[int]
    text: str = dataclasses.field(init=False)
    offsets: list[int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.text, self.offsets = workloads.marked_text(self.system, self.documents, self.question)


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
    docs = workloads.document_pool(args.source, args.pool, args.seed)
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
        system, documents = rng.choice(workloads.SYSTEM_PROMPTS), [docs[i] for i in chosen]
        trace.append(TraceRequest(system, documents, workloads.question_text(rng.choice(questions)), chosen))
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
        **({"results": results, "duplicates_before": before.get("chunk_duplicate_computes", 0)}
           if args.pressure else {}),
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


def prompt_tokens(trace: list[TraceRequest], tokenizer: Any) -> list[int]:
    """Tokens of each request's prompt (as one text; the server's per-part count differs by a few)."""
    return [workloads.token_count(tokenizer, req.text) for req in trace]


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


def _context_length(tokens: int) -> int:
    """A context length for ``tokens``, with room for the per-part tokenization's few extra tokens."""
    return -(-(tokens + 64) // 64) * 64


def run_pressure(args: argparse.Namespace) -> dict:
    """The same pic trace, sequential and concurrent, on a pool at 25% of its working set."""
    trace, tokenizer, doc_tokens, working_set, lengths = sized_trace(args)
    context = _context_length(max(lengths))
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


def print_pressure(result: dict) -> None:
    """The pressure result: chunk hits concurrent vs sequential vs the best with that pool."""
    w, p = result["workload"], result["pressure"]
    print(f"\n{w['requests']} requests ({w['chunk_lookups']} chunk lookups), {trace_words(w)}; working set {w['distinct_document_tokens']} "
          f"document tokens, KV pool {w['kv_pool_tokens']} tokens")
    head = f"{'replay':<22}{'clients':>8}{'chunk hits':>11}{'tokens':>9}{'req/s':>7}{'TTFT p50':>9}{'twice':>7}"
    print(head)
    print("-" * len(head))
    for name in ("sequential", "concurrent"):
        r = p[name]
        print(f"{name:<22}{r['clients']:>8}{r['chunk_hits']:>11}{r['chunk_tokens_reused']:>9}"
              f"{r['requests_per_s']:>7.2f}{r['ttft_s']['p50']:>9.2f}{r['chunks_computed_twice']:>7}")
    b = p["best_with_pool"]
    print(f"{'best with this pool':<22}{'':>8}{b['chunk_hits']:>11}{b['chunk_tokens_reused']:>9}")
    print(f"concurrent / sequential: {common.fmt(p['concurrent_over_sequential'], '.0%')}; "
          f"concurrent / best: {common.fmt(p['concurrent_over_best'], '.0%')}; "
          f"sequential / best: {common.fmt(p['sequential_over_best'], '.0%')}")


def doc_sets(docs: list[str], doc_tokens: list[int], target: int, count: int) -> list[list[int]]:
    """Up to ``count`` disjoint sets of documents (indices) of at least ``target`` tokens each, in order."""
    sets, cur, n = [], [], 0
    for i, t in enumerate(doc_tokens):
        cur.append(i)
        n += t
        if n >= target:
            sets.append(cur)
            cur, n = [], 0
            if len(sets) == count:
                break
    return sets


def run_tiers(args: argparse.Namespace) -> dict:
    """Pool only vs pool + host tier vs best; pre-encode, restart, replay; disk load vs compute."""
    import json
    import statistics
    import uuid

    from relaxkv_sglang.encode import encode_corpus

    trace, tokenizer, doc_tokens, working_set, lengths = sized_trace(args)
    target = args.disk_load_tokens
    context = _context_length(max(max(lengths), target + 200))
    pool = max(int(args.pressure_fraction * working_set), 2 * context)
    args.max_total_tokens = pool
    extra = ["--context-length", str(context)]
    host = {"RELAXKV_HOST_CACHE_GB": str(args.host_cache_gb)}
    rows: dict = {}

    def measured(client: ServerClient, name: str) -> dict:
        row = replay(client, trace, "pic", args.clients, args)
        state = client.relaxkv_state()
        row["tiers"] = {k: v for k, v in state.items() if k.startswith("tier_") or k == "tiers"}
        results = row.pop("results", []) or []
        for tier in ("host", "disk"):
            row[f"chunk_tokens_from_{tier}"] = sum(common.relaxkv_report(r).get(f"chunk_tokens_from_{tier}", 0)
                                                   for r in results)
        rows[name] = row
        return row

    args.pressure = True  # replay() keeps the responses, for the per-tier token counts
    with common.bench_client(args, BENCH, extra_args=extra) as client:
        measured(client, "pool only")
    with common.bench_client(args, BENCH, extra_args=extra, env=host) as client:
        measured(client, "pool + host tier")

    # Pre-encode every document of the trace, restart on the same folder, replay once.
    docs = workloads.document_pool(args.source, args.pool, args.seed)
    used = sorted({d for req in trace for d in req.doc_ids})
    chunk_dir = tempfile.mkdtemp(prefix="relaxkv-bench-chunks-")
    corpus = pathlib.Path(chunk_dir + ".jsonl")
    corpus.write_text("".join(json.dumps({"text": docs[d]}) + "\n" for d in used))
    disk = {**host, "RELAXKV_CHUNK_DIR": chunk_dir, "RELAXKV_DISK_CACHE_GB": str(args.disk_cache_gb)}
    with common.bench_client(args, BENCH, extra_args=extra, env=disk) as client:
        t0 = time.perf_counter()
        counts = encode_corpus(client.url, str(corpus), batch_size=4, state_path="none")
        encode_s = time.perf_counter() - t0
    with common.bench_client(args, BENCH, extra_args=extra, env=disk) as client:  # the restart
        restarted = measured(client, "pre-encoded, restarted")
        # Disk load vs compute, side by side, on a flushed pool and host tier (the disk stays).
        client.flush()
        sizes = [workloads.token_count(tokenizer, docs[d]) for d in used]
        sets = doc_sets([docs[d] for d in used], sizes, target, args.disk_load_sets)
        question = workloads.question_text("What do these documents have in common?")
        system = workloads.SYSTEM_PROMPTS[0]
        warm_text, warm_offsets = workloads.marked_text(system, ["A warm-up document."], question)
        client.generate(warm_text, warm_offsets, "pic", max_new_tokens=1)
        timing = []
        for k, chosen in enumerate(sets):
            text, offsets = workloads.marked_text(system, [docs[used[i]] for i in chosen], question)
            disk_out = client.generate_stream(text, offsets, "pic", max_new_tokens=1)
            cold_out = client.generate_stream(text, offsets, "pic", max_new_tokens=1,
                                              cache_salt=f"cold-{k}-{uuid.uuid4().hex}")
            timing.append({
                "documents": len(chosen), "document_tokens": sum(sizes[i] for i in chosen),
                "disk_ttft_s": disk_out["ttft_s"], "compute_ttft_s": cold_out["ttft_s"],
                "chunk_tokens_from_disk": common.relaxkv_report(disk_out).get("chunk_tokens_from_disk", 0),
                "cold_chunks_hit": common.relaxkv_report(cold_out).get("chunks_hit", 0),
            })
        state = client.relaxkv_state()
    prompt_total = rows["pool only"]["prompt_tokens"]
    best = best_possible_pct(trace, doc_tokens, prompt_total)
    all_docs_pct = 100.0 * metrics.hit_rate(sum(doc_tokens[d] for req in trace for d in req.doc_ids), prompt_total)
    for name, row in rows.items():
        row.pop("per_request", None)
        ref = all_docs_pct if name.startswith("pre-encoded") else best
        row["best_pct"] = ref
        row["of_best"] = row["chunk_hit_rate_pct"] / ref if ref else None
    disk_med = statistics.median(t["disk_ttft_s"] for t in timing) if timing else None
    cold_med = statistics.median(t["compute_ttft_s"] for t in timing) if timing else None
    return {
        "workload": {**trace_workload(args), "kv_pool_tokens": pool, "distinct_document_tokens": working_set,
                     "context_length": context, "host_cache_gb": args.host_cache_gb, "best_possible_hit_rate_pct": best,
                     "all_document_tokens_pct": all_docs_pct},
        "tiers": rows,
        "encode": {**counts, "wall_s": encode_s, "disk_bytes": state.get("tier_disk_bytes_held")},
        "disk_vs_compute": {"sets": timing, "disk_ttft_median_s": disk_med, "compute_ttft_median_s": cold_med,
                            "speedup": cold_med / disk_med if disk_med else None},
    }


def print_tiers(result: dict) -> None:
    """The tier result: hit rates against the best possible; disk load vs compute."""
    w = result["workload"]
    print(f"\n{w['requests']} requests ({w['clients']} clients), {trace_words(w)}; working set {w['distinct_document_tokens']} document "
          f"tokens, KV pool {w['kv_pool_tokens']} tokens, host tier {w['host_cache_gb']} GB")
    head = (f"{'replay':<26}{'chunk hit':>10}{'best':>8}{'of best':>9}{'from host':>11}{'from disk':>11}"
            f"{'req/s':>7}{'TTFT p50':>9}")
    print(head)
    print("-" * len(head))
    for name, r in result["tiers"].items():
        print(f"{name:<26}{r['chunk_hit_rate_pct']:>9.1f}%{r['best_pct']:>7.1f}%{common.fmt(r['of_best'], '.0%'):>9}"
              f"{r['chunk_tokens_from_host']:>11}{r['chunk_tokens_from_disk']:>11}{r['requests_per_s']:>7.2f}"
              f"{r['ttft_s']['p50']:>9.2f}")
    print("best: unlimited memory (every document token after its first use); for the pre-encoded replay, "
          "every document token")
    e = result["encode"]
    print(f"encode: {e['stored']} stored, {e['skipped']} skipped, {e['failed']} failed in {e['wall_s']:.1f} s")
    d = result["disk_vs_compute"]
    for t in d["sets"]:
        print(f"  {t['documents']} documents, {t['document_tokens']} tokens: disk {t['disk_ttft_s']:.3f} s "
              f"({t['chunk_tokens_from_disk']} tokens from disk), computed {t['compute_ttft_s']:.3f} s")
    print(f"disk load vs compute (TTFT medians): {common.fmt(d['disk_ttft_median_s'], '.3f')} s vs "
          f"{common.fmt(d['compute_ttft_median_s'], '.3f')} s: {common.fmt(d['speedup'], '.1f')}x")


class ClusterClient(ServerClient):
    """A client of the gateway whose ``flush`` and ``relaxkv_state`` go to every replica directly
    (the counters summed), so :func:`replay` measures a cluster as it measures one server."""

    def __init__(self, url: str, replica_urls: list[str], splitter: HotKeySplitter | None = None):
        super().__init__(url, splitter=splitter)
        self.replicas = [ServerClient(u) for u in replica_urls]

    def flush(self, wait_s: float = 60) -> None:
        for replica in self.replicas:
            replica.flush(wait_s)

    def relaxkv_state(self) -> dict:
        total: dict = {}
        for replica in self.replicas:
            for key, value in replica.relaxkv_state().items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    total[key] = total.get(key, 0) + value
        return total


def empty_shared_folder(urls: list[str], folder: pathlib.Path, timeout_s: float = 120) -> None:
    """Wait until no replica has a disk write pending, then remove every chunk file in ``folder``
    (a replica's index entry for a removed file is then a counted miss, as after another process
    evicted it)."""
    deadline = time.monotonic() + timeout_s
    while any(ServerClient(u).relaxkv_state().get("tier_disk_pending_writes", 0) for u in urls):
        if time.monotonic() > deadline:
            raise RuntimeError(f"disk writes still pending after {timeout_s:.0f} s")
        time.sleep(0.2)
    for path in folder.rglob("*.kv"):
        path.unlink(missing_ok=True)


def imbalance(counts: list[int]) -> float | None:
    """max / min requests per replica (None when a replica served none)."""
    return max(counts) / min(counts) if counts and min(counts) > 0 else None


def run_replicas(args: argparse.Namespace, trace: list[TraceRequest] | None = None) -> dict:
    """The trace (``make_trace(args)`` unless given) under one policy through the router per routing,
    and against one replica alone."""
    from relaxkv_sglang.server import Cluster, RouterConfig, RouterProcess, replica_configs, replica_request_counts

    # A trace passed in (the e2e test builds its own) is not what the trace flags describe.
    workload = trace_workload(args) if trace is None else {"given": True, "requests": len(trace), "clients": args.clients}
    trace = make_trace(args) if trace is None else trace
    model = str(common.model_dir(args))
    common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    log = common.RESULTS_DIR / f"{BENCH}-{common.stamp()}.server.log"
    shared = pathlib.Path(tempfile.mkdtemp(prefix="relaxkv-bench-shared-")) if args.shared_chunk_dir else None
    env = {"RELAXKV_CHUNK_DIR": str(shared), "RELAXKV_DISK_CACHE_GB": str(args.disk_cache_gb)} if shared else {}
    base = common.ServerConfig(model_path=model, max_total_tokens=args.max_total_tokens, policy="prefix",
                               log_path=str(log), env=env)

    def measure(client: ClusterClient, policy: str, routing: str, urls: list[str]) -> dict:
        """One replay; requests per replica from the replicas' /metrics, chunk hits from their counters."""
        if shared is not None:  # every run starts from an empty shared folder
            empty_shared_folder(urls, shared)
        requests_before, state_before = replica_request_counts(urls), client.relaxkv_state()
        row = replay(client, trace, policy, args.clients, args)
        state = client.relaxkv_state()
        chunk = state.get("chunk_hit_tokens", 0) - state_before.get("chunk_hit_tokens", 0)
        row.update(routing=routing, chunk_hit_rate_pct=100.0 * metrics.hit_rate(chunk, row["prompt_tokens"]),
                   per_replica_requests=[a - b for a, b in zip(replica_request_counts(urls), requests_before)])
        row["prefix_hit_rate_pct"] = row["cache_hit_rate_pct"] - row["chunk_hit_rate_pct"]
        return row

    rows = []
    with contextlib.ExitStack() as stack:
        if args.replica_urls:
            urls = [u.rstrip("/") for u in args.replica_urls]
        else:
            print(f"{BENCH}: starting {args.replicas} sglang replicas with {model} (logs: {log}.replica*)",
                  file=sys.stderr, flush=True)
            urls = stack.enter_context(Cluster(replica_configs(base, args.replicas), None)).replica_urls
        # One request straight to every replica first, so no replay times a replica's first
        # requests' code paths (each replay starts from flushed caches: no cached document is left).
        for url in urls:
            ServerClient(url).generate(trace[0].text, trace[0].offsets, args.policies[0].removesuffix("-auto"),
                                       max_new_tokens=1)
        for policy in args.policies:  # one replica alone, then a router per routing
            rows.append(measure(ClusterClient(urls[0], urls), policy, "single", urls))
            for i, routing in enumerate(args.routings):  # a routing may repeat (the e2e test replays it)
                # document_split: the router's document routing, the client splitting hot keys
                router_routing = routing.removesuffix("_split")
                mode = ["--assignment-mode", args.assignment_mode] if router_routing == "document" else []
                config = RouterConfig(worker_urls=urls, routing=router_routing, model_path=model, extra_args=mode,
                                      log_path=f"{log}.router-{policy}-{i}-{routing}")
                splitter = HotKeySplitter(len(urls), seed=args.seed) if routing == "document_split" else None
                with RouterProcess(config) as router:
                    rows.append(measure(ClusterClient(router.url, urls, splitter), policy, routing, urls))
    for row in rows:
        ref = next(r for r in rows if r["routing"] == "single" and r["policy"] == row["policy"])
        row["of_single_pct"] = (100.0 * row["cache_hit_rate_pct"] / ref["cache_hit_rate_pct"]
                                if ref["cache_hit_rate_pct"] else None)
        row["imbalance"] = imbalance(row["per_replica_requests"]) if row["routing"] != "single" else None
        row.pop("per_request")
    return {"workload": {**workload, "replicas": len(urls), "kv_pool_tokens": args.max_total_tokens,
                         "shared_chunk_dir": bool(args.shared_chunk_dir)},
            "results": rows}


def print_replicas(result: dict) -> None:
    """One row per (policy, routing): hit rate, its share of one server's, requests per replica."""
    w = result["workload"]
    print(f"\n{w['requests']} requests, {w['clients']} clients, {trace_words(w)}; {w['replicas']} replicas, KV pool "
          f"{w['kv_pool_tokens']} tokens each" + ("; one shared disk tier folder" if w.get("shared_chunk_dir") else ""))
    head = f"{'policy':<8}{'routing':<13}{'hit rate':>9}{'chunk':>8}{'of single':>10}{'req/s':>7}  {'requests per replica':<22}{'max/min':>8}"
    print(head)
    print("-" * len(head))
    for r in result["results"]:
        counts = " ".join(str(c) for c in r["per_replica_requests"])
        print(f"{r['policy']:<8}{r['routing']:<13}{r['cache_hit_rate_pct']:>8.1f}%{r['chunk_hit_rate_pct']:>7.1f}%"
              f"{common.fmt(r['of_single_pct'], '.0f'):>9}%{r['requests_per_s']:>7.2f}  {counts:<22}"
              f"{common.fmt(r['imbalance'], '.2f'):>8}")
    print("single = one replica alone (the reference); requests per replica from each replica's /metrics")


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
    return {"workload": {**trace_workload(args), "kv_pool_tokens": None if args.url else args.max_total_tokens,
                         "distinct_document_tokens": sum(doc_tokens.values())},
            "results": rows}


def print_table(result: dict) -> None:
    """The result as a plain-text table, one row per policy."""
    w = result["workload"]
    pool = f"KV pool {w['kv_pool_tokens']} tokens" if w.get("kv_pool_tokens") else "KV pool of the given server"
    print(f"\n{w['requests']} requests, {w['clients']} clients, {trace_words(w)}; {w['distinct_document_tokens']} distinct document "
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
    add_trace_args(parser)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--anchor-ratio", type=float, default=0.15)
    parser.add_argument("--pressure", action="store_true",
                        help="pool at 25%% of the working set, 16 clients: chunk hits concurrent vs sequential vs best")
    parser.add_argument("--pressure-fraction", type=float, default=0.25, help="pool / working set with --pressure")
    parser.add_argument("--tiers", action="store_true",
                        help="host tier vs pool only vs best; pre-encode, restart, replay; disk load vs compute")
    parser.add_argument("--host-cache-gb", type=float, default=2.0, help="host tier size with --tiers")
    parser.add_argument("--disk-cache-gb", type=float, default=8.0, help="disk tier bound with --tiers")
    parser.add_argument("--disk-load-tokens", type=int, default=1500,
                        help="with --tiers: tokens of each document set loaded from disk vs computed")
    parser.add_argument("--disk-load-sets", type=int, default=3, help="with --tiers: document sets timed")
    parser.add_argument("--replicas", type=int, default=1,
                        help="N >= 2: N servers behind the smg gateway, the trace through each of --routings")
    parser.add_argument("--routings", nargs="+", default=["document", "cache_aware", "round_robin"],
                        choices=["document", "document_split", "cache_aware", "round_robin"],
                        help="with --replicas; document_split: document routing with the client's hot-key "
                             "splitter (routing.HotKeySplitter), the load-aware fallback")
    parser.add_argument("--assignment-mode", default="delegate", choices=["delegate", "min_load", "min_group", "random"],
                        help="with --replicas: where the gateway places a new routing key (document routing): "
                             "delegate, its round-robin turn (balanced by design); the others follow timing "
                             "(fewest requests or keys in flight) or chance")
    parser.add_argument("--shared-chunk-dir", action="store_true",
                        help="with --replicas: the replicas share one disk tier folder (a temp folder, emptied "
                             "before each run), so a chunk one computes is a disk hit on the others")
    parser.add_argument("--replica-urls", nargs="+", default=None,
                        help="with --replicas: measure these running replicas (--enable-metrics --enable-cache-report) "
                             "instead of starting them")
    parser.add_argument("--policies", nargs="+", default=["prefix", "pic", "pic-auto", "relaxkv"],
                        help="server policies; '<policy>-auto' sends the prompts unmarked (content-defined chunking)")
    parser.epilog = ("A KV pool smaller than the working set shows evictions and the hit rate they cost, e.g. "
                     "--quick --max-total-tokens 4096 --policies pic relaxkv")
    args = common.parse_args(parser, argv, quick={"requests": 40, "clients": 2})
    given = argv if argv is not None else sys.argv[1:]
    check_trace_args(BENCH, args)
    if args.shared_chunk_dir and (args.replicas < 2 or args.replica_urls):
        common.fail(BENCH, "--shared-chunk-dir needs --replicas N (N >= 2) started here, not --replica-urls")
    if args.replica_urls and args.replicas != len(args.replica_urls):
        args.replicas = len(args.replica_urls)
    if args.replicas > 1:
        if args.url or args.pressure:
            common.fail(BENCH, "--replicas starts its own servers; drop --url / --pressure")
        if "--policies" not in given:
            args.policies = ["pic"]
        common.run_bench(BENCH, args, run_replicas, report=print_replicas)
    elif args.replicas < 1:
        common.fail(BENCH, f"--replicas {args.replicas}: must be >= 1")
    elif args.tiers:
        if args.url:
            common.fail(BENCH, "--tiers starts and restarts its own servers; drop --url")
        common.run_bench(BENCH, args, run_tiers, report=print_tiers)
    elif args.pressure:
        if "--clients" not in (argv if argv is not None else sys.argv[1:]):
            args.clients = 16
        common.run_bench(BENCH, args, run_pressure, report=print_pressure)
    else:
        common.run_bench(BENCH, args, run, report=print_table)


if __name__ == "__main__":
    main()
