"""The self-describing bytes of one stored chunk, and the checks a load makes before serving it.

One format for every tier that stores bytes (a disk file, a HiCache storage backend's pages)::

    magic "RKVCHNK1" | u32 header length (little-endian) | header JSON | payload
    header: format, key, identity digest, n_tokens, token_bytes, token shape, dtype,
            canonical_start, payload length, crc32 of the payload
    payload: the record's KV, [n_tokens, layers, 2, kv_heads, head_dim] in the tier's dtype,
             token-major (n_tokens * token_bytes bytes)

``len(value) = 12 + header length + n_tokens * token_bytes``. A load (:func:`decode_value`)
checks, in order: magic and lengths (else ``corrupt``), the key, identity, token shape, dtype
and format version (else ``foreign``: another model, layout or key), the payload length against
``n_tokens * token_bytes`` (``corrupt``), the crc32 (``corrupt``). Any failure raises
:class:`Damaged` with its kind; the tier counts it as a miss and never serves the bytes.
Bytes after the value (padding up to a page) are ignored: :func:`value_info` reads the
length (and the payload's crc32) from the first bytes.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from typing import Sequence

import torch

from relaxkv_sglang.core.tiers.keys import FORMAT_VERSION, ModelIdentity, identity_digest
from relaxkv_sglang.core.tiers.record import ChunkRecord, token_bytes

__all__ = ["MAGIC", "PREFIX_BYTES", "Damaged", "ValueLayout", "encode_value", "decode_value", "value_info"]

MAGIC = b"RKVCHNK1"
PREFIX_BYTES = len(MAGIC) + 4  # magic and the header length


class Damaged(Exception):
    """A stored value that must not be served; ``kind`` is ``"corrupt"`` or ``"foreign"``."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


@dataclasses.dataclass(frozen=True)
class ValueLayout:
    """What a server expects of every value it loads: its model identity and one token's KV.

    Attributes:
        identity: the model identity's digest (a value of another is foreign).
        token_shape: one token's KV shape, ``(layers, 2, kv_heads, head_dim)``.
        dtype: the KV dtype.
    """

    identity: str
    token_shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, identity: ModelIdentity | str, token_shape: Sequence[int], dtype: torch.dtype) -> "ValueLayout":
        return cls(identity_digest(identity), tuple(int(s) for s in token_shape), dtype)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def token_bytes(self) -> int:
        return token_bytes(self.token_shape, self.dtype)


def encode_value(key: str, record: ChunkRecord, layout: ValueLayout) -> bytes:
    """The value's bytes for ``record`` stored under ``key`` (module doc)."""
    if tuple(record.kv.shape[1:]) != layout.token_shape or record.kv.dtype != layout.dtype:
        raise ValueError(f"record of {tuple(record.kv.shape[1:])} {record.kv.dtype} per token, "
                         f"the tier's {layout.token_shape} {layout.dtype}")
    rows = record.rows()
    payload = rows.numpy().tobytes()
    header = json.dumps({
        "format": FORMAT_VERSION, "key": key, "identity": layout.identity, "n_tokens": rows.shape[0],
        "token_bytes": layout.token_bytes, "token_shape": list(layout.token_shape), "dtype": layout.dtype_name,
        "canonical_start": int(record.canonical_start), "payload_bytes": len(payload),
        "crc32": zlib.crc32(payload),
    }, sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + payload


def _header(data: bytes | memoryview) -> tuple[dict, int]:
    """The header and the offset of the payload; :class:`Damaged` (corrupt) if unreadable."""
    if len(data) < PREFIX_BYTES or bytes(data[: len(MAGIC)]) != MAGIC:
        raise Damaged("corrupt", "bad magic or truncated")
    (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
    if PREFIX_BYTES + hlen > len(data):
        raise Damaged("corrupt", "truncated header")
    try:
        header = json.loads(bytes(data[PREFIX_BYTES: PREFIX_BYTES + hlen]))
    except ValueError:
        raise Damaged("corrupt", "unreadable header") from None
    if not isinstance(header, dict):
        raise Damaged("corrupt", "header is not an object")
    return header, PREFIX_BYTES + hlen


def value_info(head: bytes | memoryview) -> tuple[int, int]:
    """The whole value's length and its payload's crc32, read from its first bytes (at least the
    header); :class:`Damaged` if they are not a value's start."""
    header, start = _header(head)
    n, crc = header.get("payload_bytes"), header.get("crc32")
    if not isinstance(n, int) or n < 0 or not isinstance(crc, int):
        raise Damaged("corrupt", "no payload length or checksum")
    return start + n, crc


def decode_value(key: str, data: bytes | memoryview, layout: ValueLayout) -> ChunkRecord:
    """The record in ``data`` (exactly one value), checked (module doc); :class:`Damaged` if not servable."""
    header, start = _header(data)
    if (header.get("identity") != layout.identity or header.get("key") != key
            or header.get("token_shape") != list(layout.token_shape) or header.get("dtype") != layout.dtype_name
            or header.get("format") != FORMAT_VERSION):
        raise Damaged("foreign", "another model, layout or key")
    payload = memoryview(data)[start:]
    n = header.get("n_tokens")
    if (not isinstance(n, int) or n <= 0 or header.get("payload_bytes") != len(payload)
            or len(payload) != n * layout.token_bytes):
        raise Damaged("corrupt", "truncated payload")
    if zlib.crc32(payload) != header.get("crc32"):
        raise Damaged("corrupt", "checksum mismatch")
    rows = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    kv = rows.view(layout.dtype).reshape(n, *layout.token_shape)
    return ChunkRecord(kv, int(header.get("canonical_start", 0)))
