"""``bench_cache_hit --tiers``: the chunk store's lower tiers (docs/performance.md).

On a KV pool of 25% of the working set (``--pressure-fraction``) the ``pic`` trace is replayed
(1) with the pool alone, (2) with a host-memory tier (``--host-cache-gb``) below it, each against
the best possible with unlimited memory; then (3) the trace's documents are pre-encoded into a
fresh ``--chunk-dir`` with ``relaxkv-sglang encode``'s code, the server restarted on that folder
and the trace replayed once: its chunk hit rate against the best possible with every document
pre-encoded (all document tokens); and (4), on the flushed restarted server, document sets of
about ``--disk-load-tokens`` tokens are sent twice side by side: loaded from disk (default
namespace) and computed cold (``pic`` in a fresh ``cache_salt``), TTFT medians and their ratio.

    python -m benchmarks.bench_cache_hit --tiers --quick --model tiny-llama
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time
import uuid

from benchmarks import common, metrics, prompt_formats, rag_documents, tables
from benchmarks.cache_hit_pressure import context_length_for, sized_trace
from benchmarks.replay import best_possible_pct, replay, trace_workload, trace_words
from relaxkv_sglang.client import ServerClient

BENCH = "bench_cache_hit"


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
    from relaxkv_sglang.encode import encode_corpus  # the encoder pulls in the HTTP stack only here

    trace, tokenizer, doc_tokens, working_set, lengths = sized_trace(args)
    target = args.disk_load_tokens
    context = context_length_for(max(max(lengths), target + 200))
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
    docs = rag_documents.document_pool(args.source, args.pool, args.seed)
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
        sizes = [prompt_formats.token_count(tokenizer, docs[d]) for d in used]
        sets = doc_sets([docs[d] for d in used], sizes, target, args.disk_load_sets)
        question = prompt_formats.question_text("What do these documents have in common?")
        system = prompt_formats.SYSTEM_PROMPTS[0]
        warm_text, warm_offsets = prompt_formats.marked_text(system, ["A warm-up document."], question)
        client.generate(warm_text, warm_offsets, "pic", max_new_tokens=1)
        timing = []
        for k, chosen in enumerate(sets):
            text, offsets = prompt_formats.marked_text(system, [docs[used[i]] for i in chosen], question)
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
    columns = [tables.left("replay", 26), tables.right("chunk hit", 10), tables.right("best", 8),
               tables.right("of best", 9), tables.right("from host", 11), tables.right("from disk", 11),
               tables.right("req/s", 7), tables.right("TTFT p50", 9)]
    tables.print_text_table(columns, [
        [name, f"{r['chunk_hit_rate_pct']:.1f}%", f"{r['best_pct']:.1f}%", common.fmt(r["of_best"], ".0%"),
         str(r["chunk_tokens_from_host"]), str(r["chunk_tokens_from_disk"]), f"{r['requests_per_s']:.2f}",
         f"{r['ttft_s']['p50']:.2f}"] for name, r in result["tiers"].items()])
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
