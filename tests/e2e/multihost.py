"""A RAG deployment over several hosts (network namespaces, :mod:`hosts`), for the multi-host tests and figures.

The store's host runs ``mooncake_master`` and ``mooncake_client`` on its address; each replica host
``relaxkv-sglang serve --host ITS_ADDRESS`` with the store in its environment; each gateway host
``relaxkv-sglang gateway --host ITS_ADDRESS --worker-urls ...``: docs/scaling.md, "Several hosts".

    python -m tests.e2e.multihost --figures   # docs/scaling.md's multi-host figures (root, make install-mooncake)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Iterator, Optional, Sequence

import requests

if __package__:  # run as python -m tests.e2e.multihost
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hosts import HostNetwork, unavailable  # noqa: E402

from relaxkv_sglang.server.cluster import replica_request_counts, shared_cores_env  # noqa: E402
from relaxkv_sglang.server.launch import STRICT_MEMORY_CHECK, end_process_group  # noqa: E402
HOSTS = ["store", "a", "b", "gateway1", "gateway2"]
SERVE_PORT = GATEWAY_PORT = 30000
MASTER_PORT, HOLDER_PORT = 50051, 50052
PAGE_KB = 16
CALL_TIMEOUT_S, RECONNECT_MAX_S = 1.0, 2.0  # the replicas' store bounds (RELAXKV_HICACHE_*)
# the longest a replica takes to use a store that came back: its backoff's longest wait, a probe's and a
# connect's time, and a write's round trip, with room for a loaded 2-core machine
STORE_RESUME_BOUND_S = 30.0
START_TIMEOUT_S = 600.0
CLI = os.path.join(os.path.dirname(sys.executable), "relaxkv-sglang")


@dataclasses.dataclass
class Deployment:
    """Hosts and what runs on them; URLs as the root namespace's clients reach them."""

    net: HostNetwork
    store: object  # MooncakeService on the store's host
    replicas: dict[str, str]  # host name -> URL
    gateways: dict[str, str]  # host name -> URL
    processes: dict[str, subprocess.Popen]
    logs: dict[str, str]

    @property
    def gateway(self) -> str:
        return self.gateways["gateway1"]

    def served_by(self, before: list[int]) -> list[str]:
        """The replica hosts whose request counts grew since ``before`` (:meth:`counts`)."""
        return [name for name, b, a in zip(self.replicas, before, self.counts()) if a > b]

    def counts(self) -> list[int]:
        return replica_request_counts(list(self.replicas.values()))


def _store_env(store) -> dict[str, str]:
    return {**STRICT_MEMORY_CHECK, **store.env(page_kb=PAGE_KB),
            "RELAXKV_HICACHE_CALL_TIMEOUT_S": str(CALL_TIMEOUT_S),
            "RELAXKV_HICACHE_RECONNECT_MAX_S": str(RECONNECT_MAX_S)}


def serve_command(model: str, address: str) -> list[str]:
    """A replica host's command, as docs/scaling.md gives it."""
    return ["relaxkv-sglang", "serve", "--model", model, "--host", address, "--port", str(SERVE_PORT),
            "--policy", "pic", "--", "--enable-metrics", "--enable-cache-report"]


def gateway_command(model: str, address: str, worker_urls: list[str]) -> list[str]:
    """A gateway host's command, as docs/scaling.md gives it."""
    return ["relaxkv-sglang", "gateway", "--model", model, "--host", address, "--port", str(GATEWAY_PORT),
            "--worker-urls", *worker_urls]


@dataclasses.dataclass(frozen=True)
class ReplicaSize:
    """What the deployment adds to :func:`serve_command` on this machine: the pool and context in tokens."""

    pool_tokens: int = 4096
    context_length: int = 1024


def _as_run_here(command: list[str], log: Optional[str] = None, size: ReplicaSize = ReplicaSize()) -> list[str]:
    """A docs command as the deployment runs it: this checkout's CLI; ``serve`` with ``size``, a patient start
    and its log at ``log``."""
    command = [CLI, *command[1:]]
    if command[1] == "serve":
        cut = command.index("--")
        command = (command[:cut] + ["--max-total-tokens", str(size.pool_tokens), "--startup-timeout",
                                    str(START_TIMEOUT_S), "--log", log]
                   + command[cut:] + ["--context-length", str(size.context_length)])
    return command


