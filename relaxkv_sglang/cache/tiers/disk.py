"""The disk tier: one fsynced, checksummed file per chunk in a bounded folder, shared by processes.

``DIR/<key[:2]>/<key>.kv`` holds the chunk's value (:mod:`.value`), written to a private temp file
``.tmp.<key>.<pid>.<random>`` beside it, fsynced, renamed over the final name and the folder fsynced:
a reader sees a whole file or none, whoever wrote it and whenever it died. A damaged or foreign file
is a counted miss, removed. The bound evicts least recently used files (a load touches the mtime, so
every process sees the order); a process re-scans the folder when its own view is full (at most every
``rescan_s``), so with N writers the bound may be exceeded by what the others wrote since. Temp files
of dead writers go at startup. docs/reliability.md, "Lower tiers: faults and restarts".
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import OrderedDict
from typing import Mapping, Optional, Sequence

import torch

from relaxkv_sglang.cache.tiers.keys import ModelIdentity
from relaxkv_sglang.cache.tiers.names import TierName
from relaxkv_sglang.cache.tiers.record import ChunkRecord
from relaxkv_sglang.cache.tiers.env import TierConfigError, env_number
from relaxkv_sglang.cache.tiers.record import GB
from relaxkv_sglang.cache.tiers.tier import Tier, TierConfig, TierContext, TierRole
from relaxkv_sglang.cache.tiers.value import MAGIC, Damaged, ValueLayout, decode_value, encode_value

__all__ = ["DiskTier", "DiskTierConfig", "MAGIC"]

_TMP_PREFIX = ".tmp."
_SUFFIX = ".kv"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _suppress_missing:
    """Ignore an OSError (a file another process removed first, or a folder gone)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        return exc_type is not None and issubclass(exc_type, OSError)


class DiskTier(Tier):
    name = TierName.DISK
    role = TierRole(write_through=True, prefetchable=True)

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, identity: ModelIdentity | str,
                 token_shape: Sequence[int], dtype: torch.dtype, rescan_s: float = 5.0,
                 stale_tmp_s: float = 600.0) -> None:
        """``capacity_bytes`` bounds the folder's ``.kv`` files, whatever their model; ``stale_tmp_s``: older
        temp files are removed at startup even if their pid lives."""
        self.root = os.fspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.capacity_bytes = int(capacity_bytes)
        self.layout = ValueLayout.of(identity, token_shape, dtype)
        self.identity = self.layout.identity
        self.token_shape = list(self.layout.token_shape)
        self.dtype = dtype
        self.token_bytes = self.layout.token_bytes
        self.rescan_s = rescan_s
        self.stale_tmp_s = stale_tmp_s
        self.lock = threading.Lock()  # the writer thread and the scheduler thread share the index
        self.index: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recently used first
        self.used = 0
        self.last_scan = 0.0
        self.counters = dict(hits=0, misses=0, hit_bytes=0, writes=0, written_bytes=0, already_present=0,
                             rejected=0, write_errors=0, evictions=0, evicted_bytes=0, corrupt=0, foreign=0,
                             stale_tmp_removed=0)
        self.scan(startup=True)


    def path(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key + _SUFFIX)

    def scan(self, startup: bool = False) -> None:
        """Rebuild the index from the folder (oldest mtime first); at startup remove dead temp files."""
        found = []
        now = time.time()
        for sub in os.scandir(self.root):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for f in os.scandir(sub.path):
                try:
                    st = f.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if f.name.startswith(_TMP_PREFIX):
                    if startup and self._stale_tmp(f.name, now - st.st_mtime):
                        with _suppress_missing():
                            os.unlink(f.path)
                            self._count("stale_tmp_removed", 1)
                    continue
                if f.name.endswith(_SUFFIX):
                    found.append((st.st_mtime_ns, f.name[: -len(_SUFFIX)], st.st_size))
        found.sort()
        with self.lock:
            self.index = OrderedDict((k, size) for _, k, size in found)
            self.used = sum(size for _, _, size in found)
            self.last_scan = time.monotonic()

    def _stale_tmp(self, name: str, age_s: float) -> bool:
        try:
            pid = int(name.split(".")[3])
        except (IndexError, ValueError):
            return True
        return age_s > self.stale_tmp_s or not _pid_alive(pid)

    def _count(self, name: str, n: int = 1) -> None:
        with self.lock:  # the writer and prefetch threads count too
            self.counters[name] += n

    def count_write_error(self) -> None:
        self._count("write_errors")

    def count_refused(self) -> None:
        self._count("rejected")

    def describe(self) -> dict:
        return {"dir": self.root}


    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        out = []
        for key in keys:
            with self.lock:
                known = key in self.index
            out.append(known or os.path.exists(self.path(key)))  # another process may have written it
        return out

    def batch_get(self, keys: Sequence[str]) -> list[Optional[ChunkRecord]]:
        return [self._get(k) for k in keys]

    def _get(self, key: str) -> Optional[ChunkRecord]:
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:  # FileNotFoundError, or unreadable
            self._forget(key)
            self._count("misses", 1)
            return None
        try:
            record = decode_value(key, data, self.layout)
        except Damaged as exc:
            self._count(exc.kind, 1)
            self._count("misses", 1)
            with _suppress_missing():
                os.unlink(path)
            self._forget(key)
            return None
        with _suppress_missing():
            os.utime(path)  # recency, visible to every process sharing the folder
        with self.lock:
            if key not in self.index:
                self.used += len(data)
            self.index[key] = len(data)
            self.index.move_to_end(key)
        self._count("hits", 1)
        self._count("hit_bytes", len(data))
        return record

    def _forget(self, key: str) -> None:
        with self.lock:
            size = self.index.pop(key, None)
            if size is not None:
                self.used -= size

    def encode(self, key: str, record: ChunkRecord) -> bytes:
        """The file's bytes for ``record`` under ``key`` (:func:`~.value.encode_value`)."""
        return encode_value(key, record, self.layout)

    def batch_set(self, keys: Sequence[str], records: Sequence[ChunkRecord]) -> list[bool]:
        return [self._set(k, r) for k, r in zip(keys, records)]

    def _set(self, key: str, record: ChunkRecord) -> bool:
        path = self.path(key)
        if os.path.exists(path):
            self._count("already_present", 1)
            return True
        data = self.encode(key, record)
        if len(data) > self.capacity_bytes:
            self._count("rejected", 1)
            return False
        self._make_room(len(data))
        if not self._write_file(key, path, data):
            return False
        with self.lock:
            if key not in self.index:
                self.used += len(data)
            self.index[key] = len(data)
        self._count("writes", 1)
        self._count("written_bytes", len(data))
        return True

    def _write_file(self, key: str, path: str, data: bytes) -> bool:
        """Write ``data`` to ``path`` atomically and durably (module doc); False (counted) on an error."""
        folder = os.path.dirname(path)
        tmp = os.path.join(folder, f"{_TMP_PREFIX}{key}.{os.getpid()}.{os.urandom(4).hex()}")
        try:
            os.makedirs(folder, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            dfd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dfd)  # the rename itself survives a crash
            finally:
                os.close(dfd)
        except OSError:
            self._count("write_errors", 1)
            with _suppress_missing():
                os.unlink(tmp)
            return False
        return True

    def _make_room(self, nbytes: int) -> None:
        """Evict least recently used files until ``nbytes`` more fit under the bound."""
        if self.used + nbytes > self.capacity_bytes and time.monotonic() - self.last_scan >= self.rescan_s:
            self.scan()  # other processes may have written or removed files
        while True:
            with self.lock:
                if self.used + nbytes <= self.capacity_bytes or not self.index:
                    return
                key, size = self.index.popitem(last=False)
                self.used -= size
            with _suppress_missing():
                os.unlink(self.path(key))
            self._count("evictions", 1)
            self._count("evicted_bytes", size)

    def delete(self, key: str) -> bool:
        self._forget(key)
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            return False
        return True

    def stats(self) -> dict:
        with self.lock:
            return dict(self.counters, entries=len(self.index), bytes_held=self.used,
                        capacity_bytes=self.capacity_bytes)


