"""A :class:`~.rope.RopeSpec` from a HuggingFace ``config.json``, in either shape: transformers <5
(top-level ``rope_theta``, a ``rope_scaling`` dict keyed ``type`` or ``rope_type``) or 5 (a
``rope_parameters`` dict), the latter winning. Types whose cached keys cannot be re-rotated exactly
(dynamic NTK, longrope, mrope, per-layer-type dicts) raise :class:`~.rope.UnsupportedRopeError`."""

from __future__ import annotations

from typing import Any, Mapping

from relaxkv_sglang.model.rope import SUPPORTED_ROPE_TYPES, RopeSpec, UnsupportedRopeError

__all__ = ["rope_spec_from_hf_config"]


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return int(value)


def rope_spec_from_hf_config(cfg: Mapping[str, Any], *, is_neox_style: bool = True) -> RopeSpec:
    """``rope_theta`` defaults to 10000.0 (HF's Llama/Qwen2 default). ``is_neox_style`` is in no HF config:
    every served model uses neox. ValueError: missing or malformed sizes."""
    model_type = cfg.get("model_type", "unknown")
    scaling = _rope_dict(cfg, model_type)
    rope_type = _rope_type(scaling, model_type)
    head_dim = _head_dim(cfg)
    partial = scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return RopeSpec(
        head_dim=head_dim,
        rotary_dim=int(head_dim * float(partial)),  # HF truncates the same way
        base=float(scaling.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        is_neox_style=is_neox_style,
        scaling_type=rope_type,
        **_scaling_fields(rope_type, cfg, scaling),
    )


def _rope_dict(cfg: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The config's one RoPE dict: ``rope_scaling`` updated by ``rope_parameters`` (empty: none);
    UnsupportedRopeError for per-layer-type dicts."""
    scaling: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):  # later wins
        val = cfg.get(key)
        if val is None:
            continue
        if not isinstance(val, Mapping):
            raise ValueError(f"{key} must be a dict, got {type(val).__name__}")
        scaling.update(val)
    if scaling and all(isinstance(v, Mapping) or v is None for v in scaling.values()):
        # transformers 5 nests rope dicts per layer type (e.g. Gemma 3 sliding/full).
        raise UnsupportedRopeError(
            f"model_type={model_type!r} has per-layer-type RoPE parameters "
            f"({', '.join(map(str, scaling))}); supported: one global RoPE of type "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return scaling


def _rope_type(scaling: Mapping[str, Any], model_type: str) -> str:
    """The RoPE dict's type, one of ``SUPPORTED_ROPE_TYPES`` (UnsupportedRopeError otherwise)."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if "mrope_section" in scaling or rope_type == "mrope":
        raise UnsupportedRopeError(
            f"model_type={model_type!r} uses multimodal RoPE (mrope, rope_type={rope_type!r}); "
            f"supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type not in SUPPORTED_ROPE_TYPES:
        why = {
            "dynamic": " (dynamic NTK frequencies depend on the sequence length, "
            "so a delta rotation of cached keys is not exact)",
            "longrope": " (longrope switches frequency sets with the sequence length)",
        }.get(rope_type, "")
        raise UnsupportedRopeError(
            f"model_type={model_type!r} uses rope type {rope_type!r}{why}; "
            f"supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return rope_type


def _head_dim(cfg: Mapping[str, Any]) -> int:
    """``head_dim``, or ``hidden_size // num_attention_heads``."""
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
        if not hidden or not heads:
            raise ValueError("config needs head_dim or hidden_size and num_attention_heads")
        head_dim = _as_int(hidden, "hidden_size") // _as_int(heads, "num_attention_heads")
    return _as_int(head_dim, "head_dim")


def _scaling_fields(rope_type: str, cfg: Mapping[str, Any], scaling: Mapping[str, Any]) -> dict[str, Any]:
    """The ``RopeSpec`` fields of a scaled RoPE type (none for "default")."""
    kwargs: dict[str, Any] = {}
    if rope_type in ("linear", "llama3", "yarn"):
        factor = scaling.get("factor")
        if rope_type == "yarn" and factor is None:
            # HF: no factor means max_position_embeddings / original.
            orig = _yarn_original_max(cfg, scaling)
            factor = cfg["max_position_embeddings"] / orig
        if factor is None:
            raise ValueError(f"{rope_type} RoPE needs 'factor' in the rope dict")
        kwargs["factor"] = float(factor)
    if rope_type == "llama3":
        kwargs["original_max_position_embeddings"] = _yarn_original_max(cfg, scaling)
        kwargs["low_freq_factor"] = float(scaling["low_freq_factor"])
        kwargs["high_freq_factor"] = float(scaling["high_freq_factor"])
    if rope_type == "yarn":
        kwargs["original_max_position_embeddings"] = _yarn_original_max(cfg, scaling)
        kwargs["beta_fast"] = float(scaling.get("beta_fast") or 32)
        kwargs["beta_slow"] = float(scaling.get("beta_slow") or 1)
        af = scaling.get("attention_factor")
        kwargs["yarn_attention_factor"] = None if af is None else float(af)
        kwargs["yarn_mscale"] = scaling.get("mscale")
        kwargs["yarn_mscale_all_dim"] = scaling.get("mscale_all_dim")
        kwargs["yarn_truncate"] = bool(scaling.get("truncate", True))
    return kwargs


def _yarn_original_max(cfg: Mapping[str, Any], scaling: Mapping[str, Any]) -> int:
    """Pretraining context length with HF's precedence (top-level key, rope dict, max_position_embeddings)."""
    for value in (
        cfg.get("original_max_position_embeddings"),
        scaling.get("original_max_position_embeddings"),
        cfg.get("max_position_embeddings"),
    ):
        if value is not None:
            return _as_int(value, "original_max_position_embeddings")
    raise ValueError("scaled RoPE needs original_max_position_embeddings or max_position_embeddings")
