"""README's "A fresh CPU environment", followed literally, serves a request with chunk reuse.

The shell block under that heading is taken from README.md as it stands and run by bash, line by
line, in a copy of the checkout's tracked files (a fresh venv, the pip installs, the shim step;
about a minute with a local wheel folder, where the PyTorch index is unreachable and pip falls
back to it after its retries), then its last line, ``relaxkv-sglang serve --policy pic``, with
``--port`` added so it cannot collide with another server. Two requests then carry the same
documents in another order: the second reuses every one of them. On demand (it installs ~1.7 GB
and starts SmolLM2): ``RELAXKV_README_TEST=1 python -m pytest tests/e2e/test_readme_install.py``.
"""

from __future__ import annotations

import os
import pathlib
import queue
import re
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest
import requests

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.environ.get("RELAXKV_README_TEST") != "1",
                                                 reason="on demand: RELAXKV_README_TEST=1 (a fresh venv, ~3 min)")]

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADING = "**A fresh CPU environment**"


def readme_commands() -> list[str]:
    """The commands of the first ``sh`` block after :data:`HEADING`, continuations joined."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```sh\n(.*?)```", text[text.index(HEADING):], re.S)
    assert block, f"no sh block after {HEADING}"
    return [c.strip() for c in block.group(1).replace("\\\n", " ").splitlines() if c.strip()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _copy_checkout(dst: pathlib.Path) -> None:
    # the working tree's files git would commit: tracked and untracked-but-not-ignored
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


def test_readme_fresh_cpu_environment_serves_chunk_reuse(tmp_path):
    commands = readme_commands()
    *install, serve = commands
    assert serve.split("#")[0].split() == ["relaxkv-sglang", "serve", "--policy", "pic"], serve
    checkout = tmp_path / "relaxkv-sglang"
    _copy_checkout(checkout)
    port = _free_port()
    script = "set -e\n" + "\n".join(install) + f"\nexec {serve.split('#')[0].strip()} --port {port}\n"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = ":".join(p for p in env["PATH"].split(":") if ".venv" not in p)
    proc = subprocess.Popen(["bash", "-c", script], cwd=checkout, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    tail: list[str] = []
    try:
        deadline = time.monotonic() + 1200
        url = None
        while url is None:
            assert time.monotonic() < deadline, "".join(tail[-40:])
            try:
                line = lines.get(timeout=5)
            except queue.Empty:
                assert proc.poll() is None, f"exited {proc.returncode}:\n" + "".join(tail[-40:])
                continue
            tail.append(line)
            if line.startswith("ready: "):
                url = line.split()[1]
        assert url == f"http://127.0.0.1:{port}"
        docs = ["Paris is the capital of France. It lies on the Seine and has been the seat of government "
                "for centuries.", "Berlin is the capital of Germany. The river Spree runs through it.",
                "Madrid is the capital of Spain, on the Manzanares, near the middle of the peninsula."]

        def ask(system: str, order: list[int], question: str) -> dict:
            text, offsets = system, []
            for i in order:
                text += "\n\n"
                offsets += [len(text), len(text) + len(docs[i])]
                text += docs[i]
            text += f"\n\nQuestion: {question}\nAnswer:"
            body = {"text": text, "sampling_params": {"max_new_tokens": 4, "custom_params": {"relaxkv_chunks": offsets}}}
            response = requests.post(url + "/generate", json=body, timeout=300)
            assert response.status_code == 200, response.text
            return response.json()["meta_info"]

        first = ask("Answer from the documents.", [0, 1, 2], "Which river runs through Berlin?")
        second = ask("Be brief.", [2, 0, 1], "What is the capital of Spain?")
        # the server default from `serve --policy pic`: no policy in the body
        assert first["relaxkv"]["policy"] == second["relaxkv"]["policy"] == "pic"
        assert (first["relaxkv"]["chunks_hit"], second["relaxkv"]["chunks_hit"]) == (0, 3)
        assert second["cached_tokens"] >= second["relaxkv"]["chunk_tokens_reused"] > 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # serve stops the server on SIGTERM
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
