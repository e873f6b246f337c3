"""The model identity chunk keys are salted with (``cache/sglang/kv_identity.py``), computed from server
arguments, the HF config and the weights' fingerprint, no server needed.

* it changes with everything that changes the KV bytes: ``--quantization``, ``--kv-cache-dtype``,
  ``--revision``, the weights (a value changed mid-tensor, a tensor's dtype), the config (RoPE),
  the dtype, the tokenizer's contents, the layout;
* and with nothing else: two byte-identical model folders at other paths (``_name_or_path``),
  another ``transformers_version``, the tokenizer's folder;
* the weights' fingerprint: a hub-cache blob's sha256, ``full`` mode, bounded reads in ``sampled``;
* a path that is no folder and not in the hub cache keeps the path.
"""

from __future__ import annotations

import json
import shutil
import struct
import types

import pytest
import torch

from relaxkv_sglang.cache.sglang.kv_identity import kv_identity, weights_fingerprint

LAYOUT = "layers=2 kv_heads=2 head_dim=32 rope=... first_layer=0 page_size=1 tp=0/1"


def _args(model_path, **kw) -> types.SimpleNamespace:
    """The ServerArgs fields the identity reads, SGLang's defaults."""
    return types.SimpleNamespace(**{"model_path": str(model_path), "tokenizer_path": None, "revision": None,
                                    "quantization": None, "kv_cache_dtype": "auto", "load_format": "auto", **kw})


def _hf_config(folder) -> dict:
    """The config as ``model_config.hf_config.to_dict()`` gives it: with the folder's path."""
    return {**json.loads((folder / "config.json").read_text()), "_name_or_path": str(folder)}


def _identity(folder, hf_config=None, *, dtype=torch.float32, pool=torch.float32, layout=LAYOUT, **kw):
    return kv_identity(_args(folder, **kw), hf_config or _hf_config(folder), model_dtype=dtype,
                       kv_pool_dtype=pool, layout=layout)


@pytest.fixture
def model(tmp_path, tiny_model_path):
    folder = tmp_path / "a" / "tiny-llama"
    shutil.copytree(tiny_model_path, folder)
    return folder


def test_identity_differs_with_quantization_kv_cache_dtype_and_revision(model):
    base = _identity(model)
    assert base == _identity(model)  # deterministic
    variants = {
        "quantization": _identity(model, quantization="fp8"),
        "kv_cache_dtype": _identity(model, kv_cache_dtype="fp8_e4m3"),
        "revision": _identity(model, revision="0123abcd"),
        "dtype": _identity(model, dtype=torch.bfloat16),
        "pool": _identity(model, pool=torch.bfloat16),
        "layout": _identity(model, layout=LAYOUT.replace("tp=0/1", "tp=1/2")),
    }
    digests = {name: ident.digest for name, ident in variants.items()}
    assert base.digest not in digests.values() and len(set(digests.values())) == len(digests), digests
    assert variants["quantization"].quantization == "fp8" and base.quantization == "none"
    assert variants["kv_cache_dtype"].kv_cache_dtype == "fp8_e4m3/float32" and base.kv_cache_dtype == "auto/float32"


def test_identity_is_equal_for_byte_identical_folders_at_other_paths(model, tmp_path):
    other = tmp_path / "elsewhere" / "copy-of-the-model"
    shutil.copytree(model, other)
    a, b = _identity(model), _identity(other)
    assert _hf_config(model)["_name_or_path"] != _hf_config(other)["_name_or_path"]
    assert a.digest == b.digest and a == b
    # another transformers release writing the config, and a tokenizer named by its own folder
    newer = {**_hf_config(other), "transformers_version": "9.99.0", "_attn_implementation": "sdpa"}
    assert _identity(other, newer).digest == a.digest
    tok = tmp_path / "tok"
    shutil.copytree(model, tok)
    assert _identity(other, tokenizer_path=str(tok)).digest == a.digest
    assert "tiny-llama" not in json.dumps(a.describe()) and str(tmp_path) not in json.dumps(a.describe())


def test_identity_differs_with_weights_config_and_tokenizer(model, tmp_path):
    base = _identity(model)
    cfg = _hf_config(model)
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "rope_theta": 500000.0}
    assert _identity(model, cfg).digest != base.digest
    (model / "tokenizer_config.json").write_text((model / "tokenizer_config.json").read_text() + " ")
    assert _identity(model).tokenizer != base.tokenizer
    assert _identity(model, load_format="dummy").weights == "dummy"


def _safetensors(path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file, written by hand (the format: u64 header length, JSON header, data)."""
    names = {torch.float32: "F32", torch.float16: "F16"}
    header, data, at = {}, b"", 0
    for name, t in tensors.items():
        raw = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + len(raw)]}
        data, at = data + raw, at + len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_weights_fingerprint_sees_a_value_changed_mid_tensor_and_a_dtype(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = {"a.weight": torch.randn(256, 256, generator=g), "b.weight": torch.randn(64, 64, generator=g)}
    folder = tmp_path / "m"
    folder.mkdir()
    _safetensors(folder / "model.safetensors", w)
    base = weights_fingerprint(str(folder), "sampled")
    mid = dict(w, **{"a.weight": w["a.weight"].clone()})
    mid["a.weight"][128, 0] += 1.0  # the middle of the tensor: a window covers it
    _safetensors(folder / "model.safetensors", mid)
    changed = weights_fingerprint(str(folder), "sampled")
    half = dict(w, **{"b.weight": w["b.weight"].half()})
    _safetensors(folder / "model.safetensors", half)
    assert len({base, changed, weights_fingerprint(str(folder), "sampled")}) == 3
    # a change no window covers is seen by full mode only (module doc)
    quiet = dict(w, **{"a.weight": w["a.weight"].clone()})
    quiet["a.weight"][64, 0] += 1.0
    _safetensors(folder / "model.safetensors", w)
    full = weights_fingerprint(str(folder), "full")
    _safetensors(folder / "model.safetensors", quiet)
    assert weights_fingerprint(str(folder), "sampled") == base
    assert weights_fingerprint(str(folder), "full") != full


def test_weights_fingerprint_takes_a_hub_blobs_sha256_and_is_cheap(tmp_path, tiny_model_path):
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    sha = "a" * 64
    shutil.copy(f"{tiny_model_path}/model.safetensors", blobs / sha)
    (snap / "model.safetensors").symlink_to(blobs / sha)
    first = weights_fingerprint(str(snap), "sampled")
    size = (blobs / sha).stat().st_size
    (blobs / sha).write_bytes(bytes(size))  # the hub's hash names the bytes: they are not read
    assert weights_fingerprint(str(snap), "sampled") == first
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(blobs / ("b" * 64))
    (blobs / ("b" * 64)).write_bytes(bytes(size))
    assert weights_fingerprint(str(snap), "sampled") != first
    assert weights_fingerprint(str(tiny_model_path), "sampled")  # a real checkpoint's folder
    with pytest.raises(ValueError, match="mode 'fast': must be sampled or full"):
        weights_fingerprint(str(snap), "fast")


def test_a_path_that_is_no_folder_keeps_its_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = {"model_type": "llama"}
    a = kv_identity(_args("no-such-org/model-a"), cfg, model_dtype=torch.float32, kv_pool_dtype=torch.float32,
                    layout=LAYOUT)
    b = kv_identity(_args("no-such-org/model-b"), cfg, model_dtype=torch.float32, kv_pool_dtype=torch.float32,
                    layout=LAYOUT)
    assert a.weights == "path:no-such-org/model-a" and a.digest != b.digest
