"""``bench_cache_hit --replicas N``: routing over N servers behind the ``smg`` gateway.

N servers (N >= 2), each with the KV pool ``--max-total-tokens``, and the ``smg`` gateway in
front (:class:`relaxkv_sglang.server.cluster.Cluster`). The same trace is replayed under ``pic``
(``--policies``) once against one replica alone (the single-server reference) and once through
the gateway per ``--routings``: ``document`` (sticky routing keyed by the MinHash of each
request's documents, which the client sends as ``x-smg-routing-key``, a new key placed by the
gateway's round-robin turn; :mod:`relaxkv_sglang.request.routing`), ``document_split`` (the same with
the client spreading a hot key over several replicas:
:class:`~relaxkv_sglang.request.routing.HotKeySplitter`, the load-aware fallback), ``cache_aware`` and
``round_robin``, every replica flushed before each. Reported per routing: the hit rate, its
share of the single-server one, and the requests each replica served, read from each replica's
own ``/metrics`` (``sglang:num_requests_total``), not from the router.

    python -m benchmarks.bench_cache_hit --replicas 2 --model tiny-llama --quick

With ``--shared-chunk-dir`` the replicas share one disk tier folder (``RELAXKV_CHUNK_DIR``,
emptied before each run): a chunk one replica computed is a disk hit on the others. With
``--shared-mooncake`` they share a Mooncake store instead, through the HiCache tier
(:class:`~relaxkv_sglang.mooncake_service.MooncakeService` on loopback, emptied before each run;
``make install-mooncake``).

With ``--frameworks`` the trace is sent unmarked, as unchanged RAG frameworks send it (the first
of ``--shapes``, e.g. ``langchain-chat``: :mod:`benchmarks.cache_hit_frameworks`), the replicas
serving ``pic`` by default; under ``document`` routing each request carries the key of the
documents the server discovers in it (:func:`relaxkv_sglang.request.routing.add_routing_header`).

    python -m benchmarks.bench_cache_hit --replicas 4 --shared-mooncake --frameworks --shapes langchain-chat \
        --model tiny-llama --quick --topics 10 --max-total-tokens 8192
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import tempfile
import time

from benchmarks import common, metrics, tables
from benchmarks.replay import TraceRequest, make_trace, replay, trace_workload, trace_words
from relaxkv_sglang.client import ServerClient
from relaxkv_sglang.request.routing import HotKeySplitter

BENCH = "bench_cache_hit"


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


def empty_shared_store(urls: list[str], service, timeout_s: float = 120) -> None:
    """Wait until no replica has a store write pending, then remove every object of the store."""
    deadline = time.monotonic() + timeout_s
    while any(ServerClient(u).relaxkv_state().get("tier_hicache_pending_writes", 0) for u in urls):
        if time.monotonic() > deadline:
            raise RuntimeError(f"store writes still pending after {timeout_s:.0f} s")
        time.sleep(0.2)
    service.clear()


def imbalance(counts: list[int]) -> float | None:
    """max / min requests per replica (None when a replica served none)."""
    return max(counts) / min(counts) if counts and min(counts) > 0 else None


def run_replicas(args: argparse.Namespace, trace: list[TraceRequest] | None = None) -> dict:
    """The trace (``make_trace(args)`` unless given) under one policy through the router per routing,
    and against one replica alone."""
    from relaxkv_sglang.server.cluster import Cluster, RouterConfig, RouterProcess, replica_configs, replica_request_counts

    # A trace passed in (the e2e test builds its own) is not what the trace flags describe.
    workload = trace_workload(args) if trace is None else {"given": True, "requests": len(trace), "clients": args.clients}
    trace = make_trace(args) if trace is None else trace
    model = str(common.model_dir(args))
    common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    log = common.RESULTS_DIR / f"{BENCH}-{common.stamp()}.server.log"
    shared = pathlib.Path(tempfile.mkdtemp(prefix="relaxkv-bench-shared-")) if args.shared_chunk_dir else None
    env = {"RELAXKV_CHUNK_DIR": str(shared), "RELAXKV_DISK_CACHE_GB": str(args.disk_cache_gb)} if shared else {}
    stack = contextlib.ExitStack()
    store = None
    if args.shared_mooncake:
        from relaxkv_sglang.mooncake_service import MooncakeService

        store = stack.enter_context(MooncakeService(segment_mb=1024))
        env = store.env(page_kb=64)
    elif getattr(args, "mooncake_master", None):  # replicas started elsewhere on a running store: only emptied here
        from relaxkv_sglang.mooncake_service import MooncakeService

        host, _, port = args.mooncake_master.rpartition(":")
        store = MooncakeService(host=host, rpc_port=int(port))
    frameworks = bool(getattr(args, "frameworks", False))
    base = common.ServerConfig(model_path=model, max_total_tokens=args.max_total_tokens,
                               policy="pic" if frameworks else "prefix", log_path=str(log), env=env)

    def measure(client: ClusterClient, policy: str, routing: str, urls: list[str]) -> dict:
        """One replay; requests per replica from the replicas' /metrics, chunk hits from their counters."""
        if shared is not None:  # every run starts from an empty shared folder
            empty_shared_folder(urls, shared)
        if store is not None:  # or an empty shared store
            empty_shared_store(urls, store)
        requests_before, state_before = replica_request_counts(urls), client.relaxkv_state()
        if frameworks:  # policy: the shape; the replicas' default policy (pic) serves it
            from benchmarks.cache_hit_frameworks import replay_shape, server_model

            row = replay_shape(client, server_model(client), trace, policy, args, routed=routing.startswith("document"))
            row["policy"] = policy
        else:
            row = replay(client, trace, policy, args.clients, args)
        state = client.relaxkv_state()
        chunk = state.get("chunk_hit_tokens", 0) - state_before.get("chunk_hit_tokens", 0)
        row.update(routing=routing, chunk_hit_rate_pct=100.0 * metrics.hit_rate(chunk, row["prompt_tokens"]),
                   per_replica_requests=[a - b for a, b in zip(replica_request_counts(urls), requests_before)])
        row["prefix_hit_rate_pct"] = row["cache_hit_rate_pct"] - row["chunk_hit_rate_pct"]
        row["tier_loaded_tokens"] = {t: state.get(f"tier_{t}_loaded_tokens", 0) - state_before.get(f"tier_{t}_loaded_tokens", 0)
                                     for t in ("host", "disk", "hicache") if f"tier_{t}_loaded_tokens" in state}
        return row

    rows = []
    with stack:
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
        for policy in (args.shapes[:1] if frameworks else args.policies):  # one replica alone, then a router per routing
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
                         "shared_chunk_dir": bool(args.shared_chunk_dir), "frameworks": frameworks,
                         "shared_mooncake": bool(args.shared_mooncake or getattr(args, "mooncake_master", None))},
            "results": rows}


