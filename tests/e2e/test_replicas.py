"""Two replicas behind the smg gateway (tiny model): ``relaxkv-sglang serve --replicas 2``.

One cluster for the module, started by the CLI as a user would; in order:

* document routing keeps the single-server hit rate (>= 90% of it) with requests per replica
  exactly 20/20 on an equal-weight topical trace of 10 keys (the gateway's round-robin turn per new
  key), measured by the benchmark's own ``run_replicas`` (counts from each replica's /metrics);
* bad input through the gateway gets the same 4xx as directly (``/v1/completions`` and ``/generate``);
* a LangChain chat request (documents inline in a string) is routed by the documents the server
  discovers in it: the same documents reordered go to the same replica and are chunk hits there;
* a replica killed mid-trace: the router stops sending to it, errors stay few and the survivor
  serves the rest;
* SIGTERM stops the CLI, the router and the replicas: no process left.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests

from relaxkv_sglang.client import ServerClient
from relaxkv_sglang.server.cluster import replica_request_counts, router_installed
from relaxkv_sglang.server.launch import free_port

pytestmark = [pytest.mark.skipif(not router_installed(), reason="smg (the gateway) not installed (make install)"),
              pytest.mark.long]  # a gateway and two replicas: ~70 s in all

POOL_TOKENS = 8192


class CliCluster:
    """``relaxkv-sglang serve --replicas 2`` in a subprocess; its URLs read from its output."""

    def __init__(self, model_path: str):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relaxkv_sglang", "serve", "--replicas", "2", "--model", model_path,
             "--port", str(self.port), "--max-total-tokens", str(POOL_TOKENS), "--", "--context-length", "4096"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.replicas: list[str] = []
        self.url: str | None = None
        self.stderr: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.stderr.append(line.rstrip())
            if line.startswith("replica "):
                self.replicas.append(line.split()[2])
            if line.startswith("ready: "):
                self.url = line.split()[1]
                self._ready.set()

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("serve --replicas did not start:\n" + "\n".join(self.stderr[-20:]))

    def processes(self) -> list[psutil.Process]:
        top = psutil.Process(self.proc.pid)
        return [top] + top.children(recursive=True)

    def stop(self) -> None:
        """Stop it the way a user would, if still running (a failed test may leave it so)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                for p in self.processes():
                    p.kill()


# Not launched at the session's start with the other servers (conftest): with its two replicas and
# router starting beside them the first modules' tests ran slower (one run: 9:51 for the suite,
# against 8:52 without).
@pytest.fixture(scope="module")
def cluster(tiny_model_path):
    c = CliCluster(tiny_model_path)
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


def _trace_args(**over) -> argparse.Namespace:
    from relaxkv_sglang import assets

    args = dict(source="hotpotqa", pool=60, zipf=0.5, docs_per_request=5, requests=40, clients=4, seed=1,
                topics=12, max_new_tokens=4, anchor_ratio=0.15, pressure=False, policies=["pic"],
                routings=["document"], assignment_mode="delegate", replicas=2, model=str(assets.model_path("tiny-llama")),
                max_total_tokens=POOL_TOKENS, url=None, replica_urls=None, shared_chunk_dir=False, shared_mooncake=False,
                disk_cache_gb=8.0)
    args.update(over)
    return argparse.Namespace(**args)


def _balanced_trace(topics: int = 10, rounds: int = 4, seed: int = 1) -> list:
    """Every topic (5 HotpotQA paragraphs) asked ``rounds`` times, rounds shuffled; each request its
    topic's documents in a new order, a random system prompt and question: equal-weight keys."""
    import random

    from benchmarks import prompt_formats, rag_documents
    from benchmarks.replay import TraceRequest

    docs = rag_documents.document_pool("hotpotqa", 5 * topics, seed)
    rng = random.Random(seed)
    trace = []
    for _ in range(rounds):
        for topic in rng.sample(range(topics), topics):
            ids = rng.sample(range(5 * topic, 5 * topic + 5), 5)
            trace.append(TraceRequest(rng.choice(prompt_formats.SYSTEM_PROMPTS), [docs[i] for i in ids],
                                      prompt_formats.question_text(f"What links topic {rng.randrange(99)}?"), ids))
    return trace


