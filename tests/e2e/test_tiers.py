"""The chunk store's host and disk tiers against real servers (tiny model).

* spill and reload: chunks evicted from a small KV pool come back from the host tier (or disk)
  and give the output of the same chunks held in the pool, bit for bit, and the greedy output of
  computing them, logprobs within float32 rounding (``RECOMPUTE_TOLERANCE``); tenant isolation
  holds in every tier; the host tier's resident memory stays within 10% of its bound (measured
  on the scheduler process);
* warm restart, faults: a server killed with ``kill -9`` while writing chunks, a corrupted
  file, a file of another model, a torn file and a dead writer's temp file in the folder; the
  server restarted on the same ``--chunk-dir`` serves the complete chunks as hits from its first
  request, each damaged one as a counted miss, always with the output of recomputing;
* ``relaxkv-sglang encode``: stored, then skipped (resumed) on a second run;
* two servers on one ``--chunk-dir`` (replicas on one host) writing at once: one whole file per
  document, each server serves the other's documents from the folder with the output of
  recomputing, and a corrupted file is a counted miss.

One launch for the first test, two for the second, which runs on demand (about 3 minutes):
``RELAXKV_TIER_TESTS=1 .venv/bin/python -m pytest -q tests/e2e/test_tiers.py``; two servers at
once for the last.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import STRICT_MEMORY_CHECK
from rag_helpers import (SERVER_START_TIMEOUT_S, documents, generate, marked_prompt, relaxkv_state, synthetic_documents,
                         wait_tier_writes)

from relaxkv_sglang.cache.chunk_key import ChunkKey
from relaxkv_sglang.cache.tiers import DiskTier, ModelIdentity
from relaxkv_sglang.server.cluster import Cluster
from relaxkv_sglang.server.launch import SGLangServer, ServerConfig

POOL = 1536  # KV tokens: about three requests' chunks, so a working set of 12+ documents spills
HOST_MB = 8


def _config(model: str, chunk_dir: pathlib.Path | None, host_mb: float = HOST_MB, **env) -> ServerConfig:
    tiers = {"RELAXKV_HOST_CACHE_GB": str(host_mb / 1024), **env}
    if chunk_dir is not None:
        tiers.update(RELAXKV_CHUNK_DIR=str(chunk_dir), RELAXKV_DISK_CACHE_GB="0.05")
    return ServerConfig(model_path=model, max_total_tokens=POOL, policy="prefix",
                        env={**STRICT_MEMORY_CHECK, **tiers},
                        extra_args=["--context-length", "1024", "--enable-metrics", "--enable-cache-report"],
                        startup_timeout_s=SERVER_START_TIMEOUT_S)


def _ask(url: str, prompt, salt: str | None = None) -> dict:
    extra = {"cache_salt": salt} if salt else {}
    return generate(url, prompt, policy="pic", max_new_tokens=6, logprobs=True, **extra)


# Output logprobs of a request with reused chunks against the same request computing them: a hit's K
# is the stored K re-rotated from where it was computed (forward/fold.py), a miss's is computed where it
# sits, so the two differ by float32 rounding, not by what a tier did (a reload is a copy: see
# _reload_is_a_copy). Measured on the tiny model: at most 3e-6 on the spill test's requests.
RECOMPUTE_TOLERANCE = 1e-5


def _logprobs(out: dict) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def _same_output(got: dict, ref: dict) -> None:
    """Greedy output identical, every output logprob within :data:`RECOMPUTE_TOLERANCE`."""
    assert got["output_ids"] == ref["output_ids"]
    a, b = _logprobs(got), _logprobs(ref)
    assert len(a) == len(b) == len(got["output_ids"]), (a, b)
    assert max(abs(x - y) for x, y in zip(a, b)) <= RECOMPUTE_TOLERANCE, (a, b)


def _reload_is_a_copy(url: str, prompt, loaded: dict, salt: str | None = None) -> None:
    """``loaded`` reused every chunk of ``prompt`` (some from a lower tier); asked again, every
    chunk is a hit in the KV pool: the output must be the same bit for bit, since a chunk loaded
    from a tier is a copy of the one the pool held."""
    rec = loaded["meta_info"]["relaxkv"]
    assert rec["chunks_hit"] == rec["chunks_seen"] > 0, rec
    again = _ask(url, prompt, salt=salt)
    rec2 = again["meta_info"]["relaxkv"]
    assert rec2["chunks_hit"] == rec2["chunks_seen"] == rec["chunks_seen"], rec2
    assert rec2["chunk_tokens_from_host"] == rec2["chunk_tokens_from_disk"] == 0, rec2
    assert rec2.get("chunk_tokens_from_hicache", 0) == 0, rec2
    assert again["output_ids"] == loaded["output_ids"]
    assert _logprobs(again) == _logprobs(loaded), (_logprobs(again), _logprobs(loaded))


def _recompute(url: str, prompt) -> dict:
    """The same prompt in a fresh namespace: every chunk computed, nothing loaded."""
    out = _ask(url, prompt, salt=f"ref-{random.random()}")
    assert out["meta_info"]["relaxkv"]["chunks_hit"] == 0
    return out


def _scheduler_rss(server: SGLangServer) -> int:
    """Resident bytes of the server's scheduler process (the one holding the tiers)."""
    from test_faults import _descendants

    best = 0
    for pid in _descendants(server.proc.pid):
        try:
            cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
            status = pathlib.Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        rss = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
        if b"scheduler" in cmd:
            return rss
        best = max(best, rss)
    return best


