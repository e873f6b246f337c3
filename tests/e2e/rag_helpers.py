"""Building chunk-marked prompts and talking to a server, for the e2e tests."""

from __future__ import annotations

import dataclasses
import functools
import random
import time

from relaxkv_sglang import assets
from relaxkv_sglang.client import ServerClient
from relaxkv_sglang.request.segments import split_text, tokenize_parts

# Seconds a test's own server may take to become ready (ServerConfig.startup_timeout_s). A launch
# takes 20-40 s on a quiet 2-core machine; on a loaded one (load average 11-15) 170-190 s were
# measured, close to the launcher's default of 300 s. A hang guard: a start that never ends still fails.
SERVER_START_TIMEOUT_S = 900.0

# The switch for the tests that need a Mooncake store (``make install-mooncake``): "1" runs them.
MOONCAKE_TESTS_ENV = "RELAXKV_MOONCAKE_TESTS"


@dataclasses.dataclass
class MarkedPrompt:
    text: str
    offsets: list[int]  # relaxkv_chunks: [s0, e0, s1, e1, ...]

    def spans(self) -> list[tuple[int, int]]:
        return list(zip(self.offsets[::2], self.offsets[1::2]))


def marked_prompt(system: str, documents: list[str], question: str, *, glue: bool = True) -> MarkedPrompt:
    """System prompt, documents separated by blank lines, question.

    glue=True: the blank lines are text between chunks (computed, not cached);
    glue=False: each chunk includes its trailing blank line, so chunks are contiguous.
    """
    text, offsets = (system + "\n\n") if system else "", []
    for doc in documents:
        chunk = doc if glue else doc + "\n\n"
        offsets += [len(text), len(text) + len(chunk)]
        text += chunk if not glue else chunk + "\n\n"
    return MarkedPrompt(text + question, offsets)


# What surrounds each document in layout_prompt: (before it, after it).
LAYOUT_FRAMES = {"blank": ("", "\n\n"), "lines": ("", "\n"), "numbered": ("[{n}] ", "\n\n"),
                 "tagged": ("<doc>\n", "\n</doc>\n")}


def layout_prompt(system: str, documents: list[str], question: str, layout: str = "blank") -> MarkedPrompt:
    """System prompt, documents, question, written as RAG frameworks do (the offsets mark the
    documents): ``blank`` lines between them, one per line (``lines``), ``[n]``-``numbered``, or
    ``tagged`` ``<doc>...</doc>``."""
    before, after = LAYOUT_FRAMES[layout]
    text, offsets = (system + "\n\n") if system else "", []
    for n, doc in enumerate(documents, 1):
        text += before.format(n=n)
        offsets += [len(text), len(text) + len(doc)]
        text += doc + after
    return MarkedPrompt(text + question, offsets)


def mid_word_offset(text: str, near: int) -> int:
    """The offset nearest ``near`` (``0 < near < len(text)``) that falls inside a word (a letter or
    digit on both sides), or ``near`` itself when the text has none."""
    for d in range(len(text)):
        for i in (near - d, near + d):
            if 0 < i < len(text) and text[i - 1].isalnum() and text[i].isalnum():
                return i
    return near


@functools.lru_cache(maxsize=1)
def essay_paragraphs() -> tuple[str, ...]:
    """Real paragraphs (the Paul Graham essays), long enough to be chunks."""
    text = assets.load_data("essays")["text"]
    paragraphs = [p.strip() for p in text.split("\n\n")]
    return tuple(p for p in paragraphs if 200 <= len(p) <= 600)


def documents(n: int, seed: int) -> list[str]:
    return random.Random(seed).sample(essay_paragraphs(), n)


def synthetic_documents(n: int, seed: int) -> list[str]:
    """Paragraph-like documents never sent before (words of the essays, shuffled; ~100 tokens each)."""
    rng = random.Random(seed)
    words = " ".join(essay_paragraphs()).split()
    return [f"Note {seed}-{i}: " + " ".join(rng.choices(words, k=70)) + "." for i in range(n)]


def generate(url: str, prompt: MarkedPrompt | str, *, policy: str | None = None, max_new_tokens: int = 8,
             logprobs: bool = False, timeout: float = 120, **extra) -> dict:
    marked = isinstance(prompt, MarkedPrompt)
    return ServerClient(url, timeout).generate(
        prompt.text if marked else prompt, prompt.offsets if marked else None, policy,
        max_new_tokens=max_new_tokens, top_logprobs=5 if logprobs else 0, **extra)


def part_token_ids(tokenizer, prompt: MarkedPrompt):
    """The token layout the server builds: each part tokenized on its own."""

    def encode(text: str, special: bool) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=special)

    return tokenize_parts(split_text(prompt.text, prompt.spans()), encode)


def relaxkv_state(url: str) -> dict:
    return ServerClient(url).relaxkv_state()


def flush(url: str) -> None:
    ServerClient(url).flush()


def check_idle(url: str) -> dict:
    """Flush the server's caches and check every KV slot is free and no chunk held; its state after."""
    flush(url)
    state = relaxkv_state(url)
    assert state["chunk_tokens_held"] == 0 and state["kv_available_tokens"] == state["kv_total_tokens"], state
    return state


def wait_tier_writes(url: str, timeout: float = 60, tier: str = "disk") -> None:
    """Until the server's writes to ``tier`` (a write-through tier: "disk", "hicache") are done."""
    deadline = time.monotonic() + timeout
    while relaxkv_state(url).get(f"tier_{tier}_pending_writes", 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert relaxkv_state(url).get(f"tier_{tier}_pending_writes", 0) == 0
