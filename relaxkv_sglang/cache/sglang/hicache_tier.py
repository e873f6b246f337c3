"""The chunk tier on SGLang's HiCache storage backends (Mooncake, 3FS, NIXL, a folder, ...).

A :class:`~relaxkv_sglang.cache.tiers.paged.PageStore` over any backend SGLang's
``StorageBackendFactory`` knows, built as ``managers/cache_controller.py`` builds it (``model_name``
``"relaxkv"`` keeps these pages apart from HiCache's own). Zero-copy backends use ``batch_get_v1`` /
``batch_set_v1``, the others ``get`` / ``set``; one lock serialises the staging buffer. The tier runs
over a :class:`~relaxkv_sglang.cache.tiers.reconnect.ReconnectingPageStore` (a Mooncake master is
first probed with a TCP connect); details: ``docs/api.md``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

import torch

from relaxkv_sglang.cache.tiers import (
    PagedTier, PageStore, TierConfig, TierConfigError, TierContext, ValueLayout, env_number,
)
from relaxkv_sglang.cache.tiers.reconnect import ReconnectingPageStore

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

logger = logging.getLogger(__name__)

# The backends SGLang 0.5.23's cache controller drives through batch_get_v1 / batch_set_v1.
ZERO_COPY_BACKENDS = frozenset({"hf3fs", "mooncake", "npu_memcache", "eic", "nixl", "simm", "mori", "tensorcast",
                                "seaweedfs"})
STAGING_PAGES = 64  # pages moved per backend call at most (the registered buffer: 64 x page_bytes)


def known_backends() -> list[str]:
    """The backend names SGLang's factory accepts (its registry, and ``dynamic``)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    return sorted(StorageBackendFactory._registry) + ["dynamic"]


def uses_zero_copy(backend: str, extra_config: dict) -> bool:
    """Whether SGLang drives ``backend`` through its v1 (page index) calls (module doc)."""
    return backend in ZERO_COPY_BACKENDS or (backend == "dynamic" and bool(extra_config.get("interface_v1", 0)))


class StagingPool:
    """The host pool a backend registers and moves pages through: ``kv_buffer`` uint8 ``[pages, page_bytes]``."""

    page_size = 1  # one page per index
    layout = "page_first"
    dtype = torch.uint8

    def __init__(self, pages: int, page_bytes: int) -> None:
        """``page_bytes`` is even: a K half and a V half."""
        if page_bytes % 2:
            raise ValueError(f"page_bytes must be even, got {page_bytes}")
        self.kv_buffer = torch.zeros(pages, page_bytes, dtype=torch.uint8)
        self.size = pages
        self.page_bytes = page_bytes

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """Pointers and sizes of each page's K half and V half, pages in ``indices`` order."""
        half = self.page_bytes // 2
        ptrs = []
        for i in indices.tolist():
            base = self.kv_buffer[int(i)].data_ptr()
            ptrs += [base, base + half]
        return ptrs, [half] * len(ptrs)

    def get_ksize_per_token(self) -> int:
        """Bytes of one page's K half."""
        return self.page_bytes // 2

    def get_size_per_token(self) -> int:
        """Bytes of one page."""
        return self.page_bytes


class HiCachePageStore(PageStore):
    def __init__(self, backend: HiCacheStorage, name: str, zero_copy: bool, pool: StagingPool) -> None:
        """``zero_copy``: SGLang's v1 calls; ``pool``: the staging pool the backend registered."""
        self.backend, self.name, self.zero_copy, self.pool = backend, name, zero_copy, pool
        self.page_bytes = pool.page_bytes
        self.lock = threading.Lock()

    def describe(self) -> dict:
        """The backend's name."""
        return {"backend": self.name}

    def close(self) -> None:
        """The backend's ``close``, where it has one (a store dropped for a new connection)."""
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each page is stored (``batch_exists`` per key: it answers a prefix count)."""
        return [int(self.backend.batch_exists([k]) or 0) >= 1 for k in keys]

    def get(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        """Each page's bytes, or None, moved through the staging pool in turns."""
        return self._in_turns(list(keys), None, self._get_turn)

    def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> list[bool]:
        """Store each page, moved through the staging pool in turns."""
        return self._in_turns(list(keys), list(pages), self._put_turn)

    def _in_turns(self, keys: list[str], pages: Optional[list[bytes]], turn: Callable) -> list:
        out: list = []
        step = self.pool.size
        with self.lock:
            for i in range(0, len(keys), step):
                out += turn(keys[i: i + step], pages[i: i + step] if pages is not None else None)
        return out

    def _get_turn(self, keys: list[str], _: None) -> list[Optional[bytes]]:
        buf = self.pool.kv_buffer
        if self.zero_copy:
            ok = self.backend.batch_get_v1(keys, torch.arange(len(keys), dtype=torch.int64))
        else:
            ok = [self._generic_get(k, buf[i]) for i, k in enumerate(keys)]
        return [buf[i].numpy().tobytes() if good else None for i, good in enumerate(ok)]

    def _generic_get(self, key: str, page: torch.Tensor) -> bool:
        try:
            return self.backend.get(key, page) is not None
        except OSError:  # e.g. the file backend's short read of a damaged page: absent
            return False

    def _put_turn(self, keys: list[str], pages: list[bytes]) -> list[bool]:
        buf = self.pool.kv_buffer
        for i, page in enumerate(pages):
            buf[i].copy_(torch.frombuffer(bytearray(page), dtype=torch.uint8))
        if self.zero_copy:
            return [bool(x) for x in self.backend.batch_set_v1(keys, torch.arange(len(keys), dtype=torch.int64))]
        return [bool(self.backend.set(k, buf[i])) for i, k in enumerate(keys)]


