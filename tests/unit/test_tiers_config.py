"""The lower tiers' configuration (serve flags, RELAXKV_* variables), the pool's chunk
index's eviction callback and ``relaxkv-sglang encode``'s input handling."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch

from relaxkv_sglang import cli
from relaxkv_sglang.cache.chunk_key import ChunkKey
from relaxkv_sglang.cache.pool_index import PoolChunkIndex
from relaxkv_sglang.encode import EncodeError, encode_corpus, read_corpus
from relaxkv_sglang.cache.tiers import GB, DiskTierConfig, HostTierConfig, ModelIdentity, Tier, TierConfig, TierName
from relaxkv_sglang.cache.tiers.tier import TierRole
from relaxkv_sglang.cache.sglang.tier_configs import TIER_CONFIGS, build_tiers, tier_configs_from_env


def test_tier_configs_from_env(tmp_path):
    assert tier_configs_from_env({}) == []
    configs = tier_configs_from_env({"RELAXKV_HOST_CACHE_GB": "0.5", "RELAXKV_CHUNK_DIR": str(tmp_path / "d")})
    assert configs == [HostTierConfig(GB // 2, "tinylfu"), DiskTierConfig(str(tmp_path / "d"), 10 * GB)]
    assert (tmp_path / "d").is_dir()
    configs = tier_configs_from_env({"RELAXKV_CHUNK_DIR": str(tmp_path / "d"), "RELAXKV_DISK_CACHE_GB": "2",
                                     "RELAXKV_HOST_CACHE_POLICY": "lru"})
    assert configs == [DiskTierConfig(str(tmp_path / "d"), 2 * GB)]  # a policy alone asks for no host tier


class _NoOpTier(Tier):
    """Holds nothing (the no-op tier of the registry test)."""

    name = TierName.HOST  # the vocabulary's name for its slot; this server has no host tier
    role = TierRole(exclusive=True)

    def __init__(self) -> None:
        self.counters = {"gets": 0}

    def batch_exists(self, keys):
        return [False] * len(keys)

    def batch_get(self, keys):
        self.counters["gets"] += len(keys)
        return [None] * len(keys)

    def batch_set(self, keys, records):
        return [False] * len(keys)

    def delete(self, key):
        return False

    def stats(self):
        return dict(self.counters)

    def clear(self):
        pass


@dataclasses.dataclass(frozen=True)
class _NoOpTierConfig(TierConfig):
    """The no-op tier's configuration: it reads its own variable."""

    @classmethod
    def from_env(cls, env):
        return cls() if env.get("RELAXKV_NOOP_TIER") == "1" else None

    def build(self, ctx):
        return _NoOpTier()


def test_a_new_tier_is_its_module_plus_one_entry_in_the_table(tmp_path):
    """Issue 49 item 3: a tier's configuration class (reading its own variable) and one entry in the
    table are all the server's side needs; the store then serves it like any other."""
    table = TIER_CONFIGS + (_NoOpTierConfig,)
    env = {"RELAXKV_NOOP_TIER": "1", "RELAXKV_CHUNK_DIR": str(tmp_path / "d")}
    configs = tier_configs_from_env(env, table)
    assert [type(c) for c in configs] == [DiskTierConfig, _NoOpTierConfig]
    pool_kv = types.SimpleNamespace(token_shape=(2, 2, 1, 4), dtype=torch.float32)
    store = build_tiers(configs, pool_kv, ModelIdentity("m", "t", "float32", "l"), max_tokens=64)
    assert list(store.names) == [TierName.DISK, TierName.HOST]
    assert tier_configs_from_env({}, table) == []


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
        tier_configs_from_env(env)
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


def test_pool_index_on_evict_sees_the_entry_before_its_slots_are_freed():
    events = []
    store = PoolChunkIndex(lambda slots: events.append(("free", slots.tolist())),
                           on_evict=lambda e: events.append(("spill", e.key.tokens, e.slots.tolist())))
    store.insert(ChunkKey(None, [1, 2]), torch.tensor([0, 1]))
    store.insert(ChunkKey(None, [3]), torch.tensor([2]))
    assert store.evict(1) == 2
    assert events == [("spill", (1, 2), [0, 1]), ("free", [0, 1])]
    store.reset()  # a flush drops without spilling
    assert events[-1] == ("free", [2]) and len(events) == 3
    assert store.insert(ChunkKey(None, [4]), torch.tensor([5])).origin is None


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
