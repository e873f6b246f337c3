"""The model identity chunk keys are salted with: what determines a chunk's KV bytes, nothing else.

Two servers share a stored chunk exactly when their digests agree (another model path, ``transformers``
release, chat template or served name still share). The weights' fingerprint samples: per file the
hub blob sha256, or the safetensors header plus 256 bytes at the start, middle and end of every tensor
(a fine-tune changes every tensor it touches; a renamed, retyped or reshaped tensor changes the header),
or sampled windows; ``RELAXKV_WEIGHTS_FINGERPRINT=full`` hashes every byte.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import struct
from typing import TYPE_CHECKING, Any, Optional

import torch

from relaxkv_sglang.cache.tiers import ModelIdentity
from relaxkv_sglang.runtime.settings import FINGERPRINT_MODES

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

__all__ = ["KVIdentity", "TOKENIZER_FILES", "VOLATILE_CONFIG_KEYS", "kv_identity",
           "resolve_folder", "tokenizer_fingerprint", "weights_fingerprint"]

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.gguf", "*.pt", "*.pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "vocab.txt", "merges.txt", "tokenizer.model", "added_tokens.json")
#: HF config keys that name where or how the config was written, not what the model computes.
VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "name_or_path", "transformers_version", "_commit_hash",
                                  "_attn_implementation", "_attn_implementation_autoset",
                                  "_attn_implementation_internal", "torch_dtype", "dtype"})
_SAMPLE = 256  # bytes read at the start, middle and end of each safetensors tensor
_HUB_BLOB = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class KVIdentity:
    """What determines a chunk's KV bytes (module doc); every field a string."""

    weights: str
    config: str
    dtype: str
    quantization: str
    kv_cache_dtype: str
    revision: str
    tokenizer: str
    layout: str

    @property
    def model_identity(self) -> ModelIdentity:
        """The identity chunk keys and stored values are salted with (``cache/tiers/keys.py``)."""
        model = json.dumps({"weights": self.weights, "config": self.config, "dtype": self.dtype,
                            "quantization": self.quantization, "revision": self.revision}, sort_keys=True)
        return ModelIdentity(model, self.tokenizer, self.kv_cache_dtype, self.layout)

    @property
    def digest(self) -> str:
        """The model identity's digest (``tier_identity``; the salt of every chunk key)."""
        return self.model_identity.digest

    def describe(self) -> dict:
        """Every field and the digest (``relaxkv.kv_identity`` on /get_server_info)."""
        return {**dataclasses.asdict(self), "digest": self.digest}

    def line(self) -> str:
        """The startup line."""
        return "relaxkv kv identity " + " ".join(f"{k}={v}" for k, v in self.describe().items())


