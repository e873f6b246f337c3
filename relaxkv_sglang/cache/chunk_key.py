"""The key of a cached chunk, from the KV pool's index down to every lower tier.

A lower tier stores a chunk under its content key, derived only here (:meth:`ChunkKey.content_key`):
``sha256("relaxkv-chunk-v1" || identity || namespace || token ids)``, 64 hex chars, ``identity`` the
model identity's digest (:class:`~relaxkv_sglang.cache.tiers.keys.ModelIdentity`): two servers share
a content key exactly when they would compute the same KV for the same tokens in the same namespace.
Standard library only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import sys
from array import array
from typing import Any, Sequence

__all__ = ["ChunkKey"]


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkKey:
    """A chunk's ``namespace`` (tenant salt, SGLang's ``extra_key``; None, the shared default, is not
    ``""``) and token ids (any int sequence or tensor, stored as a tuple of ints).

    >>> key = ChunkKey(None, [11, 12, 13])
    >>> key == ChunkKey(None, (11, 12, 13)) != ChunkKey("", (11, 12, 13))
    True
    >>> len(key.content_key("0" * 32))
    64
    """

    namespace: str | None
    tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.namespace is not None and not isinstance(self.namespace, str):
            raise TypeError(f"namespace must be a str or None, got {type(self.namespace).__name__}")
        if not (type(self.tokens) is tuple and all(type(t) is int for t in self.tokens)):
            object.__setattr__(self, "tokens", _as_ints(self.tokens))

    def content_key(self, identity_digest: str) -> str:
        """The chunk's address in a lower tier (module doc), salted with the model identity's digest."""
        ns = b"\x00" if self.namespace is None else b"\x01" + self.namespace.encode("utf-8")
        tokens = array("q", self.tokens)
        if sys.byteorder != "little":
            tokens.byteswap()  # the key is the same on every machine
        h = hashlib.sha256(b"relaxkv-chunk-v1\x00")
        h.update(identity_digest.encode() + b"\x00")
        h.update(struct.pack("<Q", len(ns)) + ns)
        h.update(struct.pack("<Q", len(tokens)) + tokens.tobytes())
        return h.hexdigest()


def _as_ints(tokens: Sequence[int] | Any) -> tuple[int, ...]:
    if hasattr(tokens, "reshape") and hasattr(tokens, "tolist"):  # a tensor (or array)
        return tuple(tokens.reshape(-1).tolist())
    return tuple(map(int, tokens))
