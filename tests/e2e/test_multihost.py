"""Replicas, gateways and the Mooncake store on separate hosts (network namespaces: ``hosts.py``).

On demand, as root, after ``make install-mooncake``: ``RELAXKV_MULTIHOST_TESTS=1 .venv/bin/python -m
pytest -q -m long tests/e2e/test_multihost.py`` (``make test-long`` runs it when the switch is set; 1.5 to
3 minutes on the 2-core machine). The deployment is docs/scaling.md's "Several hosts", command for
command: the store's host runs ``mooncake_master`` and ``mooncake_client`` on its address; each
replica host runs ``relaxkv-sglang serve --host ITS_ADDRESS`` with the store's address in its
environment; each gateway host runs ``relaxkv-sglang gateway --host ITS_ADDRESS --worker-urls ...``.
Clients are in the root namespace and speak to a gateway only; what they read from the replicas
themselves (``/get_server_info``, ``/metrics``) is observation. Each host's loopback is its own, so a
process that looked for another host's service on ``127.0.0.1`` would find nothing there and the
sharing checked below would fail.

* documents computed on A are hits on B loaded from the store, with the output of computing them;
  each replica advertises its own host's address to Mooncake (not SGLang's ``localhost``);
* B's cable cut mid-workload: every request answered but those in flight on B, nothing wrong
  served, the gateway routes around B; plugged back in, B serves again and loads from the store;
* the store's cable cut, then its master and holder restarted: the replicas serve by computing,
  and sharing resumes within :data:`STORE_RESUME_BOUND_S`;
* two gateways on two hosts, one killed: a client that fails over keeps being served, and every
  chunk it sent before is still a hit (its key may move to the other replica: then from the store).

Without the switch, in ``make test``: docs/scaling.md's recipe is the deployment's commands, and the hosts
harness itself (isolation, a cut, the cleanup) where this machine can make namespaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests
from hosts import PREFIX, HostNetwork, unavailable
from multihost import (CALL_TIMEOUT_S, GATEWAY_PORT, STORE_RESUME_BOUND_S, Deployment, deploy, gateway_command,
                       serve_command, why_not_here)
from rag_helpers import documents, generate, marked_prompt, relaxkv_state, synthetic_documents, wait_tier_writes
from test_tiers import _recompute, _same_output

from relaxkv_sglang.request.routing import routing_key_of_documents
from relaxkv_sglang.server.cluster import healthy_workers

MULTIHOST_ENV = "RELAXKV_MULTIHOST_TESTS"
pytestmark = pytest.mark.e2e
on_hosts = pytest.mark.skipif(
    os.environ.get(MULTIHOST_ENV) != "1",
    reason=f"multi-host tests run on demand: {MULTIHOST_ENV}=1 (root, iproute2, make install-mooncake)")


@pytest.fixture(scope="module")
def deployment(tiny_model_path, tmp_path_factory):
    why = why_not_here()
    if why:
        pytest.skip(f"multi-host tests: {why}")
    with deploy(tiny_model_path, str(tmp_path_factory.mktemp("multihost"))) as running:
        yield running


# ---------------------------------------------------------------------------------------------- helpers

def _ask(url: str, prompt, timeout: float = 120) -> dict:
    return generate(url, prompt, policy="pic", max_new_tokens=6, logprobs=True, timeout=timeout)


def _advertised(log: str) -> str:
    """The address a replica's startup line says it advertises to Mooncake."""
    text = open(f"{log}.server", errors="replace").read()
    marker = "this host advertised as "
    assert marker in text, f"no advertised address in {log}"
    return text.split(marker, 1)[1].split(")", 1)[0]


# ---------------------------------------------------------------------------------------------- tests

@pytest.mark.long
@on_hosts
def test_documents_computed_on_one_host_are_hits_from_the_store_on_another(deployment):
    net = deployment.net
    for name in ("a", "b"):  # each replica advertises its own host's address, not localhost
        assert _advertised(deployment.logs[name]) == net[name].address
    _loads_from_the_store_on_the_other_replica(deployment, documents(4, seed=701) + synthetic_documents(60, 702),
                                               "Answer from the documents.")