def _master_address(extra_config: dict) -> Optional[tuple[str, int]]:
    """The Mooncake master's (host, port), None if not named; ValueError unless ``HOST:PORT`` (no host
    is never taken to mean this machine)."""
    address = extra_config.get("master_server_address")
    if not address:
        return None
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"master_server_address {address!r}: must be HOST:PORT")
    return host, int(port)


#: where SGLang's Mooncake store looks for the address to advertise, before the config's ``local_hostname``
#: (``mem_cache/storage/mooncake_store/mooncake_store.py``, ``MooncakeStoreConfig._resolve_local_hostname``)
LOCAL_HOSTNAME_ENVS = ("MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME")


def with_local_hostname(backend: str, extra_config: dict, env: Mapping[str, str]) -> dict:
    """``extra_config`` with the Mooncake client's ``local_hostname`` set to this host's address on the route
    to the master, unless the environment or the config names one: SGLang's default, ``localhost``, is an
    address peers on other hosts cannot reach (SGLang #23457). A UDP ``connect`` (it sends nothing) picks
    the interface the kernel would send from, the one the peers share with the master."""
    if backend != "mooncake" or extra_config.get("local_hostname") or any(env.get(k) for k in LOCAL_HOSTNAME_ENVS):
        return extra_config
    master = _master_address(extra_config)
    if master is None:
        return extra_config
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(master[0]), master[1]))
            own = s.getsockname()[0]
    except OSError as exc:
        raise ValueError(f"master_server_address {master[0]}:{master[1]}: no route to it to take this host's "
                         f"address from ({exc}); set local_hostname in the config") from None
    return {**extra_config, "local_hostname": own}


def _probe_master(extra_config: dict, timeout_s: float) -> Optional[str]:
    """Why a Mooncake master named in the config cannot be reached, or None (module doc)."""
    master = _master_address(extra_config)
    if master is None:
        return None
    host, port = master
    address = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except (OSError, ValueError) as exc:
        return f"master_server_address {address}: {exc}"


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



