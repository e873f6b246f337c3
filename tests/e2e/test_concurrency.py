"""Many concurrent clients over a shared document pool, with a KV pool smaller than the working set."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import STRICT_MEMORY_CHECK, start_server
from rag_helpers import SERVER_START_TIMEOUT_S, documents, flush, generate, marked_prompt, relaxkv_state

from relaxkv_sglang.server.launch import ServerConfig

pytestmark = pytest.mark.e2e

POOL_TOKENS = 4096  # 40 documents (~3,900 tokens) + 16 running requests (~420 each) do not fit
REQUESTS, CLIENTS = 200, 16


def small_pool_config(model_path: str) -> ServerConfig:
    return ServerConfig(model_path=model_path, max_total_tokens=POOL_TOKENS, policy="pic",
                        env=STRICT_MEMORY_CHECK, extra_args=["--context-length", "2048"],
                        startup_timeout_s=SERVER_START_TIMEOUT_S)


start_small_pool = start_server(small_pool_config)


PRESTART_SERVERS = {"small_pool_server": start_small_pool}  # launched at the session's start (conftest)


@pytest.fixture(scope="module")
def small_pool_server(tiny_model_path, prestart):
    with prestart.serving("small_pool_server", lambda: start_small_pool(tiny_model_path)) as srv:
        yield srv


def _workload(seed: int = 0):
    rng = random.Random(seed)
    pool = documents(40, seed=11)
    systems = ["You are a helpful assistant.", "Answer in one word.", "Use the documents."]
    prompts = []
    for i in range(REQUESTS):
        docs = rng.sample(pool, 4)
        prompts.append(marked_prompt(rng.choice(systems), docs, f"Question {i}: what is the topic?"))
    return prompts


@pytest.mark.long
def test_concurrent_clients_match_sequential_and_return_every_slot(small_pool_server):
    url = small_pool_server.url
    prompts = _workload()
    start = time.perf_counter()
    sequential_responses = [generate(url, p, max_new_tokens=4) for p in prompts]
    sequential_wall = time.perf_counter() - start
    sequential = [r["output_ids"] for r in sequential_responses]
    flush(url)

    start = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        responses = list(pool.map(lambda p: generate(url, p, max_new_tokens=4, timeout=300), prompts))
    concurrent_wall = time.perf_counter() - start

    assert [r["output_ids"] for r in responses] == sequential
    hits = sum(r["meta_info"]["relaxkv"]["chunks_hit"] for r in responses)
    sequential_hits = sum(r["meta_info"]["relaxkv"]["chunks_hit"] for r in sequential_responses)
    state = relaxkv_state(url)
    print(f"chunk hits: concurrent {hits}, sequential {sequential_hits} of {4 * REQUESTS}; "
          f"computed twice: {state['chunk_duplicate_computes']}; wall: concurrent {concurrent_wall:.1f} s, "
          f"sequential {sequential_wall:.1f} s")
    assert sequential_hits > REQUESTS  # documents recur: one at a time, most chunks hit
    # Hits found at admission stay pinned until the fold, and admission does not evict
    # chunks queued requests need while others run (docs/reliability.md).
    assert hits >= 0.9 * sequential_hits
    assert state["chunk_evictions"] > 0  # the pool is smaller than the working set
    assert state["chunk_locked_entries"] == 0 and state["chunk_pinned_requests"] == 0  # no pin leaked
    flush(url)
    state = relaxkv_state(url)
    assert state["chunk_tokens_held"] == 0 and state["chunk_locked_entries"] == 0
    assert state["chunk_pins_dropped_at_reset"] == 0  # the flush found no pin left behind
    assert state["kv_available_tokens"] == state["kv_total_tokens"]