class Workload:
    """Client threads sending a fixed set of prompts through a gateway in turn, until stopped; each answer is
    checked against the prompt's reference (greedy tokens); failures are kept with their time."""

    def __init__(self, urls: list[str], prompts: list, references: list[dict], clients: int = 2):
        self.urls, self.prompts, self.references = urls, prompts, references
        self.answered = 0
        self.failures: list[tuple[float, str]] = []
        self.wrong: list[str] = []
        self.partial_hits: list[tuple[float, int, int, int]] = []  # (time, prompt, chunks hit, chunks seen)
        self.store_loads: list[float] = []  # times of answers with chunks loaded from the store
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, i: int) -> None:
        n = i
        while not self._stop.is_set():
            k = n % len(self.prompts)
            for url in self.urls:  # the first gateway, then the next if it cannot be reached
                try:
                    out = _ask(url, self.prompts[k], timeout=60)
                except (requests.ConnectionError, requests.Timeout, RuntimeError) as exc:
                    if isinstance(exc, requests.ConnectionError) and url != self.urls[-1]:
                        continue
                    with self._lock:
                        self.failures.append((time.monotonic(), f"prompt {k} via {url}: {str(exc)[:200]}"))
                    break
                rec = out["meta_info"]["relaxkv"]
                with self._lock:
                    self.answered += 1
                    if rec.get("chunk_tokens_from_hicache", 0) > 0:
                        self.store_loads.append(time.monotonic())
                    if rec["chunks_hit"] < rec["chunks_seen"]:
                        self.partial_hits.append((time.monotonic(), k, rec["chunks_hit"], rec["chunks_seen"]))
                    if out["output_ids"] != self.references[k]["output_ids"]:
                        self.wrong.append(f"prompt {k}: {out['output_ids']} != {self.references[k]['output_ids']}")
                break
            n += len(self._threads)

    def __enter__(self) -> "Workload":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)


def _wait_until(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.5)
    return time.monotonic() - start


def _prompts(seed: int, n: int) -> list:
    docs = synthetic_documents(4 * n, seed)
    return [marked_prompt(f"System {seed}-{i}.", docs[4 * i:4 * i + 4], f"Question {i}?") for i in range(n)]


@pytest.mark.long
@on_hosts
def test_a_replica_host_cut_off_mid_workload_is_routed_around_and_serves_again(deployment):
    gateway, b = deployment.gateway, deployment.net["b"]
    prompts = _prompts(711, 6)
    references = [_ask(gateway, p) for p in prompts]  # six keys: three on each replica
    cut_at = restored_at = None
    with Workload([gateway], prompts, references) as work:
        time.sleep(5)
        cut_at = time.monotonic()
        b.cut()
        try:
            routed_around = _wait_until(lambda: deployment.replicas["b"] not in healthy_workers(gateway), 60,
                                        "the gateway marking b unhealthy")
            answered = work.answered
            time.sleep(10)
            assert work.answered > answered, "nothing answered while b was cut off"
        finally:
            b.restore()
            restored_at = time.monotonic()
        _wait_until(lambda: deployment.replicas["b"] in healthy_workers(gateway), 60, "the gateway taking b back")
    print(f"\nb cut off: the gateway routed around it after {routed_around:.1f} s; {work.answered} answered, "
          f"{len(work.failures)} failed: {work.failures}")
    assert not work.wrong, work.wrong
    late = [f for t, f in work.failures if not cut_at <= t <= restored_at + 60]
    assert not late, late
    assert len(work.failures) <= 2, work.failures  # at most the requests in flight on b (2 clients)
    # b serves again (once the gateway's health checks and circuit breaker let it), and loads what a computed
    _loads_from_the_store_on_the_other_replica(deployment, synthetic_documents(64, 712), "After the cut.")


def _loads_from_the_store_on_the_other_replica(deployment: Deployment, docs: list[str], system: str,
                                               timeout_s: float = 120) -> float:
    """Four of ``docs`` computed on one replica, then sent with one more of ``docs`` that makes a new key
    until the gateway places one on the other replica: that one loads the four from the store, with the
    output of computing them. The seconds it took."""
    gateway = deployment.gateway
    before = deployment.counts()
    _ask(gateway, marked_prompt(system, docs[:4], "Q?"))
    (computed_on,) = deployment.served_by(before)
    wait_tier_writes(deployment.replicas[computed_on], tier="hicache")
    start, keys = time.monotonic(), {routing_key_of_documents(docs[:4])}
    for extra in docs[4:]:
        key = routing_key_of_documents(docs[:4] + [extra])  # the key is the documents' least hash: often the same
        if key in keys:
            continue
        keys.add(key)
        prompt = marked_prompt(system + " Again.", docs[:4][::-1] + [extra], "Q?")
        before = deployment.counts()
        out = _ask(gateway, prompt)
        if deployment.served_by(before) != [computed_on]:
            break
        assert time.monotonic() - start < timeout_s, (f"no request placed off {computed_on} in {timeout_s:.0f} s "
                                                      f"(the gateway's healthy workers: {healthy_workers(gateway)})")
        time.sleep(2)
    else:
        raise AssertionError(f"every new key went to {computed_on}")
    (loaded_on,) = deployment.served_by(before)
    rec = out["meta_info"]["relaxkv"]
    assert loaded_on != computed_on and rec["chunks_hit"] >= 4 and rec["chunk_tokens_from_hicache"] > 0, rec
    _same_output(out, _recompute(gateway, prompt))
    return time.monotonic() - start