def _wait_ready(url: str, path: str, proc: subprocess.Popen, log: str, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode} at startup; log {log}:\n"
                               + open(log, errors="replace").read()[-2000:])
        try:
            if requests.get(url + path, timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s (log {log})")


def why_not_here() -> Optional[str]:
    """Why this machine cannot run the deployment (one line), or None."""
    from relaxkv_sglang.mooncake_service import mooncake_binary

    why = unavailable()
    if why:
        return why
    try:
        mooncake_binary("mooncake_master")
    except FileNotFoundError as exc:
        return str(exc)
    return None


@contextlib.contextmanager
def deploy(model: str, logs_dir: str, gateways: Sequence[str] = ("gateway1", "gateway2"),
           size: ReplicaSize = ReplicaSize()) -> Iterator[Deployment]:
    """The store on its host, replicas on ``a`` and ``b``, a gateway on each of ``gateways``: docs/scaling.md's
    commands, each on its host; everything stopped and the hosts removed on exit."""
    from relaxkv_sglang.mooncake_service import MooncakeService

    with HostNetwork(HOSTS) as net:
        store_host = net["store"]
        store = MooncakeService(segment_mb=256, log_dir=logs_dir, host=store_host.address,
                                launcher=store_host.command([]), rpc_port=MASTER_PORT, holder_port=HOLDER_PORT)
        processes: dict[str, subprocess.Popen] = {}
        with store:
            try:
                env = {**os.environ, **shared_cores_env(_store_env(store))}  # the hosts share this machine's cores
                logs, replicas = {}, {}
                for name in ("a", "b"):
                    host = net[name]
                    logs[name] = os.path.join(logs_dir, f"{name}.log")
                    command = _as_run_here(serve_command(model, host.address), f"{logs[name]}.server", size)
                    processes[name] = host.popen(command, logs[name], env)
                    replicas[name] = f"http://{host.address}:{SERVE_PORT}"
                for name, url in replicas.items():
                    _wait_ready(url, "/health_generate", processes[name], logs[name])
                urls = {}
                for name in gateways:
                    host = net[name]
                    logs[name] = os.path.join(logs_dir, f"{name}.log")
                    command = _as_run_here(gateway_command(model, host.address, list(replicas.values())))
                    processes[name] = host.popen(command, logs[name], dict(os.environ))
                    urls[name] = f"http://{host.address}:{GATEWAY_PORT}"
                for name in gateways:
                    _wait_ready(urls[name], "/readiness", processes[name], logs[name])
                yield Deployment(net, store, replicas, urls, processes, logs)
            finally:
                for proc in processes.values():
                    end_process_group(proc, wait_s=60)  # serve stops its server first


# ---------------------------------------------------------------------------------------------- figures

def _timed(url: str, text: str, offsets: list[int]) -> tuple[float, dict]:
    from relaxkv_sglang.client import ServerClient

    out = ServerClient(url).generate(text, offsets, "pic", max_new_tokens=1)
    return out["client_latency_s"], out["meta_info"]["relaxkv"]


def store_load_against_compute(deployment: Deployment, sets: int = 8, docs_per_set: int = 8) -> dict:
    """Request seconds, medians over ``sets`` document sets, each sent straight to a replica: computed on ``a``
    (a cold request), then reordered under another system prompt on ``b`` (every chunk loaded from the store
    over the hosts' link), then on ``b`` again in a fresh namespace (every chunk computed there)."""
    from rag_helpers import marked_prompt, synthetic_documents

    from relaxkv_sglang.client import ServerClient

    a, b = deployment.replicas["a"], deployment.replicas["b"]
    computed, loaded, recomputed, tokens = [], [], [], []
    for i in range(sets):
        docs = synthetic_documents(docs_per_set, 900 + i)
        first = marked_prompt(f"Set {i}.", docs, "Q?")
        seconds, _ = _timed(a, first.text, first.offsets)
        computed.append(seconds)
        deadline = time.monotonic() + 60
        while ServerClient(a).relaxkv_state().get("tier_hicache_pending_writes", 0) and time.monotonic() < deadline:
            time.sleep(0.1)
        again = marked_prompt(f"Another system prompt {i}.", docs[::-1], "Q?")
        seconds, rec = _timed(b, again.text, again.offsets)
        assert rec["chunks_hit"] == docs_per_set and rec["chunk_tokens_from_hicache"] > 0, rec
        loaded.append(seconds)
        tokens.append(rec["chunk_tokens_from_hicache"])
        fresh = ServerClient(b).generate(again.text, again.offsets, "pic", max_new_tokens=1, cache_salt=f"fresh-{i}")
        assert fresh["meta_info"]["relaxkv"]["chunks_hit"] == 0
        recomputed.append(fresh["client_latency_s"])
    med = statistics.median
    return {"sets": sets, "chunks_per_set": docs_per_set, "tokens_loaded_median": med(tokens),
            "computed_on_a_s": med(computed), "loaded_on_b_s": med(loaded), "computed_on_b_s": med(recomputed),
            "loaded_over_computed": med(loaded) / med(recomputed)}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e.multihost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--figures", action="store_true", help="the store load's time and the RAG trace on two hosts")
    parser.add_argument("--model", default="tiny-llama")
    args = parser.parse_args(argv)
    if not args.figures:
        parser.error("nothing to do: --figures")
    why = why_not_here()
    if why:
        print(f"multihost: cannot run here: {why}", file=sys.stderr)
        return 1
    from relaxkv_sglang import assets

    model = str(assets.resolve_model(args.model))
    logs_dir = __import__("tempfile").mkdtemp(prefix="relaxkv-multihost-")
    with deploy(model, logs_dir, gateways=(), size=ReplicaSize(pool_tokens=8192, context_length=4096)) as deployment:
        timing = store_load_against_compute(deployment)
        print(json.dumps({"store_load_against_compute": timing}, indent=1), flush=True)
        a, b = deployment.replicas["a"], deployment.replicas["b"]
        bench = [sys.executable, "-m", "benchmarks.bench_cache_hit", "--replicas", "2", "--replica-urls", a, b,
                 "--mooncake-master", deployment.store.address, "--model", args.model, "--quick", "--topics", "10",
                 "--max-total-tokens", "8192"]
        print("multihost:", " ".join(bench), flush=True)
        return subprocess.run(bench).returncode


if __name__ == "__main__":
    sys.exit(main())