def resolve_folder(path: Optional[str], revision: Optional[str]) -> Optional[str]:
    """``path`` if it is a folder, else its snapshot in the local Hugging Face cache (no download), else None."""
    if not path:
        return None
    if os.path.isdir(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id=path, revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - not a hub id, or not cached: the caller keeps the path
        return None


def _safetensors_digest(path: str, h: "hashlib._Hash") -> None:
    """Feed ``h`` the header and three windows of every tensor of a safetensors file (module doc)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            h.update(raw)
            return
        (hlen,) = struct.unpack("<Q", raw)
        size = os.fstat(f.fileno()).st_size
        if hlen > size - 8:  # not a safetensors header: take the bytes as they are
            f.seek(0)
            h.update(f.read(1 << 20))
            return
        header = f.read(hlen)
        h.update(raw + header)
        try:
            tensors = json.loads(header)
        except ValueError:
            return
        base = 8 + hlen
        ranges = sorted(v["data_offsets"] for k, v in tensors.items()
                        if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v)
        for begin, end in ranges:
            n = end - begin
            for at in sorted({begin, begin + max(0, n // 2 - _SAMPLE // 2), max(begin, end - _SAMPLE)}):
                f.seek(base + at)
                h.update(f.read(min(_SAMPLE, end - at)))


def _windows_digest(path: str, h: "hashlib._Hash") -> None:
    """First and last MiB and 14 evenly spaced 64 KiB windows of any file."""
    size = os.path.getsize(path)
    mib, win = 1 << 20, 64 << 10
    with open(path, "rb") as f:
        h.update(f.read(mib))
        if size > 2 * mib:
            for i in range(1, 15):
                f.seek(mib + (size - 2 * mib) * i // 15)
                h.update(f.read(win))
            f.seek(size - mib)
            h.update(f.read(mib))
        elif size > mib:
            h.update(f.read())


def _full_digest(path: str, h: "hashlib._Hash") -> None:
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)


def weights_fingerprint(folder: str, mode: str = FINGERPRINT_MODES[0]) -> str:
    """32 hex chars over the weight files in ``folder``; ``mode``: ``"sampled"`` or ``"full"`` (module doc)."""
    if mode not in FINGERPRINT_MODES:
        raise ValueError(f"weights fingerprint mode {mode!r}: must be {' or '.join(FINGERPRINT_MODES)}")
    files = sorted({p for pattern in WEIGHT_PATTERNS for p in glob.glob(os.path.join(folder, pattern))})
    out = hashlib.sha256(b"relaxkv-weights-v1\0" + mode.encode())
    for path in files:
        h = hashlib.sha256()
        blob = os.path.basename(os.path.realpath(path))
        if _HUB_BLOB.fullmatch(blob):
            h.update(b"hub-sha256:" + blob.encode())  # the hub's hash of every byte
        elif mode == "full":
            _full_digest(path, h)
        elif path.endswith(".safetensors"):
            _safetensors_digest(path, h)
        else:
            _windows_digest(path, h)
        out.update(f"{os.path.basename(path)}\0{os.path.getsize(path)}\0{h.hexdigest()}\n".encode())
    if not files:
        out.update(b"no weight files")
    return out.hexdigest()[:32]


def tokenizer_fingerprint(folder: str) -> str:
    """16 hex chars of sha256 over the tokenizer files' names and contents (not their folder)."""
    h = hashlib.sha256(b"relaxkv-tokenizer-v1\0")
    for name in TOKENIZER_FILES:
        p = os.path.join(folder, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                h.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


def _without_volatile(value: Any) -> Any:  # a JSON value
    if isinstance(value, dict):
        return {k: _without_volatile(v) for k, v in value.items() if k not in VOLATILE_CONFIG_KEYS}
    if isinstance(value, (list, tuple)):
        return [_without_volatile(v) for v in value]
    return value


def config_fingerprint(hf_config: dict) -> str:
    """16 hex chars of sha256 over the HF config without :data:`VOLATILE_CONFIG_KEYS` (at any depth)."""
    text = json.dumps(_without_volatile(hf_config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_identity(server_args: ServerArgs, hf_config: dict, *, model_dtype: torch.dtype, kv_pool_dtype: torch.dtype,
                layout: str, weights: Optional[str] = None, fingerprint_mode: str = FINGERPRINT_MODES[0]) -> KVIdentity:
    """The identity of a server; ``hf_config``: ``hf_config.to_dict()``; ``layout``: layers, heads, head dim,
    RoPE, page size and TP rank; ``weights``: the fingerprint if known."""
    model_path = str(server_args.model_path)
    revision = getattr(server_args, "revision", None)
    folder = resolve_folder(model_path, revision)
    if weights is None:
        if str(getattr(server_args, "load_format", "auto")) == "dummy":
            weights = "dummy"
        elif folder is not None:
            weights = weights_fingerprint(folder, fingerprint_mode)
        else:
            weights = f"path:{model_path}"
    tok_path = getattr(server_args, "tokenizer_path", None) or model_path
    tok_folder = folder if tok_path == model_path else resolve_folder(tok_path, None)
    tokenizer = tokenizer_fingerprint(tok_folder) if tok_folder is not None else f"path:{tok_path}"
    return KVIdentity(
        weights=weights,
        config=config_fingerprint(hf_config),
        dtype=_dtype_name(model_dtype),
        quantization=str(getattr(server_args, "quantization", None) or "none"),
        kv_cache_dtype=f"{getattr(server_args, 'kv_cache_dtype', None) or 'auto'}/{_dtype_name(kv_pool_dtype)}",
        revision=str(revision or "none"),
        tokenizer=tokenizer,
        layout=layout,
    )
