"""The model identity: what two servers must share to share a chunk's KV.

Its digest salts every content key (:meth:`~relaxkv_sglang.cache.chunk_key.ChunkKey.content_key`) with
what determines the KV bytes and nothing else (filled by ``cache/sglang/kv_identity.py``) and the value
format version: the same model at another path shares entries, another quantization or layout never.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

__all__ = ["FORMAT_VERSION", "ModelIdentity", "identity_digest"]

FORMAT_VERSION = 2  # 2: the header names its page size (cache/tiers/value.py)


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    """``model``: weights' fingerprint, config hash, dtype, quantization, revision; ``kv_dtype``:
    ``--kv-cache-dtype`` and the pool's, e.g. ``"auto/float32"``; ``kv_layout``: layers, KV heads,
    head dim and the RoPE canonical K is rotated with."""

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

