"""Lower tiers of the chunk store: bounded host memory and a bounded local-disk directory.

The device tier is :class:`~relaxkv_sglang.core.chunk_store.ChunkStore` (chunk KV in KV-pool
slots). This module keeps chunk KV off the device, in two tiers behind one storage interface:

    device pool  --evict: spill-->  host tier (HostTier)  --evict-->  gone
         |  ^                            |                            (the disk copy stays)
  publish|  |load at admission           |
         v  |                            v
    disk tier (DiskTier, write-through on publish, fsynced, LRU-bounded, shared by processes)

**Keys** (:func:`chunk_key`) are content addresses: ``sha256("relaxkv-chunk-v1" || identity
|| namespace || token ids)``, hex. ``identity`` is :class:`ModelIdentity`'s digest: the model
(name, config, a fingerprint of its weight files), the tokenizer (a hash of its files), the
KV dtype and layout (layers, KV heads, head dim, the RoPE the canonical K is rotated with) and
the file format version. Two servers share a key only if they would compute the same KV for
the same tokens in the same tenant namespace; another namespace, model, dtype or layout never
names the same file.

**Records** (:class:`ChunkRecord`): ``kv`` is ``[n_tokens, layers, 2, kv_heads, head_dim]``
(token-major, K then V, K rotated to ``canonical_start``), one row of ``token_bytes`` bytes per
token. ``nbytes = n_tokens * token_bytes``.

**Interface** (:class:`ChunkStorage`): shaped like SGLang HiCache's storage backends
(``hicache_storage.HiCacheStorage``): ``batch_exists`` / ``batch_get`` / ``batch_set`` over
lists of string keys, host-memory buffers in and out. Unlike HiCache's prefix-chained page
keys, each key names one whole chunk and ``batch_exists`` answers per key (no prefix rule).
A distributed backend (Mooncake store, 3FS, Redis/Valkey) implements the same five methods.

**Host tier** (:class:`HostTier`): one pre-allocated ``uint8 [capacity_tokens, token_bytes]``
buffer (pages touched only when written, so resident memory never exceeds the bound), a free
list of rows, and an LRU of chunks. Admission (``policy``):

* ``lru``: every spilled chunk is admitted, evicting the least recently used;
* ``tinylfu`` (default): a chunk that needs victims is admitted only if its estimated access
  frequency is higher than every victim's (TinyLFU, Einziger et al. 2017). Frequencies come
  from :class:`FrequencySketch`: a count-min sketch (4 rows, 4-bit counters) of every chunk
  lookup the server makes, halved every ``10 * width`` increments, so it forgets. A flood of
  one-shot keys (frequency 1) cannot push out chunks used twice or more; an empty tier (or
  room left) admits anything.

  Every ``capacity / 16`` bytes stored the tier returns the C heap's free pages to the OS
  (:func:`release_free_heap`), so transient per-chunk buffers do not stay resident beside it.

**Disk tier** (:class:`DiskTier`): one file per chunk, ``DIR/<key[:2]>/<key>.kv``:

    magic "RKVCHNK1" | u32 header length | header JSON | payload
    header: key, identity digest, n_tokens, token_bytes, token shape, dtype, canonical_start,
            payload length, crc32 of the payload

Written to ``DIR/<key[:2]>/.tmp.<key>.<pid>.<random>``, flushed, ``fsync``-ed, renamed over the
final name (atomic on POSIX) and the folder ``fsync``-ed: a reader sees a whole file or none,
whatever process wrote it and whenever it died. A load checks magic, header, key, identity,
sizes and the crc32; any mismatch is a miss, counted (``corrupt`` / ``foreign``) and the file
removed: never served. The bound (``capacity_bytes``) is kept by evicting the least recently
used files (a load touches the file's mtime, so every process sharing the folder sees the
order); a record larger than the bound is refused (``rejected``). Several processes may share
one folder: writes are atomic renames of private temp files, a file being deleted by one
process stays readable to another that has it open, each process re-scans the folder when its
own view says it is full (at most every ``rescan_s``), and temp files of dead writers are
removed at startup. The bound holds per process view; with N writers it may be exceeded by
what the others wrote since the last scan.

:class:`AsyncWriter` runs disk writes on a background thread (bounded queue, in bytes; a write
that does not fit is dropped and counted), so the scheduler thread never waits on ``fsync``.

:class:`TieredChunkStore` puts it together for the server: ``get`` (host, then disk),
``spill`` (device eviction -> host, admission-checked; or -> disk if no host tier and the disk
lacks it), ``publish`` (a newly computed chunk -> disk, asynchronously), ``prefetch`` (disk
reads for chunks queued requests will need, on a background thread, staged until ``get``
takes them, at most ``max_staged_bytes``), ``record_access``
(the admission sketch) and per-tier counters.

This module imports only the standard library and torch.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import queue
import struct
import sys
import threading
import time
import zlib
from abc import ABC, abstractmethod
from array import array
from collections import OrderedDict
from typing import Callable, Iterable, Optional, Sequence

import torch

__all__ = [
    "FORMAT_VERSION", "ModelIdentity", "ChunkRecord", "chunk_key", "ChunkStorage", "FrequencySketch",
    "HostTier", "DiskTier", "release_free_heap", "AsyncWriter", "TieredChunkStore", "simulate_tier",
]

FORMAT_VERSION = 1
MAGIC = b"RKVCHNK1"
_TMP_PREFIX = ".tmp."
_SUFFIX = ".kv"
GB = 1 << 30


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    """What must match for two servers to share chunk KV.

    Attributes:
        model: the model's identity (e.g. name + config hash + weight-file fingerprint).
        tokenizer: a hash of the tokenizer's files.
        kv_dtype: the KV pool's dtype, e.g. ``"torch.float32"``.
        kv_layout: layers, KV heads, head dim and the RoPE canonical K is rotated with.
    """

    model: str
    tokenizer: str
    kv_dtype: str
    kv_layout: str

    @property
    def digest(self) -> str:
        """32 hex chars of sha256 over the fields and the format version."""
        text = json.dumps([FORMAT_VERSION, self.model, self.tokenizer, self.kv_dtype, self.kv_layout])
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def chunk_key(identity: ModelIdentity | str, namespace: str | None, token_ids: Sequence[int]) -> str:
    """The content address of one chunk (64 hex chars).

    Args:
        identity: the model identity (or its digest).
        namespace: the tenant namespace (None: the shared default; distinct from ``""``).
        token_ids: the chunk's token ids.
    """
    digest = identity.digest if isinstance(identity, ModelIdentity) else identity
    ns = b"\x00" if namespace is None else b"\x01" + namespace.encode("utf-8")
    tokens = array("q", (int(t) for t in token_ids))
    if sys.byteorder != "little":
        tokens.byteswap()
    h = hashlib.sha256(b"relaxkv-chunk-v1\x00")
    h.update(digest.encode() + b"\x00")
    h.update(struct.pack("<Q", len(ns)) + ns)
    h.update(struct.pack("<Q", len(tokens)) + tokens.tobytes())
    return h.hexdigest()


@dataclasses.dataclass
class ChunkRecord:
    """One chunk's KV in host memory.

    Attributes:
        kv: ``[n_tokens, layers, 2, kv_heads, head_dim]`` on the CPU (K rotated to ``canonical_start``).
        canonical_start: the position the chunk's K was rotated at.
    """

    kv: torch.Tensor
    canonical_start: int = 0

    @property
    def n_tokens(self) -> int:
        return int(self.kv.shape[0])

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def rows(self) -> torch.Tensor:
        """uint8 ``[n_tokens, token_bytes]`` view of the KV (contiguous)."""
        kv = self.kv.contiguous()
        return kv.view(torch.uint8).reshape(kv.shape[0], -1)


class ChunkStorage(ABC):
    """Batch get/set/exists of chunk records by key (HiCache's storage backend shape, module doc)."""

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (a hint: a later get may still miss)."""

    @abstractmethod
    def batch_get(self, keys: Sequence[str]) -> list[Optional[ChunkRecord]]:
        """Each key's record, or None (a miss; a damaged entry is a miss)."""

    @abstractmethod
    def batch_set(self, keys: Sequence[str], records: Sequence[ChunkRecord]) -> list[bool]:
        """Store each record; False where it was not stored (refused, no room, error)."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove a key; True if it was there."""

    @abstractmethod
    def stats(self) -> dict:
        """Counters (cumulative) and current occupancy."""

    def exists(self, key: str) -> bool:
        return self.batch_exists([key])[0]

    def get(self, key: str) -> Optional[ChunkRecord]:
        return self.batch_get([key])[0]

    def set(self, key: str, record: ChunkRecord) -> bool:
        return self.batch_set([key], [record])[0]


def _key_hash(key: str) -> int:
    try:
        return int(key[:16], 16)
    except ValueError:
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


class FrequencySketch:
    """Approximate access counts (count-min sketch, 4 rows of 4-bit counters, periodic halving).

    ``estimate(key)`` never under-counts since the last halving; ``increment`` halves every
    counter after ``sample_size`` increments, so old popularity fades.
    """

    ROWS = 4
    MAX = 15

    def __init__(self, width: int = 4096, sample_size: int | None = None) -> None:
        w = 1
        while w < max(16, width):
            w <<= 1
        self.width = w
        self.sample_size = sample_size or 10 * w
        self.table = [bytearray(w) for _ in range(self.ROWS)]
        self.additions = 0

    def _indices(self, key: str) -> list[int]:
        h = _key_hash(key)
        mask = self.width - 1
        out = []
        for row in range(self.ROWS):
            h = (h * 0x9E3779B97F4A7C15 + row + 1) & 0xFFFFFFFFFFFFFFFF
            out.append((h >> 20) & mask)
        return out

    def increment(self, key: str) -> None:
        for row, i in zip(self.table, self._indices(key)):
            if row[i] < self.MAX:
                row[i] += 1
        self.additions += 1
        if self.additions >= self.sample_size:
            for row in self.table:
                for i in range(self.width):
                    row[i] >>= 1
            self.additions //= 2

    def estimate(self, key: str) -> int:
        return min(row[i] for row, i in zip(self.table, self._indices(key)))


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim(0)``); True if done.

    The per-chunk buffers a server makes while spilling (``>= 128 KiB``) come, once glibc has
    raised its mmap threshold, from the heap and from the arenas of torch's threads, whose free
    holes stay resident: measured here, a process pushing 4x a 64 MiB tier through it grew by
    110-133 MiB in some runs, 70 in others. The host tier calls this after every
    ``capacity / 16`` bytes (at least 8 MiB) it stores, so the process's growth stays near the
    bound. (Pinning the mmap threshold instead made torch's CPU forward 60% slower.) Not glibc:
    nothing is done.
    """
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


@functools.lru_cache(maxsize=1)
def _libc():
    """glibc, or None where there is none."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


class HostTier(ChunkStorage):
    """Bounded host-memory tier (module doc): one pre-allocated buffer, LRU, TinyLFU admission."""

    POLICIES = ("tinylfu", "lru")

    def __init__(self, capacity_bytes: int, token_shape: Sequence[int], dtype: torch.dtype,
                 policy: str = "tinylfu", sketch: FrequencySketch | None = None) -> None:
        """
        Args:
            capacity_bytes: the bound (rounded down to whole token rows).
            token_shape: one token's KV shape, ``(layers, 2, kv_heads, head_dim)``.
            dtype: the KV dtype.
            policy: ``tinylfu`` or ``lru`` (admission, module doc).
            sketch: shared frequency sketch (default: a new one).
        """
        if policy not in self.POLICIES:
            raise ValueError(f"host tier policy must be one of {self.POLICIES}, got {policy!r}")
        self.token_shape = tuple(int(s) for s in token_shape)
        self.dtype = dtype
        self.token_bytes = int(torch.Size(self.token_shape).numel()) * torch.empty((), dtype=dtype).element_size()
        self.capacity_tokens = max(0, int(capacity_bytes) // self.token_bytes)
        self.capacity_bytes = self.capacity_tokens * self.token_bytes
        # torch.empty does not touch the pages: resident memory grows only with what is written.
        self.buffer = torch.empty((self.capacity_tokens, self.token_bytes), dtype=torch.uint8)
        self.free = torch.arange(self.capacity_tokens, dtype=torch.int64)
        self.n_free = self.capacity_tokens
        self.policy = policy
        self.sketch = sketch if sketch is not None else FrequencySketch()
        self.entries: OrderedDict[str, tuple[torch.Tensor, int]] = OrderedDict()  # key -> (rows, start); LRU first
        self.counters = dict(hits=0, misses=0, hit_bytes=0, sets=0, set_bytes=0, rejected=0,
                             evictions=0, evicted_bytes=0)
        self.trim_every = max(8 << 20, self.capacity_bytes // 16)  # bytes stored between heap trims
        self.since_trim = 0

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def used_bytes(self) -> int:
        return (self.capacity_tokens - self.n_free) * self.token_bytes

    def record_access(self, key: str) -> None:
        """Count one access of ``key`` (every lookup, any tier) for admission."""
        self.sketch.increment(key)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.entries for k in keys]

    def batch_get(self, keys: Sequence[str]) -> list[Optional[ChunkRecord]]:
        out = []
        for key in keys:
            item = self.entries.get(key)
            if item is None:
                self.counters["misses"] += 1
                out.append(None)
                continue
            rows, start = item
            self.entries.move_to_end(key)
            kv = self.buffer.index_select(0, rows).view(self.dtype).reshape(rows.shape[0], *self.token_shape)
            self.counters["hits"] += 1
            self.counters["hit_bytes"] += rows.shape[0] * self.token_bytes
            out.append(ChunkRecord(kv, start))
        return out

    def _victims(self, n_tokens: int) -> list[str]:
        need, victims = n_tokens - self.n_free, []
        for key, (rows, _) in self.entries.items():
            if need <= 0:
                break
            victims.append(key)
            need -= rows.shape[0]
        return victims

    def would_admit(self, key: str, n_tokens: int) -> bool:
        """Whether ``set`` would store a chunk of ``n_tokens`` under ``key`` now."""
        if key in self.entries:
            return True
        if n_tokens > self.capacity_tokens or n_tokens <= 0:
            return False
        if self.policy == "lru" or n_tokens <= self.n_free:
            return True
        freq = self.sketch.estimate(key)
        return all(freq > self.sketch.estimate(v) for v in self._victims(n_tokens))

    def batch_set(self, keys: Sequence[str], records: Sequence[ChunkRecord]) -> list[bool]:
        out = []
        for key, record in zip(keys, records):
            if key in self.entries:
                self.entries.move_to_end(key)
                out.append(True)
                continue
            rows_in = record.rows()
            n = rows_in.shape[0]
            if rows_in.shape[1] != self.token_bytes:
                raise ValueError(f"record has {rows_in.shape[1]} bytes per token, the tier {self.token_bytes}")
            if not self.would_admit(key, n):
                self.counters["rejected"] += 1
                out.append(False)
                continue
            for victim in self._victims(n):
                self._remove(victim, evicted=True)
            rows = self.free[self.n_free - n: self.n_free].clone()
            self.n_free -= n
            self.buffer.index_copy_(0, rows, rows_in)  # 10x faster than buffer[rows] = ... on fresh pages
            self.entries[key] = (rows, int(record.canonical_start))
            self.counters["sets"] += 1
            self.counters["set_bytes"] += n * self.token_bytes
            self.since_trim += n * self.token_bytes
            if self.since_trim >= self.trim_every:
                self.since_trim = 0
                release_free_heap()
            out.append(True)
        return out

    def _remove(self, key: str, evicted: bool = False) -> bool:
        item = self.entries.pop(key, None)
        if item is None:
            return False
        rows = item[0]
        self.free[self.n_free: self.n_free + rows.shape[0]] = rows
        self.n_free += rows.shape[0]
        if evicted:
            self.counters["evictions"] += 1
            self.counters["evicted_bytes"] += rows.shape[0] * self.token_bytes
        return True

    def delete(self, key: str) -> bool:
        return self._remove(key)

    def clear(self) -> None:
        """Drop every entry (counters kept)."""
        for key in list(self.entries):
            self._remove(key)

    def stats(self) -> dict:
        return dict(self.counters, entries=len(self.entries), bytes_held=self.used_bytes,
                    capacity_bytes=self.capacity_bytes)


class _Damaged(Exception):
    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind  # "corrupt" or "foreign"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskTier(ChunkStorage):
    """Bounded local-disk tier: one fsynced, checksummed file per chunk (module doc)."""

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, identity: ModelIdentity | str,
                 token_shape: Sequence[int], dtype: torch.dtype, rescan_s: float = 5.0,
                 stale_tmp_s: float = 600.0) -> None:
        """
        Args:
            root: the folder (created if missing).
            capacity_bytes: the bound on the folder's ``.kv`` files (all of them, whatever model).
            identity: this server's model identity (or its digest); files of another are foreign.
            token_shape, dtype: one token's KV shape and dtype (a file that differs is foreign).
            rescan_s: least interval between re-scans of the folder when this process sees it full.
            stale_tmp_s: temp files older than this are removed at startup even if their pid lives.
        """
        self.root = os.fspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.capacity_bytes = int(capacity_bytes)
        self.identity = identity.digest if isinstance(identity, ModelIdentity) else identity
        self.token_shape = [int(s) for s in token_shape]
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.token_bytes = int(torch.Size(self.token_shape).numel()) * torch.empty((), dtype=dtype).element_size()
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

    # ------------------------------------------------------------------ paths and scans

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

    # ------------------------------------------------------------------ the interface

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
            record = self._decode(key, data)
        except _Damaged as exc:
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
        rows = record.rows()
        if rows.shape[1] != self.token_bytes:
            raise ValueError(f"record has {rows.shape[1]} bytes per token, the tier {self.token_bytes}")
        payload = rows.numpy().tobytes()
        header = json.dumps({
            "format": FORMAT_VERSION, "key": key, "identity": self.identity, "n_tokens": rows.shape[0],
            "token_bytes": self.token_bytes, "token_shape": self.token_shape, "dtype": self.dtype_name,
            "canonical_start": int(record.canonical_start), "payload_bytes": len(payload),
            "crc32": zlib.crc32(payload),
        }, sort_keys=True).encode()
        return MAGIC + struct.pack("<I", len(header)) + header + payload

    def _decode(self, key: str, data: bytes) -> ChunkRecord:
        if len(data) < len(MAGIC) + 4 or data[: len(MAGIC)] != MAGIC:
            raise _Damaged("corrupt", "bad magic or truncated")
        (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
        start = len(MAGIC) + 4
        if start + hlen > len(data):
            raise _Damaged("corrupt", "truncated header")
        try:
            header = json.loads(data[start: start + hlen])
        except ValueError:
            raise _Damaged("corrupt", "unreadable header") from None
        if not isinstance(header, dict):
            raise _Damaged("corrupt", "header is not an object")
        if (header.get("identity") != self.identity or header.get("key") != key
                or header.get("token_shape") != self.token_shape or header.get("dtype") != self.dtype_name
                or header.get("format") != FORMAT_VERSION):
            raise _Damaged("foreign", "another model, layout or key")
        payload = memoryview(data)[start + hlen:]
        n = header.get("n_tokens")
        if (not isinstance(n, int) or n <= 0 or header.get("payload_bytes") != len(payload)
                or len(payload) != n * self.token_bytes):
            raise _Damaged("corrupt", "truncated payload")
        if zlib.crc32(payload) != header.get("crc32"):
            raise _Damaged("corrupt", "checksum mismatch")
        rows = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        kv = rows.view(self.dtype).reshape(n, *self.token_shape)
        return ChunkRecord(kv, int(header.get("canonical_start", 0)))

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
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            self._count("write_errors", 1)
            with _suppress_missing():
                os.unlink(tmp)
            return False
        with self.lock:
            if key not in self.index:
                self.used += len(data)
            self.index[key] = len(data)
        self._count("writes", 1)
        self._count("written_bytes", len(data))
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


class _suppress_missing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        return exc_type is not None and issubclass(exc_type, OSError)


class AsyncWriter:
    """Disk writes on one background thread; a bounded queue (bytes) so memory stays bounded."""

    def __init__(self, disk: DiskTier, max_queued_bytes: int = 256 << 20) -> None:
        self.disk = disk
        self.max_queued_bytes = int(max_queued_bytes)
        self.queued_bytes = 0
        self.pending_keys: set[str] = set()
        self.dropped = 0
        self.cond = threading.Condition()
        self.q: "queue.Queue[tuple[str, ChunkRecord] | None]" = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="relaxkv-chunk-writer", daemon=True)
        self.thread.start()

    def submit(self, key: str, record: ChunkRecord) -> bool:
        """Queue a write; False (dropped, counted) if the queue is full or the key is already queued."""
        with self.cond:
            if key in self.pending_keys:
                return True
            if self.queued_bytes + record.nbytes > self.max_queued_bytes:
                self.dropped += 1
                return False
            self.queued_bytes += record.nbytes
            self.pending_keys.add(key)
        self.q.put((key, record))
        return True

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            key, record = item
            try:
                self.disk.set(key, record)
            except Exception:  # noqa: BLE001 - a write never takes the server down; counted
                self.disk._count("write_errors")
            finally:
                with self.cond:
                    self.queued_bytes -= record.nbytes
                    self.pending_keys.discard(key)
                    self.cond.notify_all()

    def pending(self) -> int:
        with self.cond:
            return len(self.pending_keys)

    def is_pending(self, key: str) -> bool:
        with self.cond:
            return key in self.pending_keys

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False on timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: not self.pending_keys, timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        self.drain(timeout)
        self.q.put(None)


class TieredChunkStore:
    """The host and disk tiers together, for the server (module doc)."""

    def __init__(self, identity: ModelIdentity, token_shape: Sequence[int], dtype: torch.dtype, *,
                 host_bytes: int = 0, disk_dir: str | None = None, disk_bytes: int = 0,
                 host_policy: str = "tinylfu", async_writes: bool = True, max_staged_bytes: int = 256 << 20) -> None:
        self.identity = identity
        self.digest = identity.digest
        self.sketch = FrequencySketch()
        self.host = HostTier(host_bytes, token_shape, dtype, host_policy, self.sketch) if host_bytes > 0 else None
        if self.host is not None and self.host.capacity_tokens == 0:
            self.host = None
        self.disk = DiskTier(disk_dir, disk_bytes, identity, token_shape, dtype) if disk_dir else None
        self.writer = AsyncWriter(self.disk) if self.disk is not None and async_writes else None
        # Prefetch: disk reads (and their checks) for chunks queued requests will need, on a thread,
        # staged here until a load takes them (bounded in bytes, oldest dropped first).
        self.staged: OrderedDict[str, tuple[ChunkRecord, float]] = OrderedDict()
        self.staged_bytes = 0
        self.max_staged_bytes = max_staged_bytes
        self.inflight: set[str] = set()
        self.stage_lock = threading.Condition()
        self.prefetch_q: "queue.Queue[str | None]" = queue.Queue()
        self.prefetcher: threading.Thread | None = None
        self.counters = {tier: dict(loads=0, loaded_tokens=0, loaded_bytes=0, load_seconds=0.0)
                         for tier in ("host", "disk")}
        self.counters["host"].update(spills=0, spilled_bytes=0, spill_rejected=0)
        self.counters["disk"].update(spills=0, publishes=0, publish_dropped=0, prefetched=0, prefetch_used=0,
                                     prefetch_dropped=0)

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None

    def key(self, namespace: str | None, token_ids: Sequence[int]) -> str:
        return chunk_key(self.digest, namespace, token_ids)

    def record_access(self, key: str) -> None:
        self.sketch.increment(key)

    def where(self, key: str) -> Optional[str]:
        """``"host"``, ``"disk"`` or None (a hint; ``get`` verifies)."""
        if self.host is not None and self.host.exists(key):
            return "host"
        if self.disk is not None and self.disk.exists(key):
            return "disk"
        return None

    def prefetch(self, keys: Iterable[str]) -> int:
        """Start reading (and verifying) the disk copies of ``keys`` on a background thread, for a
        later :meth:`get`; only keys not in the host tier, not staged and on disk. Returns how many
        were queued."""
        if self.disk is None:
            return 0
        queued = 0
        for key in keys:
            with self.stage_lock:
                if key in self.staged or key in self.inflight or self.staged_bytes >= self.max_staged_bytes:
                    continue
            if (self.host is not None and self.host.exists(key)) or not self.disk.exists(key):
                continue
            with self.stage_lock:
                self.inflight.add(key)
            if self.prefetcher is None:
                self.prefetcher = threading.Thread(target=self._prefetch_loop, name="relaxkv-chunk-prefetch",
                                                   daemon=True)
                self.prefetcher.start()
            self.prefetch_q.put(key)
            queued += 1
        return queued

    def _prefetch_loop(self) -> None:
        while True:
            key = self.prefetch_q.get()
            if key is None:
                return
            t0 = time.perf_counter()
            try:
                record = self.disk.get(key)
            except Exception:  # noqa: BLE001 - a failed prefetch is just not staged
                record = None
            seconds = time.perf_counter() - t0
            with self.stage_lock:
                self.inflight.discard(key)
                self.stage_lock.notify_all()
                if record is None:
                    continue
                self.staged[key] = (record, seconds)
                self.staged_bytes += record.nbytes
                self.counters["disk"]["prefetched"] += 1
                while self.staged_bytes > self.max_staged_bytes and self.staged:
                    _, (old, _) = self.staged.popitem(last=False)
                    self.staged_bytes -= old.nbytes
                    self.counters["disk"]["prefetch_dropped"] += 1

    def _take_staged(self, key: str, wait_s: float = 5.0) -> Optional[tuple[ChunkRecord, float]]:
        """The staged record of ``key``; a prefetch of it under way is waited for (not read twice)."""
        with self.stage_lock:
            self.stage_lock.wait_for(lambda: key not in self.inflight, wait_s)
            item = self.staged.pop(key, None)
            if item is not None:
                self.staged_bytes -= item[0].nbytes
            return item

    def clear_staged(self) -> None:
        with self.stage_lock:
            self.staged.clear()
            self.staged_bytes = 0

    def get(self, key: str) -> tuple[Optional[ChunkRecord], Optional[str]]:
        """The record from the highest tier holding it (verified), and that tier's name.

        A disk record a prefetch already read is taken from the stage (its read time is counted
        in ``load_seconds`` as the prefetch measured it)."""
        staged = self._take_staged(key)
        if staged is not None:
            record, seconds = staged
            c = self.counters["disk"]
            c["loads"] += 1
            c["prefetch_used"] += 1
            c["loaded_tokens"] += record.n_tokens
            c["loaded_bytes"] += record.nbytes
            c["load_seconds"] += seconds
            return record, "disk"
        for name, tier in (("host", self.host), ("disk", self.disk)):
            if tier is None:
                continue
            t0 = time.perf_counter()
            record = tier.get(key)
            if record is not None:
                c = self.counters[name]
                c["loads"] += 1
                c["loaded_tokens"] += record.n_tokens
                c["loaded_bytes"] += record.nbytes
                c["load_seconds"] += time.perf_counter() - t0
                return record, name
        return None, None

    def spill_wanted(self, key: str, n_tokens: int) -> Optional[str]:
        """Where a chunk evicted from the device would go: ``"host"``, ``"disk"`` or None."""
        if self.host is not None:
            if self.host.would_admit(key, n_tokens):
                return "host"
            self.counters["host"]["spill_rejected"] += 1
            self.host.counters["rejected"] += 1
        if self.disk is not None and not self._on_disk(key):
            return "disk"
        return None

    def spill(self, key: str, record: ChunkRecord, tier: str) -> bool:
        """Store a chunk evicted from the device in ``tier`` (from :meth:`spill_wanted`)."""
        if tier == "host":
            ok = self.host.set(key, record)
            if ok:
                self.counters["host"]["spills"] += 1
                self.counters["host"]["spilled_bytes"] += record.nbytes
            return ok
        self.counters["disk"]["spills"] += 1
        return self._write(key, record)

    def publish_wanted(self, key: str) -> bool:
        """Whether a newly computed chunk should be written to disk."""
        return self.disk is not None and not self._on_disk(key)

    def publish(self, key: str, record: ChunkRecord) -> bool:
        self.counters["disk"]["publishes"] += 1
        return self._write(key, record)

    def _on_disk(self, key: str) -> bool:
        return (self.writer is not None and self.writer.is_pending(key)) or self.disk.exists(key)

    def _write(self, key: str, record: ChunkRecord) -> bool:
        if self.writer is None:
            return self.disk.set(key, record)
        ok = self.writer.submit(key, record)
        if not ok:
            self.counters["disk"]["publish_dropped"] += 1
        return ok

    def clear_host(self) -> None:
        if self.host is not None:
            self.host.clear()

    def pending_writes(self) -> int:
        return self.writer.pending() if self.writer is not None else 0

    def stats(self) -> dict:
        """Flat counters: ``tier_host_*`` and ``tier_disk_*``."""
        out: dict = {"tier_identity": self.digest}
        for name, tier in (("host", self.host), ("disk", self.disk)):
            if tier is None:
                continue
            for k, v in {**tier.stats(), **self.counters[name]}.items():
                out[f"tier_{name}_{k}"] = v
        if self.disk is not None:
            out["tier_disk_pending_writes"] = self.pending_writes()
            out["tier_disk_staged_bytes"] = self.staged_bytes
            out["tier_disk_dir"] = self.disk.root
        return out

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.prefetcher is not None:
            self.prefetch_q.put(None)


def simulate_tier(trace: Iterable[str], capacity: int, policy: str, sizes: Callable[[str], int] | None = None) -> dict:
    """Replay a key trace through a :class:`HostTier` of ``capacity`` tokens: a miss stores the key.

    Every access is counted in the sketch first (as the server counts every lookup).
    ``sizes(key)`` is a key's tokens (default 1). Returns hits, misses and the hit rate.
    """
    tier = HostTier(capacity * 4, (1,), torch.float32, policy)
    hits = misses = 0
    for key in trace:
        n = sizes(key) if sizes else 1
        tier.record_access(key)
        if tier.exists(key):
            tier.entries.move_to_end(key)
            hits += 1
        else:
            misses += 1
            tier.set(key, ChunkRecord(torch.zeros(n, 1)))
    return {"policy": policy, "hits": hits, "misses": misses, "hit_rate": hits / max(1, hits + misses)}
