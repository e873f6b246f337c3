"""The chunk store's host and disk tiers in the server: configuration, model identity, KV I/O.

The tiers themselves (bounded host memory, bounded disk folder, admission, checksums) are
:mod:`relaxkv_sglang.core.tiers`; the tree cache (:mod:`.tree_cache`) moves chunks
between them and the KV pool. This module holds what needs SGLang's objects:

* :func:`tier_config_from_env`: ``RELAXKV_HOST_CACHE_GB``, ``RELAXKV_CHUNK_DIR``,
  ``RELAXKV_DISK_CACHE_GB``, ``RELAXKV_HOST_CACHE_POLICY`` (``relaxkv-sglang serve
  --host-cache-gb/--chunk-dir/--disk-cache-gb`` set the first three), and the HiCache tier's
  (:mod:`relaxkv_sglang.srt.mem_cache.hicache_tier`): ``RELAXKV_HICACHE_STORAGE_BACKEND`` (a name SGLang's
  ``--hicache-storage-backend`` takes), ``RELAXKV_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG`` (as
  SGLang's ``--hicache-storage-backend-extra-config``: a JSON object, or ``@FILE`` of JSON, TOML
  or YAML), ``RELAXKV_HICACHE_PAGE_KB`` (bytes per stored page / 1024, default 256),
  ``RELAXKV_HICACHE_CONNECT_TIMEOUT_S`` (default 30), ``RELAXKV_HICACHE_CALL_TIMEOUT_S`` (the
  longest a caller waits on one store call, default 2) and ``RELAXKV_HICACHE_RECONNECT_MAX_S``
  (the longest wait between attempts to reconnect a store that is down, default 30); a bad value stops the server at startup
  with one line naming the variable;
* :func:`build_tiers`: the lower tiers for the pool's KV layout (read and written through
  :class:`~relaxkv_sglang.srt.mem_cache.pool_kv.PoolKV`), under the model identity (:mod:`relaxkv_sglang.srt.mem_cache.kv_identity`: what determines
  the KV bytes, nothing else), a stored value holding at most the model's context length.

SGLang objects read: ``TreeCacheBuildContext`` (``server_args``, ``model_config``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from relaxkv_sglang.core.tiers import (
    GB, DiskTierConfig, HostTier, HostTierConfig, ModelIdentity, TierContext, TieredChunkStore,
)
from relaxkv_sglang.srt.mem_cache.hicache_tier import HiCacheTierConfig, known_backends
from relaxkv_sglang.srt.mem_cache.pool_kv import PoolKV

HOST_GB_ENV = "RELAXKV_HOST_CACHE_GB"
CHUNK_DIR_ENV = "RELAXKV_CHUNK_DIR"
DISK_GB_ENV = "RELAXKV_DISK_CACHE_GB"
HOST_POLICY_ENV = "RELAXKV_HOST_CACHE_POLICY"
HICACHE_BACKEND_ENV = "RELAXKV_HICACHE_STORAGE_BACKEND"
HICACHE_EXTRA_ENV = "RELAXKV_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG"
HICACHE_PAGE_KB_ENV = "RELAXKV_HICACHE_PAGE_KB"
HICACHE_TIMEOUT_ENV = "RELAXKV_HICACHE_CONNECT_TIMEOUT_S"
HICACHE_CALL_TIMEOUT_ENV = "RELAXKV_HICACHE_CALL_TIMEOUT_S"
HICACHE_RECONNECT_MAX_ENV = "RELAXKV_HICACHE_RECONNECT_MAX_S"
DEFAULT_DISK_GB = 10.0


@dataclasses.dataclass(frozen=True)
class TierConfig:
    host_bytes: int = 0
    disk_dir: Optional[str] = None
    disk_bytes: int = 0
    host_policy: str = "tinylfu"
    hicache: HiCacheTierConfig = HiCacheTierConfig()

    @property
    def enabled(self) -> bool:
        """Some lower tier is asked for."""
        return self.host_bytes > 0 or self.disk_dir is not None or self.hicache.backend is not None


def _gb(env: dict, name: str, default: float, unit: str = "GB") -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SystemExit(f"relaxkv-sglang: {name}={raw!r}: not a number of {unit}") from None
    if not value >= 0 or value == float("inf"):
        raise SystemExit(f"relaxkv-sglang: {name}={raw!r}: must be a finite number >= 0")
    return value


def tier_config_from_env(env: Optional[dict] = None) -> TierConfig:
    """The tiers asked for by the environment (module doc); SystemExit with one line if malformed."""
    env = os.environ if env is None else env
    host_gb = _gb(env, HOST_GB_ENV, 0.0)
    disk_dir = env.get(CHUNK_DIR_ENV) or None
    disk_gb = _gb(env, DISK_GB_ENV, DEFAULT_DISK_GB)
    policy = env.get(HOST_POLICY_ENV) or "tinylfu"
    if policy not in HostTier.POLICIES:
        raise SystemExit(f"relaxkv-sglang: {HOST_POLICY_ENV}={policy!r}: must be one of {', '.join(HostTier.POLICIES)}")
    if disk_dir is not None:
        if os.path.exists(disk_dir) and not os.path.isdir(disk_dir):
            raise SystemExit(f"relaxkv-sglang: {CHUNK_DIR_ENV}={disk_dir!r}: exists and is not a directory")
        try:
            os.makedirs(disk_dir, exist_ok=True)
        except OSError as exc:
            raise SystemExit(f"relaxkv-sglang: {CHUNK_DIR_ENV}={disk_dir!r}: cannot create it ({exc.strerror})") from None
        if not os.access(disk_dir, os.W_OK | os.X_OK):
            raise SystemExit(f"relaxkv-sglang: {CHUNK_DIR_ENV}={disk_dir!r}: not writable")
        if disk_gb <= 0:
            raise SystemExit(f"relaxkv-sglang: {DISK_GB_ENV}={env.get(DISK_GB_ENV)!r}: must be > 0 with {CHUNK_DIR_ENV}")
    return TierConfig(int(host_gb * GB), disk_dir, int(disk_gb * GB) if disk_dir else 0, policy,
                      hicache_config_from_env(env))


def _extra_config(raw: str) -> dict:
    """SGLang's extra-config convention: a JSON object, or ``@FILE`` (.json, .toml, .yaml/.yml)."""
    if not raw.startswith("@"):
        value = json.loads(raw)
    else:
        path = raw[1:]
        ext = os.path.splitext(path)[1].lower()
        with open(path, "rb") as f:
            if ext == ".json":
                value = json.load(f)
            elif ext == ".toml":
                import tomllib

                value = tomllib.load(f)
            elif ext in (".yaml", ".yml"):
                import yaml

                value = yaml.safe_load(f)
            else:
                raise ValueError(f"{path}: not a .json, .toml or .yaml file")
    if not isinstance(value, dict):
        raise ValueError("not an object")
    return value


