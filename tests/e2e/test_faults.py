"""Faults: the server killed mid-workload and restarted; a corrupt model cache.

Without ``--chunk-dir`` the chunk cache lives in the server's memory only, so a crash loses
it and that is all (with one, see ``test_tiers.py``): a new server on the same port and cache folder starts empty,
answers as before, and serving writes nothing to disk. Corrupt or partial
artifacts in the asset cache are detected by their manifest and rebuilt (data
and wheels: ``tests/unit/test_assets_cli.py``; the model: here).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import threading
import time

import pytest
import requests
from conftest import STRICT_MEMORY_CHECK
from rag_helpers import SERVER_START_TIMEOUT_S, documents, generate, marked_prompt, relaxkv_state

from relaxkv_sglang import assets
from relaxkv_sglang.server.launch import SGLangServer, ServerConfig, free_port, port_in_use

CLIENTS = 4


def _listing(root: pathlib.Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root``: relative path -> (size, mtime in ns)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of a live process, None if it is gone."""
    try:
        text = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces
    return fields[0], int(fields[1]), int(fields[2])


def _descendants(root: int) -> set[int]:
    """The pids of every live process below ``root``."""
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _proc_stat(int(entry.name))) is not None:
            children.setdefault(stat[1], []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _running(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie waiting for its reaper has stopped)."""
    return {p for p in pids if (stat := _proc_stat(p)) is not None and stat[0] != "Z"}


def _client_loop(url: str, prompts, outcomes: list, stop: threading.Event) -> None:
    """Send requests until one fails; record ("ok", t) per answer and (exception, t) for the failure."""
    i = 0
    while not stop.is_set():
        try:
            generate(url, prompts[i % len(prompts)], policy=("pic", "relaxkv", "full")[i % 3], max_new_tokens=16,
                     timeout=120)
        except Exception as exc:  # the server went away
            outcomes.append((exc, time.monotonic()))
            return
        outcomes.append(("ok", time.monotonic()))
        i += 1


@pytest.mark.e2e
@pytest.mark.long
def test_kill_mid_workload_then_restart_is_a_clean_empty_server(tmp_path, tiny_model_path):
    cache = tmp_path / "cache"  # the server's own RELAXKV_CACHE, holding a copy of the model
    model = cache / "models" / "tiny-llama"
    shutil.copytree(tiny_model_path, model)
    on_disk = _listing(cache)
    port = free_port()

    def config() -> ServerConfig:
        return ServerConfig(model_path=str(model), port=port, max_total_tokens=4096, policy="pic",
                            env={**STRICT_MEMORY_CHECK, "RELAXKV_CACHE": str(cache)},
                            extra_args=["--context-length", "2048"], startup_timeout_s=SERVER_START_TIMEOUT_S)

    probe = marked_prompt("You answer from the documents.", documents(3, seed=5), "Question: what is it about?")
    pool = documents(12, seed=6)
    prompts = [marked_prompt("Use the documents.", pool[i: i + 4], f"Question {i}?") for i in range(0, 9, 2)]

    server = SGLangServer(config()).start()
    try:
        url = server.url
        cold = generate(url, probe, policy="pic", max_new_tokens=8)
        warm = generate(url, probe, policy="pic", max_new_tokens=8)
        full = generate(url, probe, policy="full", max_new_tokens=8)
        assert cold["meta_info"]["relaxkv"]["chunks_hit"] == 0
        assert warm["meta_info"]["relaxkv"]["chunks_hit"] == 3  # there is cached state to lose
        assert warm["output_ids"] == cold["output_ids"]

        leader = server.proc.pid
        family = _descendants(leader)
        assert len(family) >= 2  # scheduler and detokenizer
        # They are all in the leader's process group, so a kill of the group reaches every one.
        assert {_proc_stat(p)[2] for p in family} == {leader}

        outcomes = [[] for _ in range(CLIENTS)]
        stop = threading.Event()
        threads = [threading.Thread(target=_client_loop, args=(url, prompts, outcomes[k], stop), daemon=True)
                   for k in range(CLIENTS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while sum(len(o) for o in outcomes) < 2 * CLIENTS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(len(o) for o in outcomes) >= 2 * CLIENTS, "the workload did not get going"
        answered = sum(len(o) for o in outcomes)

        killed_at = time.monotonic()
        os.killpg(leader, signal.SIGKILL)  # what a crash, an OOM kill or a lost machine looks like
        server.proc.wait(timeout=30)
        for t in threads:
            t.join(timeout=60)
        stop.set()
        # Every client got an error (not a hang), and a connection error, soon after the kill.
        assert not any(t.is_alive() for t in threads)
        for record in outcomes:
            error, at = record[-1]
            assert isinstance(error, requests.ConnectionError) and not isinstance(error, requests.Timeout), error
            assert at - killed_at < 30

        # No orphan: the scheduler and detokenizer died with the leader, and the port is free.
        deadline = time.monotonic() + 15
        while _running(family) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _running(family) == set()
        assert not port_in_use("127.0.0.1", port)
        print(f"kill -9 after {answered} answers: {CLIENTS} clients got connection errors within "
              f"{max(o[-1][1] for o in outcomes) - killed_at:.2f} s; {len(family)} child processes, none left")
    finally:
        server.stop()

    restart = time.monotonic()
    with SGLangServer(config()) as again:  # same port, same cache folder
        print(f"restarted on port {port} in {time.monotonic() - restart:.1f} s")
        url = again.url
        state = relaxkv_state(url)
        assert state["chunk_lookups"] == state["chunk_entries"] == state["chunk_tokens_held"] == 0
        # The pool is free but for the startup health check's prompt, held evictable by the radix cache.
        assert state["kv_available_tokens"] + state["radix_evictable_tokens"] == state["kv_total_tokens"]
        assert state["radix_protected_tokens"] == 0
        after = generate(url, probe, policy="pic", max_new_tokens=8)
        assert after["meta_info"]["relaxkv"]["chunks_hit"] == 0  # nothing recovered
        assert after["output_ids"] == cold["output_ids"]
        assert generate(url, probe, policy="full", max_new_tokens=8)["output_ids"] == full["output_ids"]
    # Serving (and being killed) wrote nothing to the cache folder, model included.
    assert _listing(cache) == on_disk


def _prepared_cache(tmp_path: pathlib.Path, monkeypatch) -> pathlib.Path:
    """A cache root holding copies of the prepared tiny model and of the essays it is built from."""
    source = assets.model_path("tiny-llama")  # from the normal cache
    essays = assets.data_path("essays").parent
    shutil.copytree(source, tmp_path / "models" / "tiny-llama")
    shutil.copytree(essays, tmp_path / "data" / "essays")
    monkeypatch.setenv("RELAXKV_CACHE", str(tmp_path))
    return tmp_path / "models" / "tiny-llama"


@pytest.mark.parametrize("damage", ["corrupt weights", "no manifest"])
def test_damaged_model_is_detected_and_rebuilt(tmp_path, monkeypatch, capsys, damage):
    folder = _prepared_cache(tmp_path, monkeypatch)
    assert assets.model_path("tiny-llama") == folder  # intact: used as it is
    weights = folder / "model.safetensors"
    good = assets.sha256_file(weights)
    if damage == "corrupt weights":
        data = bytearray(weights.read_bytes())
        data[-100:] = b"\0" * 100
        weights.write_bytes(bytes(data))
        expected = "model.safetensors does not match its sha256"
    else:  # a build interrupted before its manifest was written
        (folder / "manifest.json").unlink()
        expected = "no manifest (never finished)"
    assert assets.manifest_problem(folder) == expected

    assert assets.model_path("tiny-llama") == folder
    assert f"model tiny-llama: {expected}; rebuilding it" in capsys.readouterr().err
    assert assets.manifest_problem(folder) is None
    assert assets.sha256_file(weights) == good  # the build is seeded: the same weights again
    assert [p.name for p in folder.parent.iterdir()] == ["tiny-llama"]  # no temp folder left beside it
