"""Simulate N replicas behind a router: chunk hit rate and load imbalance per routing policy, no model.

A trace-driven simulation of the cluster of ``relaxkv-sglang serve --replicas N``: each replica is
the project's REAL chunk index (:class:`relaxkv_sglang.cache.pool_index.PoolChunkIndex`, through its
public API only: ``lookup`` / ``lock`` / ``unlock`` / ``insert`` / ``evict`` / ``total_tokens``) with
a KV pool of ``--pool-tokens``; the router is a model of the ``smg`` gateway's policies as
``serve --replicas`` configures them (:data:`relaxkv_sglang.server.cluster.ROUTINGS`):

* ``document``: sticky routing keyed by the MinHash of the request's documents
  (:func:`relaxkv_sglang.request.routing.routing_key_of_documents`, the key the clients send): a key seen
  before goes where it went first; a new key takes the next round-robin turn (``--assignment-mode
  delegate`` on ``round_robin``: the k-th new key to replica ``k mod N``).
* ``cache_aware``: per replica, the set of prompt prefixes it was sent (the router's approximate
  radix tree of request text, at part granularity: system prompt, each document, question; a
  part's length in characters ``= 4 x`` its tokens). With loads ``l_i`` (requests in flight), the
  cluster is imbalanced when ``max l - min l > balance_abs`` and ``max l > balance_rel x min l``:
  then the least loaded replica; else the replica with the longest matched prefix if
  ``matched / len(text) > cache_threshold``; else the replica with the smallest tree (fewest
  characters). The chosen replica's tree gets the prompt. Defaults are the router's (0.3, 64, 1.5).
* ``round_robin``: request ``i`` to replica ``i mod N``.
* ``document_split``: ``document`` with the client-side load-aware fallback
  :class:`relaxkv_sglang.request.routing.HotKeySplitter` (a key with a share ``p`` of the last 1000
  requests is spread over ``ceil(2 p N)`` sub-keys, each request to one at random).

Time is the order of the trace with ``C`` clients: request ``i`` starts when request ``i - C`` has
finished (at most ``C`` in flight, as ``C`` client threads replaying in order). At its start a
request is routed, looks its documents up in its replica's store and locks the hits (the server
locks hits from admission to the forward); when it finishes it unlocks them, inserts its misses
(a miss computed by two requests in flight at once is inserted twice: the second insert is
``PoolChunkIndex``'s duplicate) and the store evicts, in its own order, down to the pool minus the
prompt tokens of the replica's requests still in flight (their private copies). The radix prefix
before the first document (the system prompt) is a hit once the replica has served it.

Per request, ``cached = prefix hit + Σ hit document tokens``; the hit rate is ``Σ cached / Σ
prompt tokens``, the measure of ``bench_cache_hit``. Load imbalance: ``max / min`` and ``max /
mean`` of the requests each replica served. ``ideal`` is one replica with ``N x`` the pool (a
cluster whose replicas share one store; the upper bound a shared store approaches).

Two traces:

* ``--scale`` (default): synthetic, ``--requests-per-replica`` x N requests, Zipf(``--zipf``)
  popularity over ``--docs`` documents of ``~ --doc-tokens`` tokens, ``--k`` per request in random
  order, one of ``--systems`` system prompts, ``--clients-per-replica`` x N clients; for each N of
  ``--replicas``. Plots hit rate and imbalance against N.
* ``--from-bench RESULT.json``: the exact trace of a ``bench_cache_hit --replicas`` run (its
  seed, sizes and token counts from the model's tokenizer), one point per routing, next to the
  measured hit rates (the check that the simulator reproduces the measurement).

    python -m benchmarks.simulate_cluster                       # 1..64 replicas, plot
    python -m benchmarks.simulate_cluster --from-bench results/bench_cache_hit-....json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import random
import sys
from typing import Sequence

import torch

from benchmarks import common, tables
from relaxkv_sglang.cache.chunk_key import ChunkKey
from relaxkv_sglang.cache.pool_index import PoolChunkIndex
from relaxkv_sglang.request.routing import HotKeySplitter, document_hash, routing_key_of_documents

BENCH = "simulate_cluster"
ROUTINGS = ("document", "document_split", "cache_aware", "round_robin")
CHARS_PER_TOKEN = 4  # the router's tree holds characters; only ratios of lengths matter


@dataclasses.dataclass(frozen=True)
class SimRequest:
    """One request: its system prompt, its documents in prompt order, and its token counts.

    Attributes:
        system: which system prompt (an id).
        docs: document ids, in prompt order.
        prefix_tokens: tokens before the first document (the radix-cacheable prefix).
        prompt_tokens: all its prompt tokens.
        question: which question (an id; part of the text the router sees).
    """

    system: int
    docs: tuple[int, ...]
    prefix_tokens: int
    prompt_tokens: int
    question: int = 0


@dataclasses.dataclass
class Trace:
    """Requests and each document's token count (``doc_tokens[d]``)."""

    requests: list[SimRequest]
    doc_tokens: dict[int, int]
    question_tokens: int = 16


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of rank ``r`` (0-based) ``∝ 1 / (r + 1)^s``."""
    return [1.0 / (r + 1) ** s for r in range(n)]


def synthetic_trace(requests: int, docs: int, zipf: float, k: int, doc_tokens: int, systems: int,
                    seed: int, topics: int = 0) -> Trace:
    """A seeded trace: Zipf(s) over ``docs`` documents (tokens ~ uniform in ``[doc_tokens/2, 3 doc_tokens/2]``),
    ``k`` distinct per request in random order, one of ``systems`` system prompts of 24 tokens,
    a 16-token question. With ``topics = T > 0`` (as ``bench_cache_hit --topics``): Zipf(s) over
    ``T`` topics of ``docs // T`` documents, ``k`` of the request's topic uniformly."""
    rng = random.Random(seed)
    sizes = {d: rng.randint(doc_tokens // 2, 3 * doc_tokens // 2) for d in range(docs)}
    cum = list(_accumulate(zipf_weights(topics or docs, zipf)))
    size = docs // topics if topics else 0
    out = []
    for _ in range(requests):
        chosen: list[int] = []
        if topics:
            topic = rng.choices(range(topics), cum_weights=cum)[0]
            chosen = rng.sample(range(topic * size, (topic + 1) * size), k)
        while len(chosen) < k:
            d = rng.choices(range(docs), cum_weights=cum)[0]
            if d not in chosen:
                chosen.append(d)
        prefix = 24
        out.append(SimRequest(rng.randrange(systems), tuple(chosen), prefix,
                              prefix + sum(sizes[d] for d in chosen) + 2 * k + 16, rng.randrange(1000)))
    return Trace(out, sizes)


def _accumulate(xs: Sequence[float]) -> list[float]:
    total, out = 0.0, []
    for x in xs:
        total += x
        out.append(total)
    return out


def bench_trace(bench_args: dict) -> Trace:
    """The trace of a ``bench_cache_hit`` run from its recorded arguments, with the model's token counts."""
    from benchmarks import prompt_formats, replay

    args = argparse.Namespace(**bench_args)
    trace = replay.make_trace(args)
    tok = common.tokenizer(args)
    sizes = replay.document_tokens(trace, tok)
    systems = {s: i for i, s in enumerate(prompt_formats.SYSTEM_PROMPTS)}
    out = []
    for i, req in enumerate(trace):
        first = req.offsets[0]
        prefix = prompt_formats.token_count(tok, req.text[:first], special=True)
        prompt = prefix + sum(prompt_formats.token_count(tok, part) for part in _parts_after_prefix(req.text, req.offsets))
        system = next((j for s, j in systems.items() if req.text.startswith(s)), -1)
        out.append(SimRequest(system, tuple(req.doc_ids), prefix, prompt, document_hash(req.text[req.offsets[-1]:]) % 10 ** 6))
    return Trace(out, sizes)


def _parts_after_prefix(text: str, offsets: Sequence[int]) -> list[str]:
    """The documents, the glue between them and the query: the parts the server tokenizes one by one."""
    parts, pos = [], offsets[0]
    for s, e in zip(offsets[::2], offsets[1::2]):
        if s > pos:
            parts.append(text[pos:s])
        parts.append(text[s:e])
        pos = e
    parts.append(text[pos:])
    return [p for p in parts if p]


# ------------------------------------------------------------------------------- the cluster


class Replica:
    """One server: a :class:`PoolChunkIndex` over a KV pool, the system prompts its radix tree holds,
    and what it has in flight."""

    def __init__(self, pool_tokens: int, trace: Trace):
        self.pool_tokens = pool_tokens
        self.trace = trace
        self.store = PoolChunkIndex(free_slots=lambda slots: None)
        self.systems: set[int] = set()
        self.inflight_tokens = 0
        self.load = 0  # requests in flight (the router's load)
        self.served = 0

    def key(self, doc: int) -> ChunkKey:
        """Document ``doc``'s key: token ids distinct per document, its real length."""
        n = self.trace.doc_tokens[doc]
        return ChunkKey(None, tuple(range(doc << 20, (doc << 20) + n)))

    def start(self, req: SimRequest) -> tuple[int, list, list[int]]:
        """Admit ``req``: ``(cached tokens, locked hit entries, missed documents)``."""
        self.load += 1
        self.served += 1
        self.inflight_tokens += req.prompt_tokens
        cached = req.prefix_tokens if req.system in self.systems else 0
        hits, misses = [], []
        for d in req.docs:
            entry = self.store.lookup(self.key(d))
            if entry is None:
                misses.append(d)
            else:
                self.store.lock(entry)
                hits.append(entry)
                cached += entry.num_tokens
        return cached, hits, misses

    def finish(self, req: SimRequest, hits: list, misses: list[int]) -> None:
        """``req`` is done: unlock its hits, publish its misses, evict down to the free pool."""
        self.load -= 1
        self.inflight_tokens -= req.prompt_tokens
        self.systems.add(req.system)
        for entry in hits:
            self.store.unlock(entry)
        for d in misses:
            key = self.key(d)
            self.store.insert(key, torch.arange(len(key.tokens), dtype=torch.int64))
        room = max(0, self.pool_tokens - self.inflight_tokens)
        if self.store.total_tokens() > room:
            self.store.evict(self.store.total_tokens() - room)


class Router:
    """A model of one gateway policy (module doc)."""

    def __init__(self, policy: str, n: int, trace: Trace, seed: int, *, cache_threshold: float = 0.3,
                 balance_abs: int = 64, balance_rel: float = 1.5):
        if policy not in ROUTINGS:
            raise ValueError(f"unknown routing {policy!r}; choose one of {', '.join(ROUTINGS)}")
        self.policy, self.n, self.trace = policy, n, trace
        self.rng = random.Random(seed)
        self.keys: dict[str, int] = {}
        self.trees: list[set[tuple]] = [set() for _ in range(n)]
        self.tree_chars = [0] * n
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.count = 0
        self.new_keys = 0  # document routing's round-robin turns: one per new key
        self.splitter = HotKeySplitter(n, seed=seed) if policy == "document_split" else None

    def _min_load(self, loads: list[int]) -> int:
        low = min(loads)
        return self.rng.choice([i for i, load in enumerate(loads) if load == low])

    def _parts(self, req: SimRequest) -> list[tuple[tuple, int]]:
        """The prompt as (part, characters): system prompt, documents, question."""
        parts = [(("s", req.system), CHARS_PER_TOKEN * req.prefix_tokens)]
        parts += [(("d", d), CHARS_PER_TOKEN * self.trace.doc_tokens[d]) for d in req.docs]
        rest = req.prompt_tokens - req.prefix_tokens - sum(self.trace.doc_tokens[d] for d in req.docs)
        return parts + [(("q", req.question), CHARS_PER_TOKEN * max(rest, 1))]

    def route(self, req: SimRequest, loads: list[int]) -> int:
        """The replica for ``req`` given the replicas' loads (requests in flight)."""
        self.count += 1
        if self.policy == "round_robin":
            return (self.count - 1) % self.n
        if self.policy in ("document", "document_split"):
            docs = [f"document {d}" for d in req.docs]
            key = self.splitter.key(docs) if self.splitter else routing_key_of_documents(docs)
            if key not in self.keys:
                self.keys[key] = self.new_keys % self.n
                self.new_keys += 1
            return self.keys[key]
        parts = self._parts(req)
        total = sum(c for _, c in parts)
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(loads):
            choice = self._min_load(loads)
        else:
            best, best_chars = 0, -1
            for i, tree in enumerate(self.trees):
                prefix, matched = (), 0
                for part, chars in parts:
                    prefix += (part,)
                    if prefix not in tree:
                        break
                    matched += chars
                if matched > best_chars:
                    best, best_chars = i, matched
            if best_chars / total > self.cache_threshold:
                choice = best
            else:
                low = min(self.tree_chars)
                choice = self.rng.choice([i for i, c in enumerate(self.tree_chars) if c == low])
        prefix = ()
        for part, chars in parts:
            prefix += (part,)
            if prefix not in self.trees[choice]:
                self.trees[choice].add(prefix)
                self.tree_chars[choice] += chars
        return choice


def simulate(trace: Trace, replicas: int, routing: str, pool_tokens: int, clients: int, seed: int = 0,
             **router_knobs) -> dict:
    """Replay ``trace`` on ``replicas`` replicas under ``routing``.

    Returns:
        ``{"hit_rate_pct", "per_replica_requests": [int] * replicas, "max_over_min", "max_over_mean",
        "evicted_tokens", "duplicate_inserts"}``.
    """
    nodes = [Replica(pool_tokens, trace) for _ in range(replicas)]
    router = Router(routing, replicas, trace, seed, **router_knobs)
    inflight: list[tuple[Replica, SimRequest, list, list[int]]] = []
    cached_total = prompt_total = 0
    for req in trace.requests:
        if len(inflight) >= clients:
            node, done, hits, misses = inflight.pop(0)
            node.finish(done, hits, misses)
        node = nodes[router.route(req, [n.load for n in nodes])]
        cached, hits, misses = node.start(req)
        cached_total += cached
        prompt_total += req.prompt_tokens
        inflight.append((node, req, hits, misses))
    for node, done, hits, misses in inflight:
        node.finish(done, hits, misses)
    served = [n.served for n in nodes]
    stats = [n.store.stats() for n in nodes]
    return {
        "hit_rate_pct": 100.0 * cached_total / prompt_total if prompt_total else 0.0,
        "per_replica_requests": served,
        "max_over_min": max(served) / min(served) if min(served) else None,
        "max_over_mean": max(served) / (sum(served) / len(served)),
        "evicted_tokens": sum(s.evicted_tokens for s in stats),
        "duplicate_inserts": sum(s.duplicate_inserts for s in stats),
    }


# ------------------------------------------------------------------------------- the runs


def run_scale(args: argparse.Namespace) -> dict:
    """For each N: the synthetic trace of ``requests_per_replica x N`` requests under every routing, and ideal."""
    rows = []
    for n in args.replicas:
        trace = synthetic_trace(args.requests_per_replica * n, args.docs, args.zipf, args.k, args.doc_tokens,
                                args.systems, args.seed, args.topics)
        clients = args.clients_per_replica * n
        ideal = simulate(trace, 1, "round_robin", args.pool_tokens * n, clients, args.seed)
        row = {"replicas": n, "requests": len(trace.requests), "clients": clients,
               "ideal_hit_rate_pct": ideal["hit_rate_pct"]}
        for routing in args.routings:
            row[routing] = simulate(trace, n, routing, args.pool_tokens, clients, args.seed)
        rows.append(row)
        print(f"{BENCH}: {n} replicas done", file=sys.stderr, flush=True)
    return {"workload": {"docs": args.docs, "topics": args.topics, "zipf": args.zipf, "k": args.k,
                         "doc_tokens": args.doc_tokens,
                         "systems": args.systems, "pool_tokens": args.pool_tokens,
                         "requests_per_replica": args.requests_per_replica,
                         "clients_per_replica": args.clients_per_replica, "seed": args.seed},
            "routings": list(args.routings), "rows": rows}


def print_scale(result: dict) -> None:
    """Hit rate and max/mean requests per replica, one row per replica count."""
    w = result["workload"]
    topics = f" in {w['topics']} topics" if w.get("topics") else ""
    print(f"\n{w['requests_per_replica']} requests and {w['clients_per_replica']} clients per replica, {w['k']} of "
          f"{w['docs']} documents{topics} (~{w['doc_tokens']} tokens, Zipf s={w['zipf']}), KV pool {w['pool_tokens']} "
          f"tokens per replica, seed {w['seed']}")
    columns = [tables.right("replicas", 8), tables.right("ideal", 8)]
    for routing in result["routings"]:
        columns += [tables.right(routing, 16), tables.right("max/mean", 9)]
    tables.print_text_table(columns, [
        [str(row["replicas"]), f"{row['ideal_hit_rate_pct']:.1f}%"]
        + [cell for r in result["routings"] for cell in (f"{row[r]['hit_rate_pct']:.1f}%", f"{row[r]['max_over_mean']:.2f}")]
        for row in result["rows"]])
    print("hit rate = cached / prompt tokens; ideal = one store of N x the pool; max/mean = requests per replica")


def plot_scale(result: dict, path: pathlib.Path) -> None:
    """Two panels against the replica count: hit rate per routing (and ideal), and max/mean load."""
    plt = common.pyplot()
    xs = [row["replicas"] for row in result["rows"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.plot(xs, [row["ideal_hit_rate_pct"] for row in result["rows"]], "k--", label="ideal (one shared store)")
    for r in result["routings"]:
        a.plot(xs, [row[r]["hit_rate_pct"] for row in result["rows"]], "o-", label=r)
        b.plot(xs, [row[r]["max_over_mean"] for row in result["rows"]], "o-", label=r)
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("replicas")
        ax.grid(alpha=0.3)
    a.set_ylabel("cache hit rate (%)")
    a.set_title("hit rate")
    b.set_ylabel("max / mean requests per replica")
    b.set_title("load imbalance")
    a.legend(fontsize=8)
    fig.tight_layout()
    common.save_plot(fig, path)


def run_from_bench(args: argparse.Namespace) -> dict:
    """The trace of a bench_cache_hit --replicas result, simulated per routing, beside its measurement."""
    measured = json.loads(pathlib.Path(args.from_bench).read_text())
    bench_args = measured["args"]
    trace = bench_trace(bench_args)
    pool = bench_args["max_total_tokens"]
    clients = bench_args["clients"]
    rows = []
    for m in measured["results"]:
        routing = m["routing"]
        n = 1 if routing == "single" else measured["workload"]["replicas"]
        sim = simulate(trace, n, "round_robin" if routing == "single" else routing, pool, clients, args.seed)
        rows.append({"routing": routing, "policy": m["policy"], "measured_hit_rate_pct": m["cache_hit_rate_pct"],
                     "simulated_hit_rate_pct": sim["hit_rate_pct"],
                     "difference_points": sim["hit_rate_pct"] - m["cache_hit_rate_pct"],
                     "measured_per_replica": m["per_replica_requests"],
                     "simulated_per_replica": sim["per_replica_requests"]})
    return {"from_bench": str(args.from_bench), "rows": rows}


def print_from_bench(result: dict) -> None:
    """Measured vs simulated hit rate per routing."""
    print(f"\nsimulated vs measured ({result['from_bench']})")
    columns = [tables.left("routing", 13), tables.right("measured", 9), tables.right("simulated", 10),
               tables.right("diff", 7), tables.left("", 2), tables.left("measured req/replica", 22),
               tables.left("simulated", 14)]
    tables.print_text_table(columns, [
        [r["routing"], f"{r['measured_hit_rate_pct']:.1f}%", f"{r['simulated_hit_rate_pct']:.1f}%",
         f"{r['difference_points']:+.1f}", "", " ".join(map(str, r["measured_per_replica"])),
         " ".join(map(str, r["simulated_per_replica"]))] for r in result["rows"]])


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.simulate_cluster``: parse, simulate, print, write the JSON (and the plot)."""
    parser = common.bench_parser(BENCH, __doc__, server=False, quick_help="1, 2, 8 replicas, 200 requests each")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--routings", nargs="+", default=list(ROUTINGS), choices=ROUTINGS)
    parser.add_argument("--docs", type=int, default=20000, help="distinct documents")
    parser.add_argument("--zipf", type=float, default=1.0, help="popularity exponent s")
    parser.add_argument("--k", type=int, default=5, help="documents per request")
    parser.add_argument("--topics", type=int, default=0,
                        help="T > 0: Zipf over T topics of docs/T documents, a request's documents from one")
    parser.add_argument("--doc-tokens", type=int, default=150, help="mean tokens per document")
    parser.add_argument("--systems", type=int, default=3, help="distinct system prompts")
    parser.add_argument("--pool-tokens", type=int, default=32768, help="KV pool per replica")
    parser.add_argument("--requests-per-replica", type=int, default=400)
    parser.add_argument("--clients-per-replica", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--from-bench", default=None,
                        help="a bench_cache_hit --replicas result JSON: simulate its trace and compare")
    args = common.parse_args(parser, argv, quick={"replicas": [1, 2, 8], "requests_per_replica": 200})
    for name in ("docs", "k", "doc_tokens", "systems", "pool_tokens", "requests_per_replica", "clients_per_replica"):
        if getattr(args, name) < 1:
            common.fail(BENCH, f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.replicas) < 1 or args.k > args.docs:
        common.fail(BENCH, "--replicas must be >= 1 and --k <= --docs")
    if args.topics < 0 or (args.topics and args.docs // args.topics < args.k):
        common.fail(BENCH, f"--topics {args.topics}: needs 0, or topics of at least --k ({args.k}) documents")
    if args.from_bench:
        common.run_bench(BENCH, args, run_from_bench, report=print_from_bench)
    else:
        common.run_bench(BENCH, args, run_scale, report=print_scale, plot=plot_scale)


if __name__ == "__main__":
    main()
