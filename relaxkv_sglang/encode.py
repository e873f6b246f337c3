"""``relaxkv-sglang encode``: pre-encode a corpus into a running server's chunk store.

Each document is sent once as a request whose only chunk is the document itself
(``relaxkv_chunks = [0, len(doc)]``, policy ``pic``, one new token): the server computes the
chunk's KV position-independently and stores it (in the pool, and written through to its
``--chunk-dir`` if it has one), under the same key a later RAG request marking the same
document text will look up (the chunk's token ids, the model identity and the namespace;
``--cache-salt`` picks a tenant's namespace). A document the server already holds comes back
as a hit and is counted as skipped.

Resumable: each document done (stored or skipped) is appended to a progress file (default
``INPUT.encoded``: one sha256 of salt and text per line), and a later run skips those without
a request. At the end the command waits until the server reports no disk writes pending
(``tier_disk_pending_writes``), so a restart right after finds every chunk.

Input: a ``.jsonl`` file (one ``{"text": ...}`` object per line; blank lines ignored) or any
other text file split by ``--separator`` (default a blank line; empty pieces ignored).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import requests

from relaxkv_sglang.client import ServerClient

# The text after the document: a request needs a non-empty query after its last chunk.
QUERY = "\n"


class EncodeError(Exception):
    """A problem the user can fix; the message is one line."""


def read_corpus(path: str, separator: str = "\n\n") -> list[str]:
    """The documents of ``path`` (module doc); EncodeError naming the file (and line) if malformed."""
    if not os.path.isfile(path):
        raise EncodeError(f"--input {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise EncodeError(f"--input {path}: not UTF-8 text") from None
    docs: list[str] = []
    if path.endswith(".jsonl"):
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise EncodeError(f'--input {path}:{lineno}: not a JSON object with a "text" string')
            if obj["text"].strip():
                docs.append(obj["text"])
    else:
        if not separator:
            raise EncodeError("--separator: must not be empty")
        docs = [d.strip() for d in text.split(separator) if d.strip()]
    if not docs:
        raise EncodeError(f"--input {path}: no documents")
    return docs


def doc_id(text: str, cache_salt: Optional[str]) -> str:
    return hashlib.sha256(((cache_salt or "") + "\x00" + text).encode()).hexdigest()[:32]


def unescape(separator: str) -> str:
    """``\\n`` and friends as typed on a command line."""
    try:
        return codecs.decode(separator, "unicode_escape")
    except UnicodeDecodeError:
        raise EncodeError(f"--separator {separator!r}: bad escape") from None


def encode_corpus(url: str, input_path: str, *, separator: str = "\\n\\n", batch_size: int = 8,
                  state_path: Optional[str] = None, cache_salt: Optional[str] = None, timeout: float = 600.0,
                  progress: bool = True, drain_timeout: float = 300.0) -> dict:
    """Send every document (module doc); returns counts: documents, stored, skipped, failed."""
    from tqdm import tqdm

    if batch_size < 1:
        raise EncodeError(f"--batch-size {batch_size}: must be >= 1")
    docs = read_corpus(input_path, unescape(separator))
    client = ServerClient(url, timeout)
    try:
        state = client.relaxkv_state()
    except (requests.RequestException, ValueError, KeyError, IndexError) as exc:
        raise EncodeError(f"--url {url}: cannot reach a server there ({type(exc).__name__})") from None
    if "tiers" not in state and "chunk_lookups" not in state:
        raise EncodeError(f"--url {url}: not a relaxkv-sglang server with the chunk tree "
                          "(--radix-cache-backend relaxkv)")
    if "disk" not in state.get("tiers", []):
        print("relaxkv-sglang: warning: the server has no --chunk-dir; the chunks stay in its memory only "
              "(lost on restart)", file=sys.stderr, flush=True)
    if state_path is None:
        state_path = input_path + ".encoded"
    done: set[str] = set()
    if state_path != "none" and os.path.isfile(state_path):
        with open(state_path) as f:
            done = {line.strip() for line in f if line.strip()}
    counts = {"documents": len(docs), "stored": 0, "skipped": 0, "failed": 0}
    todo = []
    for text in docs:
        if doc_id(text, cache_salt) in done:
            counts["skipped"] += 1
        else:
            todo.append(text)
    lock = threading.Lock()
    errors: list[str] = []
    journal = open(state_path, "a") if state_path != "none" else None

    def one(text: str) -> None:
        extra = {"cache_salt": cache_salt} if cache_salt else {}
        try:
            out = client.generate(text + QUERY, [0, len(text)], "pic", max_new_tokens=1, **extra)
            record = out["meta_info"].get("relaxkv", {})
            outcome = "skipped" if record.get("chunks_seen") and record.get("chunks_hit") == record["chunks_seen"] \
                else "stored"
        except Exception as exc:  # noqa: BLE001 - counted, reported, the rest goes on
            with lock:
                counts["failed"] += 1
                errors.append(str(exc).splitlines()[0][:200])
            return
        with lock:
            counts[outcome] += 1
            if journal is not None:
                journal.write(doc_id(text, cache_salt) + "\n")
                journal.flush()

    try:
        with ThreadPoolExecutor(batch_size) as pool:
            bar = tqdm(total=len(docs), initial=counts["skipped"], desc="encode", unit="doc", disable=not progress,
                       file=sys.stderr)
            for _ in pool.map(one, todo):
                bar.update(1)
            bar.close()
    finally:
        if journal is not None:
            journal.close()
    for line in errors[:3]:
        print(f"relaxkv-sglang: failed: {line}", file=sys.stderr)
    if "disk" in state.get("tiers", []):
        wait_for_disk_writes(client, drain_timeout)
    return counts


def wait_for_disk_writes(client: ServerClient, timeout: float) -> bool:
    """Poll the server until it reports no disk writes pending; False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not client.relaxkv_state().get("tier_disk_pending_writes", 0):
            return True
        time.sleep(0.2)
    print("relaxkv-sglang: warning: the server still has disk writes pending", file=sys.stderr)
    return False