def _state(deployment: Deployment, key: str) -> dict[str, int]:
    return {name: relaxkv_state(url).get(key, 0) for name, url in deployment.replicas.items()}


@pytest.mark.long
@on_hosts
def test_the_store_host_cut_off_then_its_master_restarted(deployment):
    """The replicas serve by computing while the store is unreachable; master and holder restarted (empty) on
    the same address, sharing resumes within :data:`STORE_RESUME_BOUND_S`."""
    store_host, store = deployment.net["store"], deployment.store
    lost_before = _state(deployment, "tier_hicache_store_lost")
    store_host.cut()
    try:
        prompts = _prompts(721, 4)
        for prompt in prompts:  # each computed (nothing is loaded), with the output of computing it
            started = time.monotonic()
            out = _ask(deployment.gateway, prompt)
            took = time.monotonic() - started
            assert out["meta_info"]["relaxkv"].get("chunk_tokens_from_hicache", 0) == 0
            _same_output(out, _recompute(deployment.gateway, prompt))
            assert took < 10 * CALL_TIMEOUT_S + 10, f"a request took {took:.1f} s with the store cut off"
        store.stop()  # the store's host goes down while cut off: master and holder gone
    finally:
        store_host.restore()
    lost = _state(deployment, "tier_hicache_store_lost")
    assert any(lost[n] > lost_before[n] for n in lost), (lost_before, lost)
    reconnects_before = _state(deployment, "tier_hicache_store_reconnects")
    restarted = time.monotonic()
    store.start()  # the same address and ports, no objects
    attempt = 0
    while True:
        attempt += 1
        try:
            _loads_from_the_store_on_the_other_replica(
                deployment, synthetic_documents(64, 730 + attempt), f"After the store's restart, try {attempt}.",
                timeout_s=30)
            break
        except AssertionError as exc:
            tier = {n: {k: v for k, v in relaxkv_state(u).items() if k.startswith("tier_hicache")}
                    for n, u in deployment.replicas.items()}
            assert time.monotonic() - restarted < STORE_RESUME_BOUND_S, (
                f"sharing did not resume within {STORE_RESUME_BOUND_S:.0f} s of the store's restart: "
                f"{str(exc)[:600]}; the replicas' tier: {tier}")
    resumed = time.monotonic() - restarted
    reconnects = _state(deployment, "tier_hicache_store_reconnects")
    assert any(reconnects[n] > reconnects_before[n] for n in reconnects), (reconnects_before, reconnects)
    print(f"\nstore restarted: sharing resumed {resumed:.1f} s later ({attempt} tries)")


def _listener_pid(host, port: int) -> int:
    """The pid of the process listening on ``port`` on ``host`` (``ss -ltnp``)."""
    out = host.run(["ss", "-Hltnp", f"sport = :{port}"]).stdout
    assert "pid=" in out, out
    return int(out.split("pid=", 1)[1].split(",", 1)[0])