def test_document_routing_keeps_the_single_server_hit_rate(cluster, tmp_path, monkeypatch):
    """Hit rate >= 90% of one server's; requests per replica exactly 20/20.

    The balance is the policy's, not the timing's: the gateway places each NEW routing key by its
    round-robin turn (``--assignment-mode delegate`` on ``round_robin``; a key seen before keeps its
    replica and takes no turn), so the trace's 10 distinct keys (one per topic: the topics share no
    document, so no two MinHash keys are equal) go 5 and 5, and with 4 requests each the replicas
    serve 20 and 20, in every run. Under sglang-router's ``min_load`` (new keys to the fewest
    requests in flight) this trace split 28/12 or worse in about a third of the replays.
    """
    from benchmarks import cache_hit_replicas, common
    from relaxkv_sglang.request.routing import routing_key_of_documents

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)  # the routers' logs
    trace = _balanced_trace()
    assert len({routing_key_of_documents(req.documents) for req in trace}) == 10  # the premise of 20/20
    args = _trace_args(replica_urls=cluster.replicas, clients=2, routings=["document"])
    result = cache_hit_replicas.run_replicas(args, trace)
    cache_hit_replicas.print_replicas(result)
    single = next(r for r in result["results"] if r["routing"] == "single")
    (routed,) = [r for r in result["results"] if r["routing"] == "document"]
    assert single["per_replica_requests"] == [40, 0]
    assert single["cache_hit_rate_pct"] > 10  # the trace reuses documents at all
    assert routed["per_replica_requests"] == [20, 20], routed
    assert routed["cache_hit_rate_pct"] >= 0.9 * single["cache_hit_rate_pct"], routed


def test_bad_input_through_the_router_gets_the_same_4xx(cluster):
    text = "A document about ships.\n\nQuestion: which?\nAnswer:"
    bad = [{"relaxkv_chunks": [0, 10 ** 6]}, {"relaxkv_typo": 1}, {"relaxkv_policy": "nope"},
           {"relaxkv_anchor_ratio": 2}, {"_relaxkv_policy": "pic"}]
    model = requests.get(cluster.url + "/v1/models", timeout=30).json()["data"][0]["id"]  # the gateway routes by it
    for custom in bad:
        body = {"model": model, "prompt": text, "max_tokens": 2, "custom_params": custom}
        routed = requests.post(cluster.url + "/v1/completions", json=body, timeout=120)
        direct = requests.post(cluster.replicas[0] + "/v1/completions", json=body, timeout=120)
        assert routed.status_code == direct.status_code == 400, (custom, routed.text[:200])
        assert routed.json()["message"] == direct.json()["message"]
    # smg forwards /generate's sampling_params.custom_params (sglang-router 0.3.2 dropped them, serving
    # such requests unvalidated and without reuse), so /generate is refused alike through the gateway.
    body = {"text": text, "sampling_params": {"max_new_tokens": 2, "custom_params": {"relaxkv_typo": 1}}}
    direct = requests.post(cluster.replicas[0] + "/generate", json=body, timeout=120)
    routed = requests.post(cluster.url + "/generate", json=body, timeout=120)
    assert routed.status_code == direct.status_code == 400, routed.text[:200]
    assert "relaxkv_typo" in routed.text


def test_a_langchain_chat_request_is_routed_by_its_discovered_documents(cluster, tiny_model_path):
    """LangChain's ``ChatOpenAI`` as its RAG tutorial writes it (the documents joined by blank lines in
    the system message's string content), its HTTP client given ``routing.add_routing_header`` as an
    event hook: each request carries the key of the documents the server discovers, so the same
    documents reordered under another question go to the replica that computed them and are chunk
    hits there; another document set is a new key, the gateway's next turn (the other replica)."""
    import json

    import httpx
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI
    from transformers import AutoTokenizer

    from benchmarks import rag_documents
    from relaxkv_sglang.request.routing import ROUTING_HEADER, add_routing_header, routing_key_of_documents
    from relaxkv_sglang.server.cluster import replica_request_counts

    model = requests.get(cluster.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    sent, usage = [], []

    def record_request(request: httpx.Request) -> None:
        sent.append(request.headers.get(ROUTING_HEADER))

    def record_response(response: httpx.Response) -> None:
        response.read()
        usage.append(json.loads(response.content)["usage"])

    client = httpx.Client(event_hooks={"request": [add_routing_header, record_request], "response": [record_response]},
                          timeout=120)
    llm = ChatOpenAI(model=model, base_url=cluster.url + "/v1", api_key="none", max_tokens=4, temperature=0,
                     http_client=client, extra_body={"custom_params": {"relaxkv_policy": "pic"}})
    system = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
              "to answer the question. If you don't know the answer, say that you don't know.\n\n{context}")
    chain = ChatPromptTemplate.from_messages([("system", system), ("human", "{input}")]) | llm
    docs = rag_documents.document_pool("hotpotqa", 10, 48)
    sets = [docs[:5], docs[5:]]
    served = []
    for question, reorder in [("What do they share?", lambda d: d), ("Which is oldest?", lambda d: d[2:] + d[:2][::-1])]:
        for doc_set in sets:
            before = replica_request_counts(cluster.replicas)
            chain.invoke({"context": "\n\n".join(reorder(doc_set)), "input": question})
            after = replica_request_counts(cluster.replicas)
            served.append([i for i, (a, b) in enumerate(zip(before, after)) if b > a])
    keys = [routing_key_of_documents(d) for d in sets]
    assert sent == keys + keys and None not in keys, sent  # the documents' keys, discovered in the string
    assert len(served[0]) == len(served[1]) == 1 and served[0] != served[1], served  # two keys, two turns
    assert served[2:] == served[:2], served  # each set again on its replica
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    for first, again, doc_set in zip(usage[:2], usage[2:], sets):
        doc_tokens = sum(len(tokenizer.encode(d, add_special_tokens=False)) for d in doc_set)
        cached = again["prompt_tokens_details"]["cached_tokens"]
        print(f"reordered on its replica: cached {cached} of {again['prompt_tokens']} prompt tokens "
              f"(documents {doc_tokens}; first time {first['prompt_tokens_details']['cached_tokens']})")
        assert cached >= 0.9 * doc_tokens, (cached, doc_tokens)


