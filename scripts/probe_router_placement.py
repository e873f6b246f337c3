"""Where does the gateway put new routing keys? A probe without a model.

Document routing (``relaxkv-sglang serve --replicas N --routing document``) relies on the ``smg``
gateway placing each new ``x-smg-routing-key`` on a replica and keeping it there. Where is
``--assignment-mode``: ``delegate`` (the project's setting, :data:`relaxkv_sglang.server.cluster.ROUTINGS`:
the next round-robin turn), ``min_load`` (the fewest requests in flight), ``min_group`` (the fewest
keys with requests in flight) or ``random``. This probe runs the real gateway (the pinned ``smg``
wheel) in front of N stand-in workers: small stdlib HTTP servers that answer the gateway's health
and model-info checks and its ``/v1/completions`` after a delay, ``--miss-ms`` on a key's first
request on that worker and ``--hit-ms`` after (how a plugin replica behaves: a cached document set
is served faster). They stand in for replicas only to time the gateway's decisions; nothing here
tests the plugin. Per trial, ``--keys`` keys are each sent ``--rounds`` times (rounds shuffled) by
``--clients`` threads, and the probe prints how many requests and keys each worker got::

    python scripts/probe_router_placement.py --mode delegate --clients 2 --trials 10 \\
        --hit-ms 20 --miss-ms 200 --warm-first   # the timing that defeats min_load
    python scripts/probe_router_placement.py --mode min_load --clients 2 --trials 10 \\
        --hit-ms 20 --miss-ms 200 --warm-first

The summary line counts the trials whose keys per worker differ by at most one (what ``delegate``
promises). Findings are in docs/scaling.md ("Balance by design"). ``tests/e2e/test_gateway_balance.py``
runs :func:`run_trial` as a test.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests

from relaxkv_sglang.request.routing import ROUTING_HEADER
from relaxkv_sglang.server.cluster import RouterConfig, RouterProcess
from relaxkv_sglang.server.launch import free_port


class StandInWorker:
    """An HTTP server the router accepts as a worker; /v1/completions sleeps, then names its port."""

    def __init__(self, hit_s: float, miss_s: float):
        self.port = free_port()
        self.seen: set[str] = set()
        self.lock = threading.Lock()
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _json(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # /health, /get_model_info, /get_server_info, /v1/models
                self._json({"model_path": "stand-in", "is_generation": True, "data": [{"id": "stand-in"}]})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                key = self.headers.get(ROUTING_HEADER, "")
                with worker.lock:
                    hit = key in worker.seen
                    worker.seen.add(key)
                time.sleep(hit_s if hit else miss_s)
                self._json({"id": "0", "object": "text_completion", "created": 0, "model": "stand-in",
                            "choices": [{"index": 0, "text": str(worker.port), "finish_reason": "length"}],
                            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def run_trial(router_url: str, ports: list[int], keys: list[str], rounds: int, clients: int,
              rng: random.Random) -> tuple[list[int], list[int], bool]:
    """One trace through the router: (requests per worker, keys per worker, every key stayed on one worker)."""
    trace = [k for _ in range(rounds) for k in rng.sample(keys, len(keys))]

    def send(key: str) -> int:
        body = {"model": "stand-in", "prompt": "x", "max_tokens": 1}
        out = requests.post(router_url + "/v1/completions", json=body, headers={ROUTING_HEADER: key}, timeout=60)
        out.raise_for_status()
        return int(out.json()["choices"][0]["text"])

    with ThreadPoolExecutor(clients) as pool:
        served = list(pool.map(send, trace))
    workers_of: dict[str, set[int]] = collections.defaultdict(set)
    for key, port in zip(trace, served):
        workers_of[key].add(port)
    per_request = collections.Counter(served)
    per_key = collections.Counter(next(iter(w)) for w in workers_of.values())
    sticky = all(len(w) == 1 for w in workers_of.values())
    return [per_request[p] for p in ports], [per_key[p] for p in ports], sticky


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["delegate", "min_load", "min_group", "random"], default="delegate")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--keys", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--hit-ms", type=float, default=50.0)
    ap.add_argument("--miss-ms", type=float, default=50.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-first", action="store_true",
                    help="the first worker has every key cached before the trace (as after bench_cache_hit's "
                         "one-replica run on the same replicas)")
    args = ap.parse_args(argv)
    if args.workers < 2 or args.keys < 1 or args.rounds < 1 or args.clients < 1 or args.trials < 1:
        ap.error("--workers must be >= 2; --keys, --rounds, --clients and --trials >= 1")
    rng = random.Random(args.seed)
    balanced = 0
    for trial in range(args.trials):
        # A fresh router and fresh workers per trial: the router's key map and the workers'
        # "cached" keys start empty, as on a new cluster.
        workers = [StandInWorker(args.hit_ms / 1e3, args.miss_ms / 1e3) for _ in range(args.workers)]
        router = RouterProcess(RouterConfig([w.url for w in workers], routing="document",
                                            extra_args=["--assignment-mode", args.mode])).start()
        try:
            keys = [f"trial{trial}-key{i}" for i in range(args.keys)]
            if args.warm_first:
                workers[0].seen.update(keys)
            reqs, keys_per, sticky = run_trial(router.url, [w.port for w in workers], keys, args.rounds,
                                               args.clients, rng)
        finally:
            router.stop()
            for w in workers:
                w.server.shutdown()
        ok = max(keys_per) - min(keys_per) <= 1
        balanced += ok
        print(f"trial {trial}: requests per worker {reqs}, keys {keys_per}, sticky {sticky}, "
              f"keys within one: {ok}", flush=True)
    print(f"{args.mode}, {args.clients} clients, hit {args.hit_ms:g} ms / miss {args.miss_ms:g} ms: "
          f"keys within one in {balanced} of {args.trials} trials")
    return 0


if __name__ == "__main__":
    sys.exit(main())