@pytest.mark.long
@on_hosts
def test_two_gateways_one_killed_clients_fail_over_and_keep_their_chunks(deployment):
    """A client given both gateways uses the second once the first is gone (its process killed). The second
    keeps its own routing table, so a key may now go to the other replica: its chunks then come from the store,
    and no chunk is computed again."""
    prompts = _prompts(741, 6)
    references = [_ask(deployment.gateway, p) for p in prompts]
    for url in deployment.replicas.values():
        wait_tier_writes(url, tier="hicache")
    gateways = [deployment.gateways["gateway1"], deployment.gateways["gateway2"]]
    with Workload(gateways, prompts, references) as work:
        time.sleep(5)
        killed_at = time.monotonic()
        answered_before = work.answered
        os.kill(_listener_pid(deployment.net["gateway1"], GATEWAY_PORT), signal.SIGKILL)
        time.sleep(15)
    after = [k for t, k, hit, seen in work.partial_hits if t > killed_at]
    loads = sum(t > killed_at for t in work.store_loads)
    print(f"\ngateway1 killed: {work.answered - answered_before} answered after the kill, {len(work.failures)} "
          f"failed, {len(after)} with a chunk computed again, {loads} with chunks loaded from the store "
          f"(keys the second gateway placed on the other replica)")
    assert not work.wrong, work.wrong
    assert len(work.failures) <= 2, work.failures  # at most the requests in flight on the killed gateway
    assert not after, work.partial_hits
    assert requests.get(deployment.gateways["gateway2"] + "/readiness", timeout=10).status_code == 200


def test_the_docs_recipe_is_what_the_deployment_runs():
    """docs/scaling.md's "Several hosts" commands, rendered by the deployment's own functions for the docs'
    addresses: the replica and gateway commands and the store's config exactly, the store's commands' flags
    among those the deployment passes (it adds a metrics port and a 1 s object lease)."""
    from relaxkv_sglang.mooncake_service import MooncakeService

    text = pathlib.Path(__file__).resolve().parents[2].joinpath("docs", "scaling.md").read_text()
    block = text.split("## Several hosts", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line and not line.startswith("#")]
    model, replicas = "smollm2-135m", ["http://10.0.0.2:30000", "http://10.0.0.3:30000"]
    store = MooncakeService(host="10.0.0.5", rpc_port=50051, holder_port=50052, segment_mb=65536)
    assert " ".join(serve_command(model, "10.0.0.2")) in lines
    assert " ".join(gateway_command(model, "10.0.0.4", replicas)) in lines
    assert "mooncake_client " + " ".join(store.holder_args()) in lines
    (master,) = [line for line in lines if line.startswith("mooncake_master ")]
    assert set(master.split()[1:]) <= set(store.master_args()), master
    (config,) = [line for line in lines if "EXTRA_CONFIG=" in line]
    assert json.loads(config.split("=", 1)[1].strip("'")) == store.extra_config()


def _connects(host, address: str, port: int) -> bool:
    """Whether a TCP connect from ``host`` to ``address:port`` succeeds within 2 s."""
    code = f"import socket; socket.create_connection(({address!r}, {port}), timeout=2).close()"
    return host.run([sys.executable, "-c", code], timeout_s=30).returncode == 0


@pytest.mark.skipif(unavailable() is not None, reason=f"network namespaces: {unavailable()}")
def test_the_hosts_harness_isolates_cuts_and_cleans_up():
    """Hosts reach each other on their addresses and only their own loopback; a cut host is unreachable until
    restored; closing removes every namespace and interface, and a dead run's leftovers go at the next start."""
    dead = 2 ** 22 + 12345  # above the default pid_max: never a live process
    leftover_ns, leftover_link = f"{PREFIX}{dead}-x", f"{PREFIX}{dead}b0"
    subprocess.run(["ip", "netns", "add", leftover_ns], check=True)
    subprocess.run(["ip", "link", "add", leftover_link, "type", "veth", "peer", "name", f"{PREFIX}{dead}h0"],
                   check=True)
    with contextlib.ExitStack() as cleanup, HostNetwork(["one", "two"]) as net:
        cleanup.callback(subprocess.run, ["ip", "netns", "del", leftover_ns], capture_output=True)
        cleanup.callback(subprocess.run, ["ip", "link", "del", leftover_link], capture_output=True)
        one, two = net["one"], net["two"]
        assert leftover_ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert subprocess.run(["ip", "link", "show", leftover_link], capture_output=True).returncode != 0
        server = two.popen([sys.executable, "-c", "import socket, time; s = socket.socket(); "
                            "s.bind(('0.0.0.0', 8123)); s.listen(); time.sleep(120)"], os.devnull)
        deadline = time.monotonic() + 20
        while not _connects(one, two.address, 8123):
            assert time.monotonic() < deadline and server.poll() is None, "two's listener not reachable from one"
        assert not _connects(one, "127.0.0.1", 8123)  # one's loopback is its own
        two.cut()
        assert not _connects(one, two.address, 8123)
        two.restore()
        assert _connects(one, two.address, 8123)
        made = [one.namespace, two.namespace]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert not any(ns in namespaces for ns in made) and net.prefix not in links
    assert server.poll() is not None
