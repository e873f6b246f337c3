"""A Mooncake store that comes back is used again (issue 48 item 4; tiny model, one server).

On demand, with the other Mooncake tests: ``RELAXKV_MOONCAKE_TESTS=1 .venv/bin/python -m pytest -q
tests/e2e/test_mooncake_reconnect.py`` (after ``make install-mooncake``; one server start).

The server starts while nothing listens at the store's master address: it serves without the
store (the ``hicache`` tier listed, ``tier_hicache_store_connected`` 0, one log line). The store
(master and memory-holding client, :class:`~relaxkv_sglang.mooncake_service.MooncakeService`) is
then started on that address, and within :data:`USED_WITHIN_S` seconds the server has reconnected
and uses it: documents it computes are written there, and after a flush a request for them
reordered loads every chunk from the store. Then the master is killed: requests are answered with
no store call waited on past the bound (``RELAXKV_HICACHE_CALL_TIMEOUT_S``), the store counted
lost; master and holder started again on the same address, and the server uses the new store
within the same bound.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
from rag_helpers import MOONCAKE_TESTS_ENV, documents, flush, marked_prompt, relaxkv_state
from test_mooncake import PAGE_KB, _config, _from_store, _wait_writes
from test_tiers import _ask, _recompute, _same_output

from relaxkv_sglang.server.launch import SGLangServer, end_process_group

pytestmark = pytest.mark.skipif(os.environ.get(MOONCAKE_TESTS_ENV) != "1",
                                reason="Mooncake tests run on demand: RELAXKV_MOONCAKE_TESTS=1 (make install-mooncake)")

CALL_TIMEOUT_S = 1.0  # RELAXKV_HICACHE_CALL_TIMEOUT_S
RECONNECT_MAX_S = 2.0  # RELAXKV_HICACHE_RECONNECT_MAX_S
USED_WITHIN_S = 20.0  # the reconnect's longest wait (2 s), a Mooncake client's setup, a busy 2-core machine


def _wait_connected(url: str, timeout_s: float) -> float:
    """Seconds until the server reports its store connected; fails past ``timeout_s``."""
    t0 = time.monotonic()
    while not relaxkv_state(url)["tier_hicache_store_connected"]:
        assert time.monotonic() - t0 < timeout_s, relaxkv_state(url)
        time.sleep(0.2)
    return time.monotonic() - t0


def _used(url: str, docs: list[str], tag: str) -> None:
    """The store is used: ``docs`` computed and written, then (the pool flushed) all loaded from it."""
    assert _ask(url, marked_prompt(f"System {tag}.", docs, "Q?"))["meta_info"]["relaxkv"]["chunks_hit"] == 0
    _wait_writes(url)
    flush(url)
    again = marked_prompt(f"Other {tag}.", docs[::-1], "Which?")
    out = _ask(url, again)
    _from_store(out, len(docs))
    _same_output(out, _recompute(url, again))


@pytest.mark.e2e
def test_a_store_started_after_the_server_is_used_within_seconds(tiny_model_path):
    from relaxkv_sglang.mooncake_service import MooncakeService

    service = MooncakeService(segment_mb=256)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        service.rpc_port = s.getsockname()[1]  # the master's address, nothing listening yet
    env = {**service.env(page_kb=PAGE_KB), "RELAXKV_HICACHE_CALL_TIMEOUT_S": str(CALL_TIMEOUT_S),
           "RELAXKV_HICACHE_RECONNECT_MAX_S": str(RECONNECT_MAX_S)}
    docs = documents(13, seed=481)
    try:
        with SGLangServer(_config(tiny_model_path, env)) as server:
            state = relaxkv_state(server.url)
            assert state["tiers"] == ["device", "hicache"] and state["tier_hicache_store_connected"] == 0
            assert state["tier_hicache_backend"] == "mooncake"
            out = _ask(server.url, marked_prompt("Sys.", docs[:2], "Q?"))  # served without the store
            assert out["meta_info"]["relaxkv"]["chunks_seen"] == 2
            assert relaxkv_state(server.url)["tier_hicache_writes"] == 0

            service.start()  # the store starts after the server
            took = _wait_connected(server.url, USED_WITHIN_S)
            print(f"store started after the server: connected {took:.1f} s later")
            _used(server.url, docs[2:5], "a")
            state = relaxkv_state(server.url)
            assert state["tier_hicache_store_reconnects"] == 1 and state["tier_hicache_store_lost"] == 0
            assert state["tier_hicache_store_reconnect_attempts"] >= 1

            # the master killed mid-run: answered, no store call waited on past the bound
            service.kill_master()
            for i, group in enumerate([docs[5:7], docs[2:5], docs[7:9]]):
                t0 = time.monotonic()
                out = _ask(server.url, marked_prompt(f"Dead {i}.", group, "Q?"))
                seconds = time.monotonic() - t0
                assert out["meta_info"]["relaxkv"]["chunks_seen"] == len(group)
                print(f"request {i} with the master dead: {seconds:.1f} s")
                # at most two store calls on the scheduler thread (page 0, the rest), each bounded,
                # and the tiny model's compute (a call against a dead master takes about 4 s)
                assert seconds < 2 * CALL_TIMEOUT_S + 2.0, seconds
            deadline = time.monotonic() + 30
            while not relaxkv_state(server.url)["tier_hicache_store_lost"]:  # the writes' put notices it
                assert time.monotonic() < deadline, relaxkv_state(server.url)
                time.sleep(0.2)
            state = relaxkv_state(server.url)
            assert state["tier_hicache_store_connected"] == 0 and state["tier_hicache_store_lost"] == 1, state
            print("with the master dead:", {k: v for k, v in state.items() if k.startswith("tier_hicache_store")})

            # master and holder again on the same address: used again
            end_process_group(service.holder)
            service.start_master()
            service.start_holder()
            took = _wait_connected(server.url, USED_WITHIN_S)
            print(f"master restarted: connected {took:.1f} s later")
            _used(server.url, docs[9:13], "b")
            assert relaxkv_state(server.url)["tier_hicache_store_reconnects"] == 2
            with open(server.log_path) as f:
                log = f.read()
            assert log.count("hicache chunk tier (backend mooncake) is unavailable") == 1
            assert log.count("hicache chunk tier (backend mooncake) is back") == 2
            assert log.count("hicache chunk tier (backend mooncake) failed") == 1
            print("store log lines:", json.dumps([line for line in log.splitlines()
                                                   if "hicache chunk tier (backend mooncake)" in line], indent=1))
    finally:
        service.stop()