def print_replicas(result: dict) -> None:
    """One row per (policy, routing): hit rate, its share of one server's, requests per replica."""
    w = result["workload"]
    print(f"\n{w['requests']} requests, {w['clients']} clients, {trace_words(w)}; {w['replicas']} replicas, KV pool "
          f"{w['kv_pool_tokens']} tokens each" + ("; one shared disk tier folder" if w.get("shared_chunk_dir") else "")
          + ("; one shared Mooncake store" if w.get("shared_mooncake") else ""))
    columns = [tables.left("policy", 8), tables.left("routing", 13), tables.right("hit rate", 9),
               tables.right("chunk", 8), tables.right("of single", 10), tables.right("req/s", 7),
               tables.left("", 2), tables.left("requests per replica", 22), tables.right("max/min", 8)]
    tables.print_text_table(columns, [
        [r["policy"], r["routing"], f"{r['cache_hit_rate_pct']:.1f}%", f"{r['chunk_hit_rate_pct']:.1f}%",
         common.fmt(r["of_single_pct"], ".0f") + "%", f"{r['requests_per_s']:.2f}", "",
         " ".join(str(c) for c in r["per_replica_requests"]), common.fmt(r["imbalance"], ".2f")]
        for r in result["results"]])
    print("single = one replica alone (the reference); requests per replica from each replica's /metrics")