def test_a_replica_killed_mid_trace(cluster):
    from benchmarks import replay

    trace = replay.make_trace(_trace_args(seed=2, requests=36))
    client = ServerClient(cluster.url, timeout=120)
    victim_url = cluster.replicas[1]
    port = int(victim_url.rsplit(":", 1)[1])
    (victim,) = [c.pid for c in psutil.net_connections("tcp")
                 if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN]
    killed_at: list[float] = []

    def one(i: int) -> tuple[int, float, float, bool, int]:
        req = trace[i]
        if i == 12 and not killed_at:
            os.killpg(os.getpgid(victim), signal.SIGKILL)
            killed_at.append(time.monotonic())
        start = time.monotonic()
        try:
            out = client.generate(req.text, req.offsets, "pic", max_new_tokens=4)
            return i, start, time.monotonic(), True, out["meta_info"]["cached_tokens"]
        except RuntimeError:
            return i, start, time.monotonic(), False, 0

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, range(len(trace))))
    (kill,) = killed_at
    # once the health checks have had time (5 s x 2), requests 12-23 again: their keys,
    # the dead replica's among them, now all go to the survivor
    time.sleep(max(0.0, kill + 16 - time.monotonic()))
    with ThreadPoolExecutor(2) as pool:
        results += list(pool.map(one, range(12, 24)))
    # the router took the replica out: /workers says so, and every request sent 15 s after the kill succeeded
    workers = requests.get(cluster.url + "/workers", timeout=30).json()["workers"]
    health = {w["url"].rstrip("/"): w["is_healthy"] for w in workers}
    assert health == {cluster.replicas[0]: True, victim_url: False}
    failed = [r for r in results if not r[3]]
    late = [r for r in results if r[1] > kill + 15]
    assert late and all(r[3] for r in late)
    # errors: only requests sent while the gateway still counted the dead replica available. By
    # arithmetic, not timing: the 2 requests in flight at the kill, plus those whose 5 attempts
    # (--retry-max-retries) fail before the 10 failures that open the replica's circuit, at most 2
    # (the health checks, 5 s x 2, take it out sooner if the breaker has not): 4 at most.
    assert all(kill - 30 < r[1] < kill + 15 for r in failed), failed
    assert len(failed) <= 4, failed
    # the survivor keeps serving with its cache: requests after the kill still reuse cached tokens
    assert sum(r[4] for r in results if r[1] > kill and r[3]) > 0
    print(f"replica killed: {len(failed)} of {len(results)} requests failed "
          f"(sent {[round(r[1] - kill, 1) for r in failed]} s after the kill)")


def test_sigterm_stops_everything(cluster):
    procs = cluster.processes()
    assert len(procs) >= 4  # the CLI, the router, the surviving replica and its children
    cluster.proc.send_signal(signal.SIGTERM)
    gone, alive = psutil.wait_procs(procs, timeout=90)
    assert alive == [], [(p.pid, p.name()) for p in alive]
    (cli,) = [p for p in gone if p.pid == cluster.proc.pid]
    assert cli.returncode == 0  # a clean stop (psutil reaped it, so Popen cannot tell)