@pytest.mark.e2e
@pytest.mark.long
def test_spill_reload_isolation_and_host_memory_bound(tiny_model_path, tmp_path):
    docs = documents(16, seed=41)
    groups = [docs[i: i + 4] for i in range(0, 16, 4)]
    prompts = [marked_prompt("Answer from the documents.", g, f"Question {i}: what links them?")
               for i, g in enumerate(groups)]
    again = [marked_prompt("Another system prompt.", list(reversed(g)), f"Question {i} again?")
             for i, g in enumerate(groups)]
    # host tier only; plain LRU admission, so every evicted chunk is spilled (the most host-tier churn)
    with SGLangServer(_config(tiny_model_path, None, RELAXKV_HOST_CACHE_POLICY="lru")) as server:
        url = server.url
        state = relaxkv_state(url)
        assert state["tiers"] == ["device", "host"]
        for p in prompts:  # 16 documents through a pool that holds about 12: early ones spill
            assert _ask(url, p)["meta_info"]["relaxkv"]["chunks_hit"] == 0
        state = relaxkv_state(url)
        assert state["chunk_evictions"] > 0 and state["tier_host_spills"] > 0
        reloaded = []
        for p in again:
            out = _ask(url, p)
            rec = out["meta_info"]["relaxkv"]
            assert rec["chunks_hit"] == 4  # every document, from the pool or back from the host tier
            reloaded.append(rec["chunk_tokens_from_host"])
            # SGLang's own accounting puts the reloaded tokens under "host"
            assert out["meta_info"]["cached_tokens_details"]["host"] == rec["chunk_tokens_from_host"]
            _reload_is_a_copy(url, p, out)
            _same_output(out, _recompute(url, p))
        assert sum(reloaded) > 0
        s2 = relaxkv_state(url)
        assert s2["tier_host_loads"] > 0 and s2["tier_host_loaded_bytes"] > 0 and s2["tier_host_load_seconds"] > 0

        # Tenant isolation: tenant B never loads A's chunks from any tier; A's come back.
        before = relaxkv_state(url)
        b = _ask(url, again[0], salt="tenant-b")
        assert b["meta_info"]["relaxkv"]["chunks_hit"] == 0 and b["meta_info"]["cached_tokens"] == 0
        assert relaxkv_state(url)["tier_host_loads"] == before["tier_host_loads"]
        assert _ask(url, again[0])["meta_info"]["relaxkv"]["chunks_hit"] == 4

        # /metrics carries the tier counters.
        import requests

        metrics = requests.get(url + "/metrics", timeout=30).text
        assert "relaxkv:tier_host_spills" in metrics and "relaxkv:tier_host_loads" in metrics

        # Memory: push about 4x the host bound through it; the scheduler grows by at most 110% of it.
        bound = HOST_MB << 20
        rss0 = _scheduler_rss(server)
        fresh = synthetic_documents(160, seed=7)
        for i in range(0, len(fresh), 4):
            _ask(url, marked_prompt("Read these.", fresh[i: i + 4], "Q?"))
            if i % 40 == 0:  # re-use some, so the host tier serves and re-admits under pressure
                _ask(url, marked_prompt("Again.", fresh[i: i + 4][::-1], "Q2?"))
        state = relaxkv_state(url)
        rss1 = _scheduler_rss(server)
        spilled = state["tier_host_spilled_bytes"]
        print(f"host tier: bound {bound >> 20} MiB, held {state['tier_host_bytes_held'] / 2**20:.2f} MiB, "
              f"spilled {spilled / 2**20:.1f} MiB in all, {state['tier_host_evictions']} evictions, "
              f"{state['tier_host_rejected']} rejected; scheduler RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB "
              f"(+{(rss1 - rss0) / 2**20:.2f} MiB)")
        assert spilled > 2 * bound and state["tier_host_evictions"] > 0
        assert state["tier_host_bytes_held"] <= bound
        assert rss1 - rss0 <= 1.10 * bound