@dataclasses.dataclass(frozen=True)
class DiskTierConfig(TierConfig):
    """The disk tier asked for; ``root`` None: none."""

    root: Optional[str] = None
    capacity_bytes: int = 0

    DIR_ENV = "RELAXKV_CHUNK_DIR"
    GB_ENV = "RELAXKV_DISK_CACHE_GB"
    DEFAULT_GB = 10.0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Optional["DiskTierConfig"]:
        """``RELAXKV_CHUNK_DIR`` (unset: none; created if missing, must be a writable folder) and
        ``RELAXKV_DISK_CACHE_GB`` (default 10, > 0 with a folder)."""
        root = env.get(cls.DIR_ENV) or None
        gb = env_number(env, cls.GB_ENV, cls.DEFAULT_GB, "GB")
        if root is None:
            return None
        if os.path.exists(root) and not os.path.isdir(root):
            raise TierConfigError(f"{cls.DIR_ENV}={root!r}: exists and is not a directory")
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as exc:
            raise TierConfigError(f"{cls.DIR_ENV}={root!r}: cannot create it ({exc.strerror})") from None
        if not os.access(root, os.W_OK | os.X_OK):
            raise TierConfigError(f"{cls.DIR_ENV}={root!r}: not writable")
        if gb <= 0:
            raise TierConfigError(f"{cls.GB_ENV}={env.get(cls.GB_ENV)!r}: must be > 0 with {cls.DIR_ENV}")
        return cls(root, int(gb * GB))

    def summary(self) -> str:
        return f"disk {self.root} ({self.capacity_bytes} bytes)"

    def build(self, ctx: TierContext) -> Optional[DiskTier]:
        if not self.root:
            return None
        return DiskTier(self.root, self.capacity_bytes, ctx.identity, ctx.token_shape, ctx.dtype)