def hicache_config_from_env(env: dict) -> HiCacheTierConfig:
    """The HiCache tier the environment asks for (module doc); SystemExit with one line if malformed."""
    backend = env.get(HICACHE_BACKEND_ENV) or None
    if backend is None:
        return HiCacheTierConfig()
    if backend not in known_backends():
        raise SystemExit(f"relaxkv-sglang: {HICACHE_BACKEND_ENV}={backend!r}: must be one of {', '.join(known_backends())}")
    raw = env.get(HICACHE_EXTRA_ENV) or "{}"
    try:
        extra = _extra_config(raw)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"relaxkv-sglang: {HICACHE_EXTRA_ENV}={raw!r}: {exc}") from None
    page_kb = _gb(env, HICACHE_PAGE_KB_ENV, 256.0, "KB")
    if page_kb < 4 or page_kb != int(page_kb):
        raise SystemExit(f"relaxkv-sglang: {HICACHE_PAGE_KB_ENV}={env.get(HICACHE_PAGE_KB_ENV)!r}: must be a whole number >= 4")
    timeout = _gb(env, HICACHE_TIMEOUT_ENV, 30.0, "seconds")
    bounds = {}
    for name, field, default in ((HICACHE_CALL_TIMEOUT_ENV, "call_timeout_s", 2.0),
                                 (HICACHE_RECONNECT_MAX_ENV, "reconnect_max_s", 30.0)):
        bounds[field] = _gb(env, name, default, "seconds")
        if bounds[field] <= 0:
            raise SystemExit(f"relaxkv-sglang: {name}={env.get(name)!r}: must be > 0")
    return HiCacheTierConfig(backend, extra, int(page_kb) << 10, timeout, **bounds)


def build_tiers(config: TierConfig, pool_kv: PoolKV, identity: ModelIdentity, max_tokens: int) -> TieredChunkStore:
    """The lower tiers for this pool's KV layout, fastest first (those the config asks for);
    ``max_tokens``: the most tokens a stored value may hold (the context length)."""
    configs = [HostTierConfig(config.host_bytes, config.host_policy),
               DiskTierConfig(config.disk_dir, config.disk_bytes), config.hicache]
    ctx = TierContext(identity, tuple(pool_kv.token_shape), pool_kv.dtype, max_tokens=max_tokens)
    return TieredChunkStore([tier for c in configs if (tier := c.build(ctx)) is not None], identity)