def _kv_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(root.rglob("*.kv"))


@pytest.mark.e2e
@pytest.mark.skipif(os.environ.get("RELAXKV_TIER_TESTS") != "1",
                    reason="about 3 minutes (two launches, kill -9, three encode runs): set RELAXKV_TIER_TESTS=1")
def test_warm_restart_after_kill_9_with_damaged_files(tiny_model_path, tmp_path, tokenizer):
    chunk_dir = tmp_path / "chunks"
    docs = documents(12, seed=43)
    stored = [marked_prompt("Answer from the documents.", docs[i: i + 3], f"Q{i}?") for i in range(0, 12, 3)]
    replays = [marked_prompt("A different system prompt.", docs[i: i + 3][::-1], f"Again {i}?")
               for i in range(0, 12, 3)]
    flood = synthetic_documents(120, seed=9)

    server = SGLangServer(_config(tiny_model_path, chunk_dir)).start()
    try:
        url = server.url
        for p in stored:
            _ask(url, p)
        wait_tier_writes(url)
        state = relaxkv_state(url)
        identity = state["tier_identity"]
        assert state["tier_disk_writes"] >= 12
        # kill -9 while writes are under way: clients keep sending new documents
        stop = threading.Event()

        def client(k: int) -> None:
            i = k * 4
            while not stop.is_set() and i + 4 <= len(flood):
                try:
                    _ask(url, marked_prompt("Flood.", flood[i: i + 4], "Q?"))
                except Exception:  # noqa: BLE001 - the server is gone
                    return
                i += 8

        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while relaxkv_state(url)["tier_disk_writes"] < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)
        stop.set()
        for t in threads:
            t.join(timeout=60)
    finally:
        server.stop()

    files = _kv_files(chunk_dir)
    assert len(files) >= 12
    # Damage: one file corrupted, one replaced by another model's file, one torn (truncated) file
    # and a dead writer's temp file.
    probe = DiskTier(chunk_dir, 1 << 30, identity, (2, 2, 2, 32), __import__("torch").float32)
    by_stem = {f.stem: f for f in files}
    doc_files = [f for f in files if probe.get(f.stem) is not None]
    assert len(doc_files) == len(files)  # every file the killed server left is whole
    # one damaged document in each of three replays
    corrupt, foreign, torn = (
        by_stem[ChunkKey(None, tokenizer.encode(docs[i], add_special_tokens=False)).content_key(identity)]
        for i in (0, 4, 8))
    data = bytearray(corrupt.read_bytes())
    data[-5] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    other = DiskTier(tmp_path / "other", 1 << 30, ModelIdentity("another-model", "tok", "torch.float32", "x"),
                     (2, 2, 2, 32), __import__("torch").float32)
    record = probe.get(foreign.stem)
    foreign.write_bytes(other.encode(foreign.stem, record))
    torn.write_bytes(torn.read_bytes()[:-100])
    tmp_file = corrupt.parent / f".tmp.{corrupt.stem}.999999.deadbeef"
    tmp_file.write_bytes(b"RKVCHNK1 half a chunk")

    with SGLangServer(_config(tiny_model_path, chunk_dir)) as again:  # warm restart, same folder
        url = again.url
        state = relaxkv_state(url)
        # the planted temp file, and any the kill -9 cut mid-write
        assert state["tier_disk_entries"] >= len(files) and state["tier_disk_stale_tmp_removed"] >= 1
        assert not tmp_file.exists()
        hits = disk_tokens = 0
        for p in replays:  # the first requests after the restart
            out = _ask(url, p)
            rec = out["meta_info"]["relaxkv"]
            hits += rec["chunks_hit"]
            disk_tokens += rec["chunk_tokens_from_disk"]
            assert out["meta_info"]["cached_tokens_details"].get("storage", 0) == rec["chunk_tokens_from_disk"]
            if rec["chunks_hit"] == rec["chunks_seen"]:  # the replay with no damaged document
                _reload_is_a_copy(url, p, out)
            _same_output(out, _recompute(url, p))
        state = relaxkv_state(url)
        print(f"after kill -9: {len(files)} files, first replay hit {hits} of 12 chunks "
              f"({disk_tokens} tokens from disk); corrupt {state['tier_disk_corrupt']}, "
              f"foreign {state['tier_disk_foreign']}")
        assert hits == 12 - 3  # all but the three damaged ones, from the first request on
        assert disk_tokens > 0 and state["tier_disk_loads"] >= 9
        assert state["tier_disk_corrupt"] == 2 and state["tier_disk_foreign"] == 1
        wait_tier_writes(url)
        # the damaged ones were removed and written again, whole, after being recomputed
        for f in (corrupt, foreign, torn):
            assert probe.get(f.stem) is not None

        # encode: a corpus already stored is skipped; new documents are stored, then skipped on a rerun
        corpus = tmp_path / "corpus.jsonl"
        new_docs = synthetic_documents(5, seed=11)
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:3] + new_docs))
        cmd = [sys.executable, "-m", "relaxkv_sglang", "encode", "--url", url, "--input", str(corpus),
               "--state", "none"]
        first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert first.returncode == 0, first.stderr
        assert "stored 5, skipped 3 (already stored), failed 0 of 8 documents" in first.stdout
        second = subprocess.run(cmd[:-2], capture_output=True, text=True, timeout=300)  # with a progress file
        assert "stored 0, skipped 8" in second.stdout, second.stdout + second.stderr
        third = subprocess.run(cmd[:-2], capture_output=True, text=True, timeout=300)  # resumed from the file
        assert "skipped 8" in third.stdout and pathlib.Path(str(corpus) + ".encoded").read_text().count("\n") == 8
        out = _ask(url, marked_prompt("Sys.", new_docs[:3], "Q?"))
        assert out["meta_info"]["relaxkv"]["chunks_hit"] == 3