@dataclasses.dataclass(frozen=True)
class HiCacheTierConfig(TierConfig):
    """The HiCache tier asked for (``RELAXKV_HICACHE_*``, :meth:`from_env`); ``backend`` None: no such tier."""

    backend: Optional[str] = None
    extra_config: dict = dataclasses.field(default_factory=dict)
    page_bytes: int = 256 << 10
    connect_timeout_s: float = 30.0
    call_timeout_s: float = 2.0
    reconnect_max_s: float = 30.0

    BACKEND_ENV = "RELAXKV_HICACHE_STORAGE_BACKEND"
    EXTRA_ENV = "RELAXKV_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG"
    PAGE_KB_ENV = "RELAXKV_HICACHE_PAGE_KB"
    CONNECT_TIMEOUT_ENV = "RELAXKV_HICACHE_CONNECT_TIMEOUT_S"
    CALL_TIMEOUT_ENV = "RELAXKV_HICACHE_CALL_TIMEOUT_S"
    RECONNECT_MAX_ENV = "RELAXKV_HICACHE_RECONNECT_MAX_S"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Optional["HiCacheTierConfig"]:
        """The ``*_ENV`` variables (docs/api.md), read as SGLang reads ``--hicache-storage-backend[-extra-config]``."""
        backend = env.get(cls.BACKEND_ENV) or None
        if backend is None:
            return None
        if backend not in known_backends():
            raise TierConfigError(f"{cls.BACKEND_ENV}={backend!r}: must be one of {', '.join(known_backends())}")
        raw = env.get(cls.EXTRA_ENV) or "{}"
        try:
            extra = with_local_hostname(backend, _extra_config(raw), env)
            _master_address(extra)  # HOST:PORT, checked here rather than at the first connect
        except (OSError, ValueError) as exc:
            raise TierConfigError(f"{cls.EXTRA_ENV}={raw!r}: {exc}") from None
        page_kb = env_number(env, cls.PAGE_KB_ENV, 256.0, "KB")
        if page_kb < 4 or page_kb != int(page_kb):
            raise TierConfigError(f"{cls.PAGE_KB_ENV}={env.get(cls.PAGE_KB_ENV)!r}: must be a whole number >= 4")
        timeout = env_number(env, cls.CONNECT_TIMEOUT_ENV, 30.0, "seconds")
        bounds = {}
        for name, field, default in ((cls.CALL_TIMEOUT_ENV, "call_timeout_s", 2.0),
                                     (cls.RECONNECT_MAX_ENV, "reconnect_max_s", 30.0)):
            bounds[field] = env_number(env, name, default, "seconds")
            if bounds[field] <= 0:
                raise TierConfigError(f"{name}={env.get(name)!r}: must be > 0")
        return cls(backend, extra, int(page_kb) << 10, timeout, **bounds)

    def summary(self) -> str:
        """The startup line's phrase: the backend and its page size."""
        advertised = self.extra_config.get("local_hostname")
        return (f"hicache {self.backend} ({self.page_bytes}-byte pages"
                + (f", this host advertised as {advertised})" if advertised else ")"))

    def build(self, ctx: TierContext) -> Optional[PagedTier]:
        """The tier, over a store that may be down now and reconnects (module doc); None without a backend."""
        if not self.backend:
            return None
        why = _probe_master(self.extra_config, min(self.connect_timeout_s, 5.0))
        store = None
        if why is None:
            store, why = self._connect()
        if store is not None:
            logger.info("relaxkv: hicache chunk tier on backend %s (%s I/O, %d-byte pages)", self.backend,
                        "zero-copy" if store.zero_copy else "generic", self.page_bytes)
        pages = ReconnectingPageStore(
            self.reconnect, self.page_bytes, name=f"hicache chunk tier (backend {self.backend})",
            info={"backend": self.backend}, store=store, why_down=why, call_timeout_s=self.call_timeout_s,
            backoff_min_s=min(1.0, self.reconnect_max_s), backoff_max_s=self.reconnect_max_s)
        return PagedTier(pages, ValueLayout.of(ctx.identity, ctx.token_shape, ctx.dtype, max_tokens=ctx.max_tokens),
                         slow_s=self.call_timeout_s)

    def reconnect(self) -> HiCachePageStore:
        """The master probed, then the backend built (on the reconnect thread); raises while it is down."""
        why = _probe_master(self.extra_config, min(self.connect_timeout_s, 5.0))
        if why is not None:
            raise ConnectionError(why)
        return self.connect()

    def _connect(self) -> tuple[Optional[HiCachePageStore], str]:
        """The backend built on a thread within ``connect_timeout_s``: (store, "") or (None, why)."""
        result: dict = {}

        def build() -> None:
            """Connect, leaving the store or the error in ``result``."""
            try:
                result["store"] = self.connect()
            except BaseException as exc:  # noqa: BLE001 - reported by the caller in one line
                result["error"] = f"{type(exc).__name__}: {exc}"

        thread = threading.Thread(target=build, name="relaxkv-hicache-connect", daemon=True)
        thread.start()
        thread.join(self.connect_timeout_s)
        if "store" in result:
            return result["store"], ""
        return None, result.get("error", f"not ready after {self.connect_timeout_s:.0f} s")

    def connect(self) -> HiCachePageStore:
        """Build and register the backend as SGLang's HiCache does (module doc); raises on failure."""
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        pool = StagingPool(STAGING_PAGES, self.page_bytes)
        config = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=True, model_name="relaxkv",
            # no environment given: SGLang reads MOONCAKE_LOCAL_HOSTNAME / LOCAL_HOSTNAME before the config anyway
            extra_config=with_local_hostname(self.backend, dict(self.extra_config), {}))
        backend = StorageBackendFactory.create_backend(self.backend, config, pool)
        backend.register_mem_pool_host(pool)
        backend.on_host_pools_registered()
        return HiCachePageStore(backend, self.backend, uses_zero_copy(self.backend, self.extra_config), pool)
