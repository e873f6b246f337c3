"""The lower tiers' configuration (serve flags, RELAXKV_* variables), the chunk
store's eviction callback and ``relaxkv-sglang encode``'s input handling."""

from __future__ import annotations

import json

import pytest
import torch

from relaxkv_sglang import cli
from relaxkv_sglang.core.chunk_store import ChunkStore
from relaxkv_sglang.encode import EncodeError, encode_corpus, read_corpus
from relaxkv_sglang.srt.mem_cache.tiers import GB, tier_config_from_env


def test_tier_config_from_env(tmp_path):
    assert not tier_config_from_env({}).enabled
    c = tier_config_from_env({"RELAXKV_HOST_CACHE_GB": "0.5", "RELAXKV_CHUNK_DIR": str(tmp_path / "d")})
    assert c.host_bytes == GB // 2 and c.disk_bytes == 10 * GB and c.disk_dir == str(tmp_path / "d")
    assert (tmp_path / "d").is_dir() and c.host_policy == "tinylfu"
    c = tier_config_from_env({"RELAXKV_CHUNK_DIR": str(tmp_path / "d"), "RELAXKV_DISK_CACHE_GB": "2",
                              "RELAXKV_HOST_CACHE_POLICY": "lru"})
    assert c.host_bytes == 0 and c.disk_bytes == 2 * GB and c.host_policy == "lru" and c.enabled


@pytest.mark.parametrize("env, message", [
    ({"RELAXKV_HOST_CACHE_GB": "lots"}, "RELAXKV_HOST_CACHE_GB='lots': not a number of GB"),
    ({"RELAXKV_HOST_CACHE_GB": "-1"}, "RELAXKV_HOST_CACHE_GB='-1': must be a finite number >= 0"),
    ({"RELAXKV_HOST_CACHE_GB": "nan"}, "must be a finite number >= 0"),
    ({"RELAXKV_DISK_CACHE_GB": "0", "RELAXKV_CHUNK_DIR": "{tmp}/d"}, "must be > 0 with RELAXKV_CHUNK_DIR"),
    ({"RELAXKV_CHUNK_DIR": "{tmp}/file"}, "exists and is not a directory"),
    ({"RELAXKV_HOST_CACHE_POLICY": "fifo"}, "RELAXKV_HOST_CACHE_POLICY='fifo': must be one of tinylfu, lru"),
])
def test_bad_tier_env_is_one_line(tmp_path, env, message):
    (tmp_path / "file").write_text("x")
    env = {k: v.replace("{tmp}", str(tmp_path)) for k, v in env.items()}
    with pytest.raises(SystemExit) as exc:
        tier_config_from_env(env)
    text = str(exc.value)
    assert text.startswith("relaxkv-sglang: ") and message in text and "\n" not in text


def test_serve_flags_become_the_tier_variables(monkeypatch, tmp_path, serve_env):
    for name in ("RELAXKV_HOST_CACHE_GB", "RELAXKV_CHUNK_DIR", "RELAXKV_DISK_CACHE_GB"):
        monkeypatch.delenv(name, raising=False)
    env = serve_env("--host-cache-gb", "1.5", "--chunk-dir", str(tmp_path / "c"),
                     "--disk-cache-gb", "3")
    assert env["RELAXKV_HOST_CACHE_GB"] == "1.5" and env["RELAXKV_DISK_CACHE_GB"] == "3.0"
    assert env["RELAXKV_CHUNK_DIR"] == str(tmp_path / "c")
    env = serve_env()
    assert "RELAXKV_CHUNK_DIR" not in env and "RELAXKV_HOST_CACHE_GB" not in env


@pytest.mark.parametrize("args, message", [
    (["--host-cache-gb", "-2"], "--host-cache-gb -2.0: must be a finite number >= 0"),
    (["--disk-cache-gb", "4"], "--disk-cache-gb needs --chunk-dir DIR"),
])
def test_bad_serve_tier_flags_are_one_line(monkeypatch, tmp_path, capsys, args, message, serve_env):
    serve_env(*args)
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"relaxkv-sglang: error: {message}"


def test_chunk_store_on_evict_sees_the_entry_before_its_slots_are_freed():
    events = []
    store = ChunkStore(lambda slots: events.append(("free", slots.tolist())),
                       on_evict=lambda e: events.append(("spill", e.token_ids, e.slots.tolist())))
    store.insert(None, [1, 2], torch.tensor([0, 1]))
    store.insert(None, [3], torch.tensor([2]))
    assert store.evict(1) == 2
    assert events == [("spill", (1, 2), [0, 1]), ("free", [0, 1])]
    store.reset()  # a flush drops without spilling
    assert events[-1] == ("free", [2]) and len(events) == 3
    assert store.insert(None, [4], torch.tensor([5])).origin is None


def test_encode_reads_jsonl_and_plain_text(tmp_path):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(json.dumps({"text": "Doc one."}) + "\n\n" + json.dumps({"text": "Doc two.", "id": 3}) + "\n")
    assert read_corpus(str(jsonl)) == ["Doc one.", "Doc two."]
    txt = tmp_path / "c.txt"
    txt.write_text("First doc.\n\nSecond doc.\n\n\n\nThird.\n")
    assert read_corpus(str(txt)) == ["First doc.", "Second doc.", "Third."]
    assert read_corpus(str(txt), "---") == ["First doc.\n\nSecond doc.\n\n\n\nThird."]


@pytest.mark.parametrize("content, message", [
    (None, "--input {p}: no such file"),
    ('{"text": "ok"}\nnot json\n', '--input {p}:2: not a JSON object with a "text" string'),
    ('{"txt": "wrong key"}\n', '--input {p}:1: not a JSON object with a "text" string'),
    ('["text"]\n', '--input {p}:1: not a JSON object with a "text" string'),
    ("\n\n", "--input {p}: no documents"),
])
def test_encode_bad_input_is_one_line(tmp_path, content, message):
    p = tmp_path / "corpus.jsonl"
    if content is not None:
        p.write_text(content)
    with pytest.raises(EncodeError) as exc:
        read_corpus(str(p))
    assert str(exc.value) == message.format(p=p)


def test_encode_cli_unreachable_server_is_one_line(tmp_path, capsys):
    p = tmp_path / "c.txt"
    p.write_text("A document.")
    assert cli.main(["encode", "--url", "http://127.0.0.1:9", "--input", str(p)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["relaxkv-sglang: error: --url http://127.0.0.1:9: cannot reach a server there (ConnectionError)"]
    with pytest.raises(EncodeError, match="--batch-size 0: must be >= 1"):
        encode_corpus("http://127.0.0.1:9", str(p), batch_size=0)