@pytest.mark.e2e
@pytest.mark.long
def test_replicas_sharing_a_chunk_dir_under_concurrent_writes(tiny_model_path, tmp_path, tokenizer):
    """Two servers on one folder write at once (some documents on both: the same file from two
    processes), then each serves the other's documents from the folder with the output of
    recomputing; a corrupted file is a counted miss on the server that reads it."""
    from concurrent.futures import ThreadPoolExecutor

    chunk_dir = tmp_path / "shared"
    docs = documents(12, seed=77)
    sets_a, sets_b = [docs[0:4], docs[2:6], docs[4:8]], [docs[8:12], docs[6:10], docs[0:4]]
    with Cluster([_config(tiny_model_path, chunk_dir), _config(tiny_model_path, chunk_dir)], None) as pair:
        a, b = pair.servers  # started side by side
        def send(url: str, sets: list[list[str]]) -> None:
            for i, d in enumerate(sets):
                _ask(url, marked_prompt("Answer from the documents.", d, f"Question {i}?"))

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(send, (a.url, b.url), (sets_a, sets_b)))
        wait_tier_writes(a.url)
        wait_tier_writes(b.url)
        identity = relaxkv_state(a.url)["tier_identity"]
        assert identity == relaxkv_state(b.url)["tier_identity"]
        keys = [ChunkKey(None, tokenizer.encode(d, add_special_tokens=False)).content_key(identity) for d in docs]
        files = {f.stem: f for f in _kv_files(chunk_dir)}
        assert sorted(files) == sorted(keys)  # one whole file per document, no temp file left
        assert not list(chunk_dir.rglob(".tmp.*"))
        corrupt = files[keys[9]]  # written by b only; a reads it below
        data = bytearray(corrupt.read_bytes())
        data[-5] ^= 0xFF
        corrupt.write_bytes(bytes(data))

        # a never computed documents 8..11 (b's first set): all but the corrupted one from the folder
        cross = marked_prompt("Another system prompt.", docs[8:12][::-1], "Which one?")
        out = _ask(a.url, cross)
        rec = out["meta_info"]["relaxkv"]
        assert rec["chunks_hit"] == 3 and rec["chunk_tokens_from_disk"] == rec["chunk_tokens_reused"] > 0
        assert out["meta_info"]["cached_tokens_details"]["storage"] == rec["chunk_tokens_from_disk"]
        assert relaxkv_state(a.url)["tier_disk_corrupt"] == 1
        _same_output(out, _recompute(a.url, cross))
        # b never computed documents 2..5 except through a: from the folder too
        cross_b = marked_prompt("Another system prompt.", docs[2:6][::-1], "Which one?")
        out_b = _ask(b.url, cross_b)
        assert out_b["meta_info"]["relaxkv"]["chunks_hit"] == 4
        _reload_is_a_copy(b.url, cross_b, out_b)
        _same_output(out_b, _recompute(b.url, cross_b))
