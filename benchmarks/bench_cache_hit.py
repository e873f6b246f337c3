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

Three more measurements share the trace and the replay (:mod:`benchmarks.replay`), each in its
own module: ``--pressure`` (:mod:`benchmarks.cache_hit_pressure`: the chunk tree on a pool at 25%
of the working set, concurrent vs sequential vs the best with that pool), ``--tiers``
(:mod:`benchmarks.cache_hit_tiers`: host and disk tiers, pre-encoding, disk load vs compute) and
``--replicas N`` (:mod:`benchmarks.cache_hit_replicas`: N servers behind the ``smg`` gateway, per
routing).

    python -m benchmarks.bench_cache_hit --pressure --model tiny-llama
    python -m benchmarks.bench_cache_hit --tiers --quick --model tiny-llama
    python -m benchmarks.bench_cache_hit --replicas 2 --model tiny-llama --quick

With ``--replicas N --frameworks`` the replicas get the trace unmarked in one framework's shape
(``--shapes``, default ``langchain-chat``), routed by the documents the server discovers in it.

``--frameworks`` (:mod:`benchmarks.cache_hit_frameworks`) sends the trace unmarked in the prompt
shapes of LangChain, LlamaIndex (chat and completion) and the OpenAI SDK, beside the same trace as
content parts, to a server whose default policy is ``pic``: each shape's hit rate against its best
possible and against the content-parts trace's.

    python -m benchmarks.bench_cache_hit --frameworks --model tiny-llama --max-total-tokens 32768
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import common, tables
from benchmarks.cache_hit_frameworks import SHAPES, print_frameworks, run_frameworks
from benchmarks.cache_hit_pressure import print_pressure, run_pressure
from benchmarks.cache_hit_replicas import print_replicas, run_replicas
from benchmarks.cache_hit_tiers import print_tiers, run_tiers
from benchmarks.replay import (add_trace_args, best_possible_pct, check_trace_args, document_tokens, make_trace,
                               replay, trace_workload, trace_words)

BENCH = "bench_cache_hit"


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
    tp = ["--tp-size", str(args.tp_size)] if args.tp_size > 1 else []
    with common.bench_client(args, BENCH, extra_args=tp) as client:
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
    columns = [tables.left("policy", 10), tables.right("hit rate", 9), tables.right("prefix", 8),
               tables.right("chunk", 8), tables.right("best", 8), tables.right("req/s", 7), tables.right("tok/s", 8),
               tables.right("TTFT mean", 10), tables.right("p50", 7), tables.right("p90", 7), tables.right("p99", 7),
               tables.right("evicted", 9), tables.right("lost", 8), tables.right("evictions", 10),
               tables.right("in flight", 10)]
    rows = []
    for r in result["results"]:
        t = r["ttft_s"]
        rows.append([r["policy"]] + [f"{r[k]:.1f}%" for k in ("cache_hit_rate_pct", "prefix_hit_rate_pct",
                                                             "chunk_hit_rate_pct", "best_possible_hit_rate_pct")]
                    + [f"{r['requests_per_s']:.2f}", f"{r['tokens_per_s']:.0f}"]
                    + [f"{t[k]:.2f}" for k in ("mean", "p50", "p90", "p99")] + [str(r["chunk_evictions"])]
                    + [common.fmt(r[k], ".1f") + ("%" if r[k] is not None else "")
                       for k in ("hit_rate_lost_pct", "lost_to_evictions_pct", "lost_in_flight_pct")])
    tables.print_text_table(columns, rows)
    print("lost = best possible - chunk hit rate; evictions = seen-before document tokens missed (at least); "
          "in flight = the rest")
    for r in result["results"]:
        if r.get("repair_stages"):
            share = r["collective_share_of_repair"]
            print(f"{r['policy']}: {r['repair_stages']} repair stages in {r['repair_seconds']:.2f} s on rank 0 "
                  f"(TP={r['tp_size']}); the plugin's collectives {r['collective_calls']} calls, "
                  f"{r['collective_seconds']:.3f} s"
                  + (f" ({100 * share:.1f}% of the repair)" if share is not None else ""))


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.bench_cache_hit``: parse the flags, measure, print, write the JSON."""
    parser = common.bench_parser(BENCH, __doc__, quick_help="40 requests, 2 clients")
    add_trace_args(parser)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--tp-size", type=int, default=1,
                        help="tensor-parallel ranks of the started server (on a CPU, one core group each: the "
                             "launcher sets SGLANG_CPU_OMP_THREADS_BIND)")
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
    parser.add_argument("--shared-mooncake", action="store_true",
                        help="with --replicas: the replicas share a Mooncake store (started here on loopback, "
                             "emptied before each run) through the HiCache tier; make install-mooncake")
    parser.add_argument("--replica-urls", nargs="+", default=None,
                        help="with --replicas: measure these running replicas (--enable-metrics --enable-cache-report) "
                             "instead of starting them")
    parser.add_argument("--mooncake-master", default=None, metavar="HOST:PORT",
                        help="with --replica-urls: the replicas' running Mooncake store (emptied before each run "
                             "through its master), e.g. replicas on several hosts (docs/scaling.md)")
    parser.add_argument("--frameworks", action="store_true",
                        help="the trace unmarked in each RAG framework's prompt shape (LangChain, LlamaIndex chat "
                             "and completion, OpenAI SDK [n] list) vs content parts, server default policy pic")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES),
                        help="with --frameworks: the prompt shapes sent")
    parser.add_argument("--policies", nargs="+", default=["prefix", "pic", "pic-auto", "relaxkv"],
                        help="server policies; '<policy>-auto' sends the prompts unmarked (content-defined chunking), "
                             "'<policy>@auto' asks for relaxkv_budget auto")
    parser.epilog = ("A KV pool smaller than the working set shows evictions and the hit rate they cost, e.g. "
                     "--quick --max-total-tokens 4096 --policies pic relaxkv")
    args = common.parse_args(parser, argv, quick={"requests": 40, "clients": 2})
    given = argv if argv is not None else sys.argv[1:]
    check_trace_args(BENCH, args)
    if args.shared_chunk_dir and args.shared_mooncake:
        common.fail(BENCH, "--shared-chunk-dir or --shared-mooncake, not both")
    for flag in ("shared_chunk_dir", "shared_mooncake"):
        if getattr(args, flag) and (args.replicas < 2 or args.replica_urls):
            common.fail(BENCH, f"--{flag.replace('_', '-')} needs --replicas N (N >= 2) started here, not --replica-urls")
    if args.mooncake_master and not args.replica_urls:
        common.fail(BENCH, "--mooncake-master needs --replica-urls (replicas already running on that store)")
    if args.replica_urls and args.replicas != len(args.replica_urls):
        args.replicas = len(args.replica_urls)
    if args.replicas > 1:
        if args.url or args.pressure:
            common.fail(BENCH, "--replicas starts its own servers; drop --url / --pressure")
        if "--policies" not in given:
            args.policies = ["pic"]
        if args.frameworks and "--shapes" not in given:  # the trace as LangChain sends it
            args.shapes = ["langchain-chat"]
        common.run_bench(BENCH, args, run_replicas, report=print_replicas)
    elif args.replicas < 1:
        common.fail(BENCH, f"--replicas {args.replicas}: must be >= 1")
    elif args.frameworks:
        if args.pressure or args.tiers:
            common.fail(BENCH, "--frameworks: drop --pressure / --tiers")
        common.run_bench(BENCH, args, run_frameworks, report=print_frameworks)
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
