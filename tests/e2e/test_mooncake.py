"""Chunks shared across servers through Mooncake, SGLang's HiCache storage backend (tiny model).

On demand: ``RELAXKV_MOONCAKE_TESTS=1 .venv/bin/python -m pytest -q tests/e2e/test_mooncake.py``
after ``make install-mooncake`` (about 5 minutes on 2 cores: five server starts). Each test runs a
``mooncake_master`` and a memory-holding ``mooncake_client`` on loopback
(:class:`~relaxkv_sglang.mooncake_service.MooncakeService`) and stops them.

* two servers sharing the store: documents computed on A are chunk hits from the ``hicache``
  tier on B's first request for them (``meta_info.relaxkv``: every chunk hit, none from the
  host or disk tier, SGLang's ``storage`` source; B's ``tier_hicache_loads``), with the output
  of recomputing; a tenant's chunks are hits only for that tenant on the other server; A
  restarted serves them from the store on its first request;
* one identity across paths, one store across page sizes: a byte-identical copy of the model
  folder at another path shares A's chunks (4/4 from the store), a server with another
  ``RELAXKV_HICACHE_PAGE_KB`` neither reads them nor skips its own writes, and shares with its kind;
* faults: the store down at start (the server serves without it, the tier down and reconnecting,
  one log line; the store coming back: ``test_mooncake_reconnect.py``); values of
  the wrong checksum, layout or size put in the store (each a counted miss, computed, the output
  of recomputing); the master killed mid-run (every request answered, misses counted).
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
from conftest import STRICT_MEMORY_CHECK
from rag_helpers import (MOONCAKE_TESTS_ENV, SERVER_START_TIMEOUT_S, documents, flush, marked_prompt, relaxkv_state,
                         wait_tier_writes)
from test_tiers import _ask, _recompute, _reload_is_a_copy, _same_output

from relaxkv_sglang.cache.chunk_key import ChunkKey
from relaxkv_sglang.cache.tiers import ChunkRecord, ValueLayout, encode_value
from relaxkv_sglang.cache.tiers.paged import page_keys, split_pages, value_key
from relaxkv_sglang.cache.tiers.value import value_info
from relaxkv_sglang.server.cluster import Cluster
from relaxkv_sglang.server.launch import SGLangServer, ServerConfig

pytestmark = pytest.mark.skipif(os.environ.get(MOONCAKE_TESTS_ENV) != "1",
                                reason="Mooncake tests run on demand: RELAXKV_MOONCAKE_TESTS=1 (make install-mooncake)")

PAGE_KB = 16  # a document's chunk (~100 tokens of 1 KiB) spans several pages
TOKEN_SHAPE = (2, 2, 2, 32)  # the tiny model: layers, K/V, KV heads, head dim


def _config(model: str, env: dict) -> ServerConfig:
    return ServerConfig(model_path=model, max_total_tokens=4096, policy="prefix",
                        env={**STRICT_MEMORY_CHECK, **env},
                        extra_args=["--context-length", "1024", "--enable-metrics", "--enable-cache-report"],
                        startup_timeout_s=SERVER_START_TIMEOUT_S)


def _wait_writes(url: str, timeout: float = 60) -> None:
    wait_tier_writes(url, timeout, tier="hicache")


def _from_store(out: dict, n_chunks: int) -> None:
    """Every chunk of the request a hit loaded from the HiCache tier (none from host or disk)."""
    rec = out["meta_info"]["relaxkv"]
    assert rec["chunks_hit"] == n_chunks and rec["chunk_tokens_reused"] > 0, rec
    assert rec["chunk_tokens_from_host"] == rec["chunk_tokens_from_disk"] == 0
    assert rec["chunk_tokens_from_hicache"] == rec["chunk_tokens_reused"], rec  # a KeyError if not reported
    assert out["meta_info"]["cached_tokens_details"]["storage"] == rec["chunk_tokens_reused"]


@pytest.fixture
def mooncake():
    from relaxkv_sglang.mooncake_service import MooncakeService

    with MooncakeService(segment_mb=256) as service:
        yield service


@pytest.mark.e2e
def test_two_servers_share_chunks_through_mooncake_and_a_restart_serves_them(tiny_model_path, mooncake):
    cfg = _config(tiny_model_path, mooncake.env(page_kb=PAGE_KB))
    docs = documents(8, seed=361)
    first = marked_prompt("Answer from the documents.", docs[:4], "What do they share?")
    again = marked_prompt("Another system prompt.", docs[:4][::-1], "Which is first?")
    tenant = marked_prompt("Answer.", docs[4:8], "Q?")
    with Cluster([cfg, _config(tiny_model_path, mooncake.env(page_kb=PAGE_KB))], None) as pair:
        a, b = pair.servers
        assert relaxkv_state(a.url)["tiers"] == ["device", "hicache"]
        assert _ask(a.url, first)["meta_info"]["relaxkv"]["chunks_hit"] == 0
        assert _ask(a.url, tenant, salt="tenant-a")["meta_info"]["relaxkv"]["chunks_hit"] == 0
        _wait_writes(a.url)
        state_a = relaxkv_state(a.url)
        assert state_a["tier_hicache_writes"] == 8 and state_a["tier_hicache_backend"] == "mooncake"

        out = _ask(b.url, again)  # B's first request for A's documents
        _from_store(out, 4)
        assert relaxkv_state(b.url)["tier_hicache_loads"] == 4
        _reload_is_a_copy(b.url, again, out)
        _same_output(out, _recompute(b.url, again))

        # tenant isolation across servers: only tenant A's requests find tenant A's chunks
        assert _ask(b.url, tenant)["meta_info"]["relaxkv"]["chunks_hit"] == 0
        assert _ask(b.url, tenant, salt="tenant-b")["meta_info"]["relaxkv"]["chunks_hit"] == 0
        _from_store(_ask(b.url, tenant, salt="tenant-a"), 4)
        assert relaxkv_state(b.url)["tier_hicache_corrupt"] == relaxkv_state(b.url)["tier_hicache_foreign"] == 0
    with SGLangServer(cfg) as restarted:  # A again, its pool empty: the store still holds its chunks
        out = _ask(restarted.url, first)
        _from_store(out, 4)
        _same_output(out, _recompute(restarted.url, first))


@pytest.mark.e2e
def test_model_folders_at_other_paths_share_and_page_sizes_keep_apart(tiny_model_path, mooncake, tmp_path):
    """Issue 48 items 1 and 3 on the real store: A serves the model folder, B a byte-identical copy
    at another path (one identity: B's first request hits 4/4 from the store); C the copy with
    another page size (its own keys: nothing foreign or corrupt, nothing skipped as present; it
    then shares with its own kind)."""
    import shutil

    copy = tmp_path / "elsewhere" / "another-name"
    shutil.copytree(tiny_model_path, copy)
    docs = documents(4, seed=363)
    first = marked_prompt("Answer from the documents.", docs, "What do they share?")
    again = marked_prompt("Another system prompt.", docs[::-1], "Which is first?")
    cfgs = [_config(tiny_model_path, mooncake.env(page_kb=PAGE_KB)), _config(str(copy), mooncake.env(page_kb=PAGE_KB)),
            _config(str(copy), mooncake.env(page_kb=2 * PAGE_KB))]
    with Cluster(cfgs, None) as trio:
        a, b, c = trio.servers
        ids = [relaxkv_state(s.url)["kv_identity"] for s in (a, b, c)]
        assert ids[0] == ids[1] == ids[2] and ids[0]["digest"] == relaxkv_state(a.url)["tier_identity"], ids
        assert str(copy) not in json.dumps(ids[1]) and "quantization" in ids[0] and "kv_cache_dtype" in ids[0]
        with open(b.log_path) as f:
            assert any("relaxkv kv identity " in line and ids[1]["digest"] in line for line in f)
        assert _ask(a.url, first)["meta_info"]["relaxkv"]["chunks_hit"] == 0
        _wait_writes(a.url)
        assert relaxkv_state(a.url)["tier_hicache_writes"] == 4

        out = _ask(b.url, again)  # another path, the same bytes: B's first request hits from the store
        _from_store(out, 4)
        _same_output(out, _recompute(b.url, again))

        out = _ask(c.url, again)  # another page size: not A's pages
        assert out["meta_info"]["relaxkv"]["chunks_hit"] == 0
        _wait_writes(c.url)
        state_c = relaxkv_state(c.url)
        assert state_c["tier_hicache_page_bytes"] == 2 * PAGE_KB << 10
        assert state_c["tier_hicache_writes"] == 4 and state_c["tier_hicache_already_present"] == 0, state_c
        assert state_c["tier_hicache_corrupt"] == state_c["tier_hicache_foreign"] == 0, state_c
        flush(c.url)  # C's pool forgets them: the store holds C's own kind
        _from_store(_ask(c.url, first), 4)
        flush(a.url)  # and A's, its kind, still
        _from_store(_ask(a.url, again), 4)
        for s in (a, b, c):
            st = relaxkv_state(s.url)
            assert st["tier_hicache_corrupt"] == st["tier_hicache_foreign"] == st["tier_hicache_incomplete"] == 0, st


def _put_value(mooncake, key: str, value: bytes) -> None:
    """Put raw value bytes under ``key`` in the store, as a writer would (pages, page 0 last)."""
    from relaxkv_sglang.cache.sglang.hicache_tier import HiCacheTierConfig

    store = HiCacheTierConfig("mooncake", mooncake.extra_config(), page_bytes=PAGE_KB << 10).connect()
    pages = split_pages(value, store.page_bytes)
    head = value_key(key, store.page_bytes)
    keys = page_keys(head, value_info(value)[1], len(pages)) + [head]
    assert all(store.put(keys, pages[1:] + pages[:1]))


@pytest.mark.e2e
def test_mooncake_faults_store_down_bad_values_and_master_killed(tiny_model_path, mooncake, tokenizer):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    down_env = mooncake.env(page_kb=PAGE_KB)
    down_env["RELAXKV_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG"] = json.dumps(
        {**mooncake.extra_config(), "master_server_address": f"127.0.0.1:{dead}"})
    docs = documents(12, seed=362)
    with Cluster([_config(tiny_model_path, down_env), _config(tiny_model_path, mooncake.env(page_kb=PAGE_KB))],
                 None) as pair:
        down, up = pair.servers
        # the store down at start: served without it (the tier down, reconnecting), one log line
        state = relaxkv_state(down.url)
        assert state["tiers"] == ["device", "hicache"] and state["tier_hicache_store_connected"] == 0
        with open(down.log_path) as f:
            lines = [line for line in f if "hicache chunk tier (backend mooncake) is unavailable" in line]
        assert len(lines) == 1 and str(dead) in lines[0]
        assert _ask(down.url, marked_prompt("Sys.", docs[:2], "Q?"))["meta_info"]["relaxkv"]["chunks_seen"] == 2

        # values that pass nothing: wrong checksum, wrong layout, wrong size (a consistent value of
        # one token less under the chunk's key); each a counted miss, computed, never served
        identity = relaxkv_state(up.url)["tier_identity"]
        layout = ValueLayout.of(identity, TOKEN_SHAPE, torch.float32, page_bytes=PAGE_KB << 10)
        bad = docs[2:5]
        keys = [ChunkKey(None, tokenizer.encode(d, add_special_tokens=False)).content_key(identity) for d in bad]
        n = [len(tokenizer.encode(d, add_special_tokens=False)) for d in bad]
        flipped = bytearray(encode_value(keys[0], ChunkRecord(torch.zeros(n[0], *TOKEN_SHAPE)), layout))
        flipped[-1] ^= 0x40
        _put_value(mooncake, keys[0], bytes(flipped))
        wide = ValueLayout.of(identity, (2, 2, 1, 64), torch.float32, page_bytes=PAGE_KB << 10)
        _put_value(mooncake, keys[1], encode_value(keys[1], ChunkRecord(torch.zeros(n[1], 2, 2, 1, 64)), wide))
        _put_value(mooncake, keys[2], encode_value(keys[2], ChunkRecord(torch.zeros(n[2] - 1, *TOKEN_SHAPE)), layout))
        prompt = marked_prompt("Answer from the documents.", bad, "Which?")
        out = _ask(up.url, prompt)
        assert out["meta_info"]["relaxkv"]["chunks_hit"] == 0
        state = relaxkv_state(up.url)  # each bad value counted once it is read (a prefetch may read it too)
        assert state["tier_hicache_corrupt"] >= 1 and state["tier_hicache_foreign"] >= 1
        assert state["tier_wrong_size"] >= 1  # its own checks pass; its size is not the chunk's
        _same_output(out, _recompute(up.url, prompt))

        # the master killed mid-run: every request answered, nothing served from the dead store
        stored = marked_prompt("Sys.", docs[5:8], "Q?")
        _ask(up.url, stored)
        _wait_writes(up.url)
        flush(up.url)  # the pool forgets them: only the store holds docs 5..7
        _from_store(_ask(up.url, marked_prompt("Other.", docs[5:8][::-1], "Q?")), 3)
        flush(up.url)
        mooncake.kill_master()
        before = relaxkv_state(up.url)
        for i, group in enumerate([docs[5:8], docs[8:12], docs[5:8][::-1], docs[9:12]]):
            out = _ask(up.url, marked_prompt(f"System {i}.", group, "Q?"))
            rec = out["meta_info"]["relaxkv"]
            assert rec["chunks_seen"] == len(group) and rec["chunk_tokens_from_disk"] == 0
            if i == 0:
                assert rec["chunks_hit"] == 0  # in the dead store only: computed
        _wait_writes(up.url, timeout=120)
        after = relaxkv_state(up.url)
        assert after["tier_hicache_hits"] == before["tier_hicache_hits"]
        failed = {k: after[k] - before[k] for k in ("tier_hicache_write_errors", "tier_hicache_errors",
                                                    "tier_hicache_unavailable", "tier_hicache_misses")}
        print("after the master was killed:", failed)
        assert failed["tier_hicache_write_errors"] + failed["tier_hicache_unavailable"] >= 1, failed
