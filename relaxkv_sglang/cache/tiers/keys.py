"""Content keys of chunks: what two servers must share to share a chunk's KV.

A key is ``sha256("relaxkv-chunk-v1" || identity || namespace || token ids)``, hex (64 chars).
``identity`` is :class:`ModelIdentity`'s digest: what determines the KV bytes and nothing else
(the server fills it, ``cache/sglang/kv_identity.py``: the weights' fingerprint, config, dtype and
quantization; the tokenizer's contents; the KV dtype; the layout: layers, KV heads, head dim, the
RoPE the canonical K is rotated with, TP rank) and the value format version. Two servers share a
key exactly when they would compute the same KV for the same tokens in the same tenant namespace;
another namespace, model, quantization, dtype or layout never names the same entry, and the same
model at another path does. The namespace
``None`` (the shared default) and ``""`` are distinct (a one-byte tag before it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import sys
from array import array
from typing import Sequence

__all__ = ["FORMAT_VERSION", "ModelIdentity", "chunk_key"]

FORMAT_VERSION = 2  # 2: the header names its page size (cache/tiers/value.py)


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    """What must match for two servers to share chunk KV.

    Attributes:
        model: the model's identity (weights' fingerprint, config hash, dtype, quantization, revision).
        tokenizer: a hash of the tokenizer's files.
        kv_dtype: the KV cache dtype (``--kv-cache-dtype`` and the pool's dtype), e.g. ``"auto/float32"``.
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


def identity_digest(identity: ModelIdentity | str) -> str:
    """The digest of ``identity`` (a digest passes through)."""
    return identity.digest if isinstance(identity, ModelIdentity) else identity


def chunk_key(identity: ModelIdentity | str, namespace: str | None, token_ids: Sequence[int]) -> str:
    """The content address of one chunk (64 hex chars).

    Args:
        identity: the model identity (or its digest).
        namespace: the tenant namespace (None: the shared default; distinct from ``""``).
        token_ids: the chunk's token ids.
    """
    ns = b"\x00" if namespace is None else b"\x01" + namespace.encode("utf-8")
    tokens = array("q", (int(t) for t in token_ids))
    if sys.byteorder != "little":
        tokens.byteswap()  # the key is the same on every machine
    h = hashlib.sha256(b"relaxkv-chunk-v1\x00")
    h.update(identity_digest(identity).encode() + b"\x00")
    h.update(struct.pack("<Q", len(ns)) + ns)
    h.update(struct.pack("<Q", len(tokens)) + tokens.tobytes())
    return h.hexdigest()
