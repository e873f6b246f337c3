"""Unit tests for relaxkv_sglang.model.rope and core.rope_config.

The invariant the project relies on: a key computed at position p0 and
re-rotated by (p1 - p0) equals the key computed at p1, for every supported RoPE
variant.  apply_rope itself is cross-checked against HF transformers.
"""

from __future__ import annotations

import functools
import importlib
import math

import pytest
import torch

from relaxkv_sglang.model.rope import (
    SUPPORTED_ROPE_TYPES,
    RopeSpec,
    RotationTable,
    UnsupportedRopeError,
    apply_rope,
    rope_cos_sin,
    rotate_keys,
)
from relaxkv_sglang.model.rope_config import rope_spec_from_hf_config

VARIANTS = {
    "default_neox": RopeSpec(head_dim=64, base=10000.0),
    "interleaved": RopeSpec(head_dim=64, base=10000.0, is_neox_style=False),
    "partial_0.5": RopeSpec(head_dim=64, rotary_dim=32, base=10000.0),
    "partial_interleaved": RopeSpec(head_dim=64, rotary_dim=32, is_neox_style=False),
    "llama3": RopeSpec(
        head_dim=64,
        base=500000.0,
        scaling_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    "linear": RopeSpec(head_dim=64, base=10000.0, scaling_type="linear", factor=4.0),
    "yarn": RopeSpec(
        head_dim=64,
        base=1000000.0,
        scaling_type="yarn",
        factor=4.0,
        original_max_position_embeddings=32768,
    ),
}

N_TOK, N_HEADS = 24, 3


def _keys(spec: RopeSpec, seed: int = 0, n: int = N_TOK) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, N_HEADS, spec.head_dim, generator=g)


def _positions(seed: int, n: int = N_TOK, hi: int = 2048) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, hi, (n,), generator=g, dtype=torch.int64)


# fp32 angles up to ~4k rad carry ~2e-4 rad rounding each; values are ~N(0,1).
ATOL = 2e-3


# ---------------------------------------------------------------- the re-rotation invariant


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("delta_kind", ["scalar_pos", "scalar_neg", "per_token"])
def test_rotate_keys_moves_key_to_new_position(name, delta_kind):
    spec = VARIANTS[name]
    k = _keys(spec)
    p0 = _positions(1) + 1500  # room for negative deltas
    if delta_kind == "scalar_pos":
        delta = 777
        p1 = p0 + delta
    elif delta_kind == "scalar_neg":
        delta = -1234
        p1 = p0 + delta
    else:
        delta = torch.randint(-1500, 1500, (N_TOK,), generator=torch.Generator().manual_seed(2))
        p1 = p0 + delta
    cached = apply_rope(k, p0, spec)
    moved = rotate_keys(cached, delta, spec)
    direct = apply_rope(k, p1, spec)
    torch.testing.assert_close(moved, direct, atol=ATOL, rtol=0)
    # The test can fail: one position off is far outside the tolerance.
    off_by_one = rotate_keys(cached, (delta + 1) if isinstance(delta, int) else delta + 1, spec)
    assert (off_by_one - direct).abs().max() > 50 * ATOL


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "yarn"])
def test_rotation_from_canonical_zero_is_bitwise_exact(name):
    # Canonical start 0: angles p*f are formed exactly like a direct computation at p.
    spec = VARIANTS[name]
    k = _keys(spec, seed=3)
    p1 = _positions(4, hi=100_000)
    cached = apply_rope(k, torch.zeros(N_TOK, dtype=torch.int64), spec)
    assert torch.equal(cached, k)
    assert torch.equal(rotate_keys(cached, p1, spec), apply_rope(k, p1, spec))


