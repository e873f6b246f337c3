"""The model identity: what two servers must share to share a chunk's KV.

:class:`ModelIdentity`'s digest salts every content key
(:meth:`~relaxkv_sglang.cache.chunk_key.ChunkKey.content_key`): what determines the KV bytes and
nothing else (the server fills it, ``cache/sglang/kv_identity.py``: the weights' fingerprint,
config, dtype and quantization; the tokenizer's contents; the KV dtype; the layout: layers, KV
heads, head dim, the RoPE the canonical K is rotated with, TP rank) and the value format version.
Another model, quantization, dtype or layout never names the same entry, and the same model at
another path does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

__all__ = ["FORMAT_VERSION", "ModelIdentity", "identity_digest"]

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

