"""The self-describing bytes of one stored chunk, and the checks a load makes before serving it.

One format for every tier that stores bytes (a disk file, a HiCache storage backend's pages)::

    magic "RKVCHNK1" | u32 header length (little-endian) | header JSON | payload
    header: format, key, identity digest, n_tokens, token_bytes, token shape, dtype,
            page_bytes (the page size a paged tier lays it over; 0 for a file),
            canonical_start, payload length, crc32 of the payload
    payload: the record's KV, [n_tokens, layers, 2, kv_heads, head_dim] in the tier's dtype,
             token-major (n_tokens * token_bytes bytes)

``len(value) = 12 + header length + n_tokens * token_bytes``; bytes after it (a page's padding) are
ignored. The header is checked alone first (:func:`check_header`, a paged tier's page 0): another key,
identity, layout, page size or format is ``foreign``, sizes other than ``0 < n_tokens <= max_tokens`` of
the layout's ``token_bytes`` ``corrupt``; so a server reads at most ``max_tokens`` (its context length)
of its own layout, whatever a header claims. Then the payload's length and crc32 (``corrupt``).
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from typing import Sequence

import torch

from relaxkv_sglang.cache.tiers.keys import FORMAT_VERSION, ModelIdentity, identity_digest
from relaxkv_sglang.cache.tiers.record import ChunkRecord, token_bytes

__all__ = ["DEFAULT_MAX_TOKENS", "MAGIC", "PREFIX_BYTES", "Damaged", "ValueLayout", "check_header", "decode_value",
           "encode_value", "value_info"]

MAGIC = b"RKVCHNK1"
PREFIX_BYTES = len(MAGIC) + 4  # magic and the header length
_MAX_HEADER_BYTES = 1024  # a header is about 400 bytes; a paged tier's page holds at least this after the prefix
DEFAULT_MAX_TOKENS = 1 << 20  # the bound on a value's tokens when the server names none (its context length)


class Damaged(Exception):
    """A stored value that must not be served; ``kind`` is ``"corrupt"`` or ``"foreign"``."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


@dataclasses.dataclass(frozen=True)
class ValueLayout:
    """What a server expects of every value it loads: ``identity`` (the model identity's digest),
    ``token_shape`` ``(layers, 2, kv_heads, head_dim)``, ``page_bytes`` (a paged tier's page size, 0 for a
    file) and ``max_tokens`` (the most a value may hold)."""

    identity: str
    token_shape: tuple[int, ...]
    dtype: torch.dtype
    page_bytes: int = 0
    max_tokens: int = DEFAULT_MAX_TOKENS

    @classmethod
    def of(cls, identity: ModelIdentity | str, token_shape: Sequence[int], dtype: torch.dtype, *,
           page_bytes: int = 0, max_tokens: int = DEFAULT_MAX_TOKENS) -> "ValueLayout":
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        return cls(identity_digest(identity), tuple(int(s) for s in token_shape), dtype, int(page_bytes),
                   int(max_tokens))

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
        "page_bytes": layout.page_bytes, "canonical_start": int(record.canonical_start), "payload_bytes": len(payload),
        "crc32": zlib.crc32(payload),
    }, sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + payload


def _header(data: bytes | memoryview) -> tuple[dict, int]:
    """The header and the offset of the payload; :class:`Damaged` (corrupt) if unreadable."""
    if len(data) < PREFIX_BYTES or bytes(data[: len(MAGIC)]) != MAGIC:
        raise Damaged("corrupt", "bad magic or truncated")
    (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
    if hlen > _MAX_HEADER_BYTES:
        raise Damaged("corrupt", f"a header of {hlen} bytes")
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
    """The whole value's length and its payload's crc32, from its first bytes (the header at least)."""
    header, start = _header(head)
    n, crc = header.get("payload_bytes"), header.get("crc32")
    if not isinstance(n, int) or n < 0 or not isinstance(crc, int):
        raise Damaged("corrupt", "no payload length or checksum")
    return start + n, crc


def check_header(key: str, head: bytes | memoryview, layout: ValueLayout) -> tuple[int, int]:
    """:func:`value_info`, once the header in ``head`` names ``key``, this layout and sizes within it
    (module doc); reads nothing past the header."""
    header, start = _header(head)
    if (header.get("identity") != layout.identity or header.get("key") != key
            or header.get("token_shape") != list(layout.token_shape) or header.get("dtype") != layout.dtype_name
            or header.get("page_bytes") != layout.page_bytes or header.get("format") != FORMAT_VERSION):
        raise Damaged("foreign", "another model, layout, page size or key")
    n, size, crc = header.get("n_tokens"), header.get("payload_bytes"), header.get("crc32")
    if not isinstance(n, int) or not 0 < n <= layout.max_tokens:
        raise Damaged("corrupt", f"a header of {n!r} tokens (at most {layout.max_tokens})")
    if header.get("token_bytes") != layout.token_bytes or size != n * layout.token_bytes or not isinstance(crc, int):
        raise Damaged("corrupt", f"a header of {size!r} payload bytes for {n} tokens")
    return start + size, crc


def decode_value(key: str, data: bytes | memoryview, layout: ValueLayout) -> ChunkRecord:
    """The record in ``data`` (exactly one value), checked (module doc)."""
    length, crc = check_header(key, data, layout)
    header, start = _header(data)
    if len(data) != length:
        raise Damaged("corrupt", "truncated payload")
    payload = memoryview(data)[start:]
    if zlib.crc32(payload) != crc:
        raise Damaged("corrupt", "checksum mismatch")
    n = header["n_tokens"]
    rows = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    kv = rows.view(layout.dtype).reshape(n, *layout.token_shape)
    return ChunkRecord(kv, int(header.get("canonical_start", 0)))