def test_yarn_scale_applied_once():
    spec = VARIANTS["yarn"]
    assert spec.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)
    k = _keys(spec, seed=5)
    p1 = _positions(6)
    cached = apply_rope(k, torch.zeros(N_TOK, dtype=torch.int64), spec)
    torch.testing.assert_close(cached, k * spec.attention_scaling, atol=1e-6, rtol=1e-6)
    moved = rotate_keys(cached, p1, spec)
    torch.testing.assert_close(moved, apply_rope(k, p1, spec), atol=ATOL, rtol=0)
    # Norms are preserved by rotate_keys: it never multiplies in the scale again.
    torch.testing.assert_close(moved.norm(dim=-1), cached.norm(dim=-1), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_rotations_compose_and_invert(name):
    spec = VARIANTS[name]
    k = _keys(spec, seed=7)
    a = torch.randint(-300, 300, (N_TOK,), generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(
        rotate_keys(rotate_keys(k, a, spec), 211, spec), rotate_keys(k, a + 211, spec), atol=1e-4, rtol=0
    )
    torch.testing.assert_close(rotate_keys(rotate_keys(k, a, spec), -a, spec), k, atol=1e-4, rtol=0)
    assert torch.equal(rotate_keys(k, 0, spec), k)


# ---------------------------------------------------------------- independent references


def _reference_rope(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec, scale: float) -> torch.Tensor:
    """float64 rotation written pair by pair from the definition."""
    x = x.double()
    out = x.clone()
    inv = spec.inv_freq().double()
    r = spec.rotary_dim
    for i in range(r // 2):
        a_idx, b_idx = (i, i + r // 2) if spec.is_neox_style else (2 * i, 2 * i + 1)
        ang = positions.double() * inv[i]
        c, s = (ang.cos() * scale)[:, None], (ang.sin() * scale)[:, None]
        a, b = x[:, :, a_idx], x[:, :, b_idx]
        out[:, :, a_idx] = a * c - b * s
        out[:, :, b_idx] = a * s + b * c
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_apply_rope_matches_pairwise_reference(name):
    spec = VARIANTS[name]
    k = _keys(spec, seed=9)
    pos = _positions(10, hi=512)
    got = apply_rope(k, pos, spec)
    ref = _reference_rope(k, pos, spec, spec.attention_scaling)
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=0)
    if spec.rotary_dim < spec.head_dim:
        assert torch.equal(got[..., spec.rotary_dim :], k[..., spec.rotary_dim :])


def test_interleaved_matches_complex_multiplication():
    # Meta's original Llama code: view pairs (2i, 2i+1) as complex numbers.
    spec = VARIANTS["interleaved"]
    k = _keys(spec, seed=11)
    pos = _positions(12, hi=512)
    angles = pos.double()[:, None] * spec.inv_freq().double()[None, :]
    rot = torch.polar(torch.ones_like(angles), angles)[:, None, :]
    ref = torch.view_as_real(torch.view_as_complex(k.double().reshape(N_TOK, N_HEADS, -1, 2)) * rot)
    torch.testing.assert_close(apply_rope(k, pos, spec).double(), ref.flatten(-2), atol=1e-4, rtol=0)


def test_neox_and_interleaved_differ():
    k = _keys(VARIANTS["default_neox"], seed=13)
    pos = _positions(14)
    assert not torch.allclose(apply_rope(k, pos, VARIANTS["default_neox"]), apply_rope(k, pos, VARIANTS["interleaved"]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_in_out(dtype):
    spec = VARIANTS["default_neox"]
    k32 = _keys(spec, seed=15)
    k = k32.to(dtype)
    before = k.clone()
    pos = _positions(16)
    out = apply_rope(k, pos, spec)
    moved = rotate_keys(out, 17, spec)
    assert out.dtype == dtype and moved.dtype == dtype
    assert torch.equal(k, before)  # inputs untouched
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.float(), apply_rope(k.float(), pos, spec), atol=tol, rtol=tol)
    torch.testing.assert_close(moved.float(), apply_rope(k.float(), pos + 17, spec), atol=3 * tol, rtol=3 * tol)


def test_rope_cos_sin_shapes_and_scaling():
    spec = VARIANTS["yarn"]
    cos, sin = rope_cos_sin(torch.tensor([0, 5]), spec)
    assert cos.shape == (2, 32) and cos.dtype == torch.float32
    assert torch.allclose(cos[0], torch.full((32,), spec.attention_scaling))
    cos1, sin1 = rope_cos_sin(5, spec, with_attention_scaling=False)
    torch.testing.assert_close(cos1[0] * spec.attention_scaling, cos[1])
    torch.testing.assert_close(cos1**2 + sin1**2, torch.ones(1, 32))


def test_input_validation():
    spec = VARIANTS["default_neox"]
    k = _keys(spec)
    with pytest.raises(ValueError, match="head_dim=64"):
        apply_rope(k[..., :32], _positions(0), spec)
    with pytest.raises(ValueError):
        apply_rope(k, _positions(0, n=N_TOK - 1), spec)
    with pytest.raises(ValueError):
        rotate_keys(k, torch.zeros(N_TOK + 1, dtype=torch.int64), spec)
    with pytest.raises(TypeError):
        rotate_keys(k, torch.zeros(N_TOK), spec)  # float deltas
    with pytest.raises(TypeError):
        apply_rope(k.long(), _positions(0), spec)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(head_dim=64, rotary_dim=33),
        dict(head_dim=64, rotary_dim=128),
        dict(head_dim=0),
        dict(head_dim=64, scaling_type="yarn", factor=2.0),  # missing original_max_position_embeddings
        dict(head_dim=64, factor=0.0),
    ],
)
def test_spec_validation(kwargs):
    with pytest.raises(ValueError):
        RopeSpec(**kwargs)


def test_spec_unknown_scaling_type():
    with pytest.raises(UnsupportedRopeError, match="dynamic"):
        RopeSpec(head_dim=64, scaling_type="dynamic")


def test_inv_freq_is_a_copy():
    spec = RopeSpec(head_dim=8)
    f = spec.inv_freq()
    assert f.dtype == torch.float32 and f.shape == (4,)
    torch.testing.assert_close(f, torch.tensor([1.0, 0.1, 0.01, 0.001]))
    f.zero_()
    assert spec.inv_freq()[0] == 1.0


# ---------------------------------------------------------------- config parsing

LLAMA31 = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}


def test_spec_from_llama31_config():
    spec = rope_spec_from_hf_config(LLAMA31)
    assert spec == RopeSpec(
        head_dim=128,
        rotary_dim=128,
        base=500000.0,
        scaling_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


def test_spec_from_old_and_new_config_shapes_agree():
    old = {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    new = {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    }
    a, b = rope_spec_from_hf_config(old), rope_spec_from_hf_config(new)
    assert a == b
    assert a.head_dim == 128 and a.scaling_type == "yarn" and a.base == 1e6
    assert a.attention_scaling == pytest.approx(1 + 0.1 * math.log(4))


def test_spec_from_plain_configs():
    qwen25 = {"model_type": "qwen2", "hidden_size": 896, "num_attention_heads": 14, "rope_theta": 1000000.0,
              "rope_scaling": None}
    s = rope_spec_from_hf_config(qwen25)
    assert (s.head_dim, s.rotary_dim, s.base, s.scaling_type) == (64, 64, 1e6, "default")
    mistral = {"model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32, "head_dim": None,
               "rope_theta": 1000000.0}
    assert rope_spec_from_hf_config(mistral).head_dim == 128
    partial = {"hidden_size": 256, "num_attention_heads": 4, "partial_rotary_factor": 0.25}
    s = rope_spec_from_hf_config(partial)
    assert (s.head_dim, s.rotary_dim, s.base) == (64, 16, 10000.0)
    lin = {"hidden_size": 256, "num_attention_heads": 4, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert rope_spec_from_hf_config(lin).factor == 2.0
    assert rope_spec_from_hf_config(lin, is_neox_style=False).is_neox_style is False


@pytest.mark.parametrize(
    "cfg, fragments",
    [
        ({"model_type": "llama", "rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["'dynamic'", "sequence length"]),
        ({"model_type": "llama", "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, ["'dynamic'"]),
        ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1], "long_factor": [1]}},
         ["'longrope'", "phi3"]),
        ({"model_type": "qwen2_vl", "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}, ["mrope"]),
        ({"model_type": "qwen2_vl", "rope_scaling": {"type": "default", "mrope_section": [16, 24, 24]}}, ["mrope"]),
        ({"model_type": "gemma3", "rope_parameters": {"full_attention": {"rope_type": "default"},
                                                      "sliding_attention": {"rope_type": "default"}}},
         ["per-layer-type"]),
        ({"model_type": "x", "rope_scaling": {"rope_type": "su"}}, ["'su'"]),
    ],
)
def test_unsupported_configs_raise_clearly(cfg, fragments):
    cfg = {"hidden_size": 64, "num_attention_heads": 4, **cfg}
    with pytest.raises(UnsupportedRopeError) as ei:
        rope_spec_from_hf_config(cfg)
    msg = str(ei.value)
    for frag in fragments:
        assert frag in msg
    assert "supported" in msg and all(t in msg for t in SUPPORTED_ROPE_TYPES)


# ---------------------------------------------------------------- cross-check with HF transformers


@functools.lru_cache(maxsize=1)
def _hf():
    """Import transformers' RoPE pieces (the venv's CPU shims make torchvision importable)."""
    pytest.importorskip("transformers")
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return transformers, ROPE_INIT_FUNCTIONS


def _hf_apply(model: str, config, x: torch.Tensor, positions: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Run HF's rotary embedding + apply_rotary_pos_emb for ``model`` on x [n, h, d]."""
    _hf()
    mod = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    rope_cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding") and n[0].isupper())
    emb = rope_cls(config)
    xb = x[None]  # [1, n, h, d]
    cos, sin = emb(xb, positions[None])
    rot, rest = xb[..., :rotary_dim], xb[..., rotary_dim:]
    q_embed, _ = mod.apply_rotary_pos_emb(rot, rot, cos, sin, unsqueeze_dim=2)
    return torch.cat((q_embed, rest), dim=-1)[0]


HF_CASES = {
    "llama_default": ("llama", "LlamaConfig", {"hidden_size": 256, "num_attention_heads": 4, "rope_theta": 10000.0}),
    "llama_linear": (
        "llama",
        "LlamaConfig",
        {"hidden_size": 256, "num_attention_heads": 4, "rope_scaling": {"type": "linear", "factor": 4.0}},
    ),
    "llama3": (
        "llama",
        "LlamaConfig",
        {**{k: v for k, v in LLAMA31.items() if k != "model_type"}, "hidden_size": 256, "num_attention_heads": 2},
    ),
    "qwen2_yarn": (
        "qwen2",
        "Qwen2Config",
        {
            "hidden_size": 256,
            "num_attention_heads": 4,
            "max_position_embeddings": 131072,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
        },
    ),
    "qwen3_yarn_old_shape": (
        "qwen3",
        "Qwen3Config",
        {
            "hidden_size": 256,
            "num_attention_heads": 4,
            "head_dim": 32,
            "max_position_embeddings": 40960,
            "rope_theta": 1000000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        },
    ),
    "mistral_head_dim": (
        "mistral",
        "MistralConfig",
        {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 32, "rope_theta": 1000000.0},
    ),
    "stablelm_partial": (
        "stablelm",
        "StableLmConfig",
        {"hidden_size": 256, "num_attention_heads": 4, "partial_rotary_factor": 0.25, "rope_theta": 10000.0},
    ),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_apply_rope_matches_transformers(case):
    transformers, _ = _hf()
    model, cfg_cls, cfg = HF_CASES[case]
    spec = rope_spec_from_hf_config({"model_type": model, **cfg})
    config = getattr(transformers, cfg_cls)(**cfg)
    x = torch.randn(40, 3, spec.head_dim, generator=torch.Generator().manual_seed(21))
    pos = torch.randint(0, 60000, (40,), generator=torch.Generator().manual_seed(22))
    ref = _hf_apply(model, config, x, pos, spec.rotary_dim)
    got = apply_rope(x, pos, spec)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", ["llama_linear", "llama3", "qwen2_yarn", "qwen3_yarn_old_shape"])
def test_inv_freq_and_scaling_match_rope_init_functions(case):
    transformers, init_fns = _hf()
    model, cfg_cls, cfg = HF_CASES[case]
    spec = rope_spec_from_hf_config({"model_type": model, **cfg})
    config = getattr(transformers, cfg_cls)(**cfg)
    inv_freq, attention_factor = init_fns[spec.scaling_type](config)
    assert torch.equal(spec.inv_freq(), inv_freq)
    assert spec.attention_scaling == pytest.approx(attention_factor, rel=1e-12)
    assert spec.scaling_type != "default"


def test_yarn_variants_match_transformers_params():
    transformers, init_fns = _hf()
    base_cfg = {"hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 65536, "rope_theta": 1e6}
    for extra in (
        {"attention_factor": 0.8},
        {"beta_fast": 16, "beta_slow": 2},
        {"mscale": 1.0, "mscale_all_dim": 0.5},
        {"truncate": False},
    ):
        rp = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, **extra}
        cfg = {**base_cfg, "rope_scaling": rp}
        spec = rope_spec_from_hf_config(cfg)
        inv_freq, attention_factor = init_fns["yarn"](transformers.Qwen2Config(**{**base_cfg, "rope_scaling": dict(rp)}))
        assert torch.equal(spec.inv_freq(), inv_freq), extra
        assert spec.attention_scaling == pytest.approx(attention_factor, rel=1e-12), extra


@pytest.mark.parametrize("neox,rotary_dim,scaling", [(True, None, "default"), (False, None, "default"),
                                                      (True, 32, "default"), (False, 48, "linear")])
def test_rotation_table_equals_rotate_keys(neox, rotary_dim, scaling):
    spec = RopeSpec(head_dim=64, rotary_dim=rotary_dim, base=10000.0, is_neox_style=neox, scaling_type=scaling,
                    factor=2.0 if scaling == "linear" else 1.0)
    torch.manual_seed(0)
    positions = torch.tensor([-7, 0, 3, 100, 4095])
    table = RotationTable(positions, spec)
    k = torch.randn(5, 3, 64)
    assert torch.allclose(table.rotate(k), rotate_keys(k, positions, spec), atol=1e-5)
    one = torch.randn(1, 3, 64)  # one key to every position: what the stale shift does
    assert torch.allclose(table.rotate(one), rotate_keys(one.expand(5, -1, -1).contiguous(), positions, spec),
                          atol=1e-5)
    assert torch.allclose(rotate_keys(one, positions, spec), table.rotate(one), atol=1e-5)
    # Added in place over a slice of rows (a run of pool slots): the same, on top of what was there.
    base = torch.randn(3, 3, 64)
    target = base.clone()
    assert table.add_rotated_(target, one[0], start=2) is target
    assert torch.allclose(target, base + table.rotate(one)[2:], atol=1e-5)
