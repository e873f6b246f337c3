"""Chunk discovery is a function of the prompt: another client's marks, a flush, a restart or a
replica do not change how an unmarked prompt is chunked (issue 46 item 3), against real SGLang
servers on the tiny model.

* The reproduction of issue 46, on the session's plugin server (discovery by the block rules and
  token boundaries, the default): after another unsalted client marked a fragment of the prompt's
  opening document that starts mid-word, the prompt's next cold request (after ``/flush_cache``)
  chunks exactly as before: the same ``meta_info.relaxkv`` counts, prompt and cached tokens, output
  tokens and logprobs (within 1e-4). Before issue 46 the HTTP process's document index learned the
  marked fragment, kept it through the flush and cut it out of the prompt mid-word (3 chunks
  instead of 2).
* With the opt-in index (``RELAXKV_DISCOVERY_INDEX=1``, a server of its own): the same holds (a
  client's marks are never learned); a document it discovered is found again glued to other text
  in the same namespace only; ``/flush_cache`` empties it (the flush hook in the HTTP process).
"""

from __future__ import annotations

import os

import pytest
from conftest import TINY_POOL_TOKENS, start_server
from rag_helpers import MarkedPrompt, documents, flush, generate

from relaxkv_sglang.server.launch import STRICT_MEMORY_CHECK, ServerConfig

pytestmark = pytest.mark.e2e


def index_config(model_path: str) -> ServerConfig:
    """The tiny model with the discovery index on (default policy ``prefix``: requests name ``pic``)."""
    return ServerConfig(model_path=model_path, max_total_tokens=TINY_POOL_TOKENS, policy="prefix",
                        env={**STRICT_MEMORY_CHECK, "RELAXKV_DISCOVERY_INDEX": "1"},
                        extra_args=["--context-length", "4096"])


PRESTART_SERVERS = {"index_server": start_server(index_config)}


@pytest.fixture(scope="module")
def index_server(tiny_model_path, prestart):
    with prestart.serving("index_server", lambda: PRESTART_SERVERS["index_server"](tiny_model_path)) as srv:
        yield srv


DOCS = documents(3, seed=46)
# DOCS[1] opens the prompt, where the block rules see a system prompt, not a document: only an
# index that learned a client's marks would cut a fragment of it out (as before issue 46)
PROMPT = "\n\n".join([DOCS[1], DOCS[0], DOCS[2]]) + "\n\nWhich document talks about startups?"


def answer(url: str, text: str, **extra) -> dict:
    """Greedy tokens with their logprobs, under ``pic``; the fields that show how it was chunked."""
    out = generate(url, text, policy="pic", max_new_tokens=6, logprobs=True, **extra)
    meta = out["meta_info"]
    return {"relaxkv": {k: meta["relaxkv"][k] for k in ("chunks_seen", "chunks_hit", "chunk_tokens_reused")},
            "prompt_tokens": meta["prompt_tokens"], "cached_tokens": meta["cached_tokens"],
            "output_ids": out["output_ids"], "logprobs": [lp for lp, _, _ in meta["output_token_logprobs"]]}


def assert_same(after: dict, before: dict) -> None:
    assert {k: v for k, v in after.items() if k != "logprobs"} == {k: v for k, v in before.items() if k != "logprobs"}
    assert after["logprobs"] == pytest.approx(before["logprobs"], abs=1e-4)


def mark_a_fragment_mid_word(url: str) -> None:
    """Another unsalted client marks a fragment of DOCS[1] that starts inside a word."""
    cut = next(i for i in range(3, len(DOCS[1])) if DOCS[1][i - 1].isalnum() and DOCS[1][i].isalnum())
    fragment = DOCS[1][cut:]
    marked = generate(url, MarkedPrompt("Note: " + fragment + "\n\nWhat does it say?", [6, 6 + len(fragment)]),
                      policy="pic", max_new_tokens=1)
    assert marked["meta_info"]["relaxkv"]["chunks_seen"] == 1


@pytest.mark.parametrize("which", ["default", "index on"])
def test_another_clients_marks_do_not_change_a_prompts_chunks(relaxkv_server, index_server, which):
    url = (relaxkv_server if which == "default" else index_server).url
    flush(url)
    before = answer(url, PROMPT)
    assert before["relaxkv"]["chunks_seen"] == 2 and before["relaxkv"]["chunks_hit"] == 0
    mark_a_fragment_mid_word(url)
    flush(url)
    assert_same(answer(url, PROMPT), before)
    # warm, the same chunks are hit: only the reuse counts change
    warm = answer(url, PROMPT)
    assert warm["relaxkv"]["chunks_hit"] == 2 and warm["output_ids"] == before["output_ids"]


def test_the_index_finds_what_it_discovered_per_namespace_until_a_flush(index_server):
    """A document the index learned (discovered in a structured prompt) is found glued to other text
    on one line, in its own namespace only; a flush forgets it, so the glued prompt then chunks as
    on a fresh server."""
    url = index_server.url
    docs = [" ".join(d.split()) for d in documents(3, seed=34)]  # one line each
    # one line: only the index can find them; tabs between them, since a hit must start and end on
    # token boundaries and a space before a word is part of the word's token
    glued = "Sys:\t" + "\t".join(docs) + "\tQ?"
    tenant = f"discovery-{os.urandom(4).hex()}"
    flush(url)
    fresh = answer(url, glued, cache_salt=tenant)
    assert fresh["relaxkv"]["chunks_seen"] == 0
    assert answer(url, "Sys.\n\n" + "\n\n".join(docs) + "\n\nQ?", cache_salt=tenant)["relaxkv"]["chunks_seen"] == 3
    found = answer(url, glued, cache_salt=tenant)
    assert found["relaxkv"]["chunks_seen"] == found["relaxkv"]["chunks_hit"] == 3
    assert answer(url, glued, cache_salt="another-tenant")["relaxkv"]["chunks_seen"] == 0
    flush(url)
    assert_same(answer(url, glued, cache_salt=tenant), fresh)


def test_the_default_server_chunks_by_the_prompt_alone(relaxkv_server):
    """Without the index, the glued prompt is not split at documents the same tenant sent before."""
    url = relaxkv_server.url
    docs = [" ".join(d.split()) for d in documents(3, seed=35)]
    glued = "Sys:\t" + "\t".join(docs) + "\tQ?"
    tenant = f"discovery-{os.urandom(4).hex()}"
    flush(url)
    fresh = answer(url, glued, cache_salt=tenant)
    assert answer(url, "Sys.\n\n" + "\n\n".join(docs) + "\n\nQ?", cache_salt=tenant)["relaxkv"]["chunks_seen"] == 3
    flush(url)
    assert_same(answer(url, glued, cache_salt=tenant), fresh)
    assert fresh["relaxkv"]["chunks_seen"] == 0
