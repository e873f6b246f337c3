"""RoPE for position-independent KV reuse: apply, and re-rotate cached keys.

A chunk's keys are cached after RoPE at canonical positions (normally 0..n-1). RoPE is a per-pair 2-D
rotation by ``p * f_i``, so rotations compose, ``R(p_new) = R(p_new - p_old) @ R(p_old)``: rotating a
cached key by the delta gives the key at ``p_new``. Every supported variant (default, linear, Llama-3
scaling, YaRN; neox and GPT-J pairing; partial rotary) only changes the frequencies ``f_i`` (YaRN also
scales cos/sin by a constant), so delta rotation is exact. "dynamic" NTK and "longrope" change the
frequencies with the sequence length (a key cached under one length would be wrong under another), so
both are refused. :mod:`.rope_config` reads a spec from a HF config.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from relaxkv_sglang.attention.staging import to_device

__all__ = [
    "SUPPORTED_ROPE_TYPES",
    "UnsupportedRopeError",
    "RopeSpec",
    "rope_cos_sin",
    "apply_rope",
    "rotate_keys",
    "RotationTable",
]

#: Scaling types for which ``rotate_keys`` is exact.
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")


class UnsupportedRopeError(ValueError):
    """Cached keys under this RoPE cannot be re-rotated exactly."""


@dataclass(frozen=True)
class RopeSpec:
    """One attention layer's RoPE, HF's fields. ``rotary_dim``: the leading dims that rotate (even;
    None: head_dim). ``is_neox_style``: dim ``i`` with ``i + rotary_dim/2`` (HF ``rotate_half``), else
    ``2i`` with ``2i+1`` (GPT-J). ``yarn_attention_factor``: HF's ``attention_factor`` (None: from
    ``factor`` and the mscale fields). ``yarn_truncate``: the correction range rounded to whole dims."""

    head_dim: int
    rotary_dim: int | None = None
    base: float = 10000.0
    is_neox_style: bool = True
    scaling_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    yarn_attention_factor: float | None = None
    yarn_mscale: float | None = None
    yarn_mscale_all_dim: float | None = None
    yarn_truncate: bool = True

    def __post_init__(self) -> None:
        if self.rotary_dim is None:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise ValueError(f"head_dim must be a positive int, got {self.head_dim!r}")
        rd = self.rotary_dim
        if not isinstance(rd, int) or rd <= 0 or rd > self.head_dim or rd % 2:
            raise ValueError(
                f"rotary_dim must be an even int in (0, head_dim={self.head_dim}], got {rd!r}"
            )
        if self.scaling_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedRopeError(
                f"RoPE scaling type {self.scaling_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if not self.base > 0:
            raise ValueError(f"base (rope_theta) must be > 0, got {self.base!r}")
        if not self.factor > 0:
            raise ValueError(f"factor must be > 0, got {self.factor!r}")
        if self.scaling_type in ("llama3", "yarn") and not self.original_max_position_embeddings:
            raise ValueError(f"{self.scaling_type} RoPE needs original_max_position_embeddings")
        if self.scaling_type == "llama3" and self.high_freq_factor == self.low_freq_factor:
            raise ValueError("llama3 RoPE needs high_freq_factor != low_freq_factor")

    def inv_freq(self) -> torch.Tensor:
        """float32 CPU ``[rotary_dim // 2]`` radians per position, HF's fp32 operations (bit for bit); a copy."""
        return _inv_freq_cached(self, "cpu").clone()

    @property
    def attention_scaling(self) -> float:
        """YaRN's mscale (1.0 for every other type), multiplied into cos and sin."""
        if self.scaling_type != "yarn":
            return 1.0
        if self.yarn_attention_factor is not None:
            return float(self.yarn_attention_factor)

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            if scale <= 1:
                return 1.0
            return 0.1 * mscale * math.log(scale) + 1.0

        # Same precedence as HF: mscale ratio only when both are set and non-zero.
        if self.yarn_mscale and self.yarn_mscale_all_dim:
            return float(
                get_mscale(self.factor, self.yarn_mscale)
                / get_mscale(self.factor, self.yarn_mscale_all_dim)
            )
        return float(get_mscale(self.factor))


def _compute_inv_freq(spec: RopeSpec) -> torch.Tensor:
    dim = spec.rotary_dim
    base = spec.base
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    inv_freq = 1.0 / (base**exponents)
    t = spec.scaling_type
    if t == "default":
        return inv_freq
    if t == "linear":
        # Dividing frequencies == dividing positions (position interpolation).
        return inv_freq / spec.factor
    if t == "llama3":
        factor = spec.factor
        lo, hi = spec.low_freq_factor, spec.high_freq_factor
        old_len = spec.original_max_position_embeddings
        low_freq_wavelen = old_len / lo
        high_freq_wavelen = old_len / hi
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are interpolated, short ones kept, the middle blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    factor = spec.factor
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    orig = spec.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(spec.beta_fast)
    high = correction_dim(spec.beta_slow)
    if spec.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extra_weight = 1 - ramp
    return inv_inter * (1 - extra_weight) + inv_extra * extra_weight


@functools.lru_cache(maxsize=64)
def _inv_freq_cached(spec: RopeSpec, device: str) -> torch.Tensor:
    """Not to be modified. Computed on the host (SGLang's and HF's values, bit for bit), copied once per
    device without blocking (a GPU pass building a rotation never waits)."""
    return to_device(_compute_inv_freq(spec), device)


def rope_cos_sin(
    positions: torch.Tensor | int,
    spec: RopeSpec,
    *,
    with_attention_scaling: bool = True,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int ``[n]`` (negative allowed) or an int -> cos, sin float32 ``[n, rotary_dim // 2]``. The
    angle is formed in fp32 as HF and SGLang form it, so a key rotated from 0 by ``p`` gets bit-identical
    angles to one computed at ``p``. ``device``: default ``positions``' (CPU for an int)."""
    if isinstance(positions, bool):
        raise TypeError("positions must be an int or an integer tensor, got bool")
    if isinstance(positions, int):
        positions = torch.tensor([positions], dtype=torch.int64)
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be an int or a tensor, got {type(positions).__name__}")
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise TypeError(f"positions must have an integer dtype, got {positions.dtype}")
    if positions.dim() == 0:
        positions = positions.reshape(1)
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1-D [n], got shape {tuple(positions.shape)}")
    dev = torch.device(device) if device is not None else positions.device
    inv_freq = _inv_freq_cached(spec, str(dev))
    angles = positions.to(device=dev)[:, None].float() * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    scale = spec.attention_scaling if with_attention_scaling else 1.0
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """fp32 ``x [n or 1, h, head_dim]`` by fp32 ``cos/sin [n or 1, rotary_dim // 2]``, broadcast."""
    r = spec.rotary_dim
    c, s = cos[:, None, :], sin[:, None, :]
    if spec.is_neox_style:
        half = r // 2
        x1, x2 = x[..., :half], x[..., half:r]
        # Same expression order as HF's x*cos + rotate_half(x)*sin, so fp32 results match bitwise.
        rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
        rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    if r < x.shape[-1]:
        rot = torch.cat((rot, x[..., r:].expand(rot.shape[0], -1, -1)), dim=-1)
    return rot


def _check_heads(x: torch.Tensor, spec: RopeSpec, name: str) -> None:
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor")
    if x.dim() != 3 or x.shape[-1] != spec.head_dim:
        raise ValueError(
            f"{name} must have shape [n_tokens, n_heads, head_dim={spec.head_dim}], "
            f"got {tuple(x.shape)}"
        )


def apply_rope(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """As HF does: x float ``[n_tokens, n_heads, head_dim]`` pre-RoPE, positions int64 ``[n_tokens]`` ->
    x's dtype and shape, with YaRN's scaling on the rotary dims. In fp32 (HF computes bf16/fp16 in
    their own dtype: they differ from HF's by rounding only)."""
    _check_heads(x, spec, "x")
    if not isinstance(positions, torch.Tensor) or positions.shape != (x.shape[0],):
        raise ValueError(f"positions must be a tensor of shape [{x.shape[0]}]")
    cos, sin = rope_cos_sin(positions, spec, with_attention_scaling=True, device=x.device)
    return _rotate(x.float(), cos, sin, spec).to(x.dtype)


def rotate_keys(k: torch.Tensor, delta: int | torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """``apply_rope(k, p) -> apply_rope(k, p + delta)``, in fp32, without YaRN's scaling (the cached keys
    carry it once and it commutes with the rotation). k float ``[n_tokens, n_kv_heads, head_dim]``
    post-RoPE; delta an int or int64 ``[n_tokens]`` (negative: backwards); one key and ``delta [n]`` give
    ``[n, n_kv_heads, head_dim]`` without n copies first. A chunk's keys at 0..4 moved to 100..104:

    >>> import torch
    >>> spec = RopeSpec(head_dim=8)
    >>> k = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(0))
    >>> pos = torch.arange(5)
    >>> moved = rotate_keys(apply_rope(k, pos, spec), 100, spec)
    >>> torch.allclose(moved, apply_rope(k, pos + 100, spec), atol=1e-5)
    True
    """
    _check_heads(k, spec, "k")
    if isinstance(delta, torch.Tensor) and delta.dim() == 1 and delta.shape[0] != k.shape[0] and k.shape[0] != 1:
        raise ValueError(f"delta must be an int or a tensor of shape [{k.shape[0]}], got {tuple(delta.shape)}")
    if isinstance(delta, int) and not isinstance(delta, bool) and delta == 0:
        return k.clone()
    cos, sin = rope_cos_sin(delta, spec, with_attention_scaling=False, device=k.device)
    return _rotate(k.float(), cos, sin, spec).to(k.dtype)


class RotationTable:
    """``R(p)`` for positions int64 [n], built once (per request, for ``stale_shift``'s every layer).
    Per dim ``R(p) x = C(p) * x + S(p) * swap(x)``: ``swap`` exchanges each pair's members, ``C`` the
    cosine, ``S`` the sine signed by member (``-sin``, ``+sin``), ``C = 1, S = 0`` past ``rotary_dim``.
    Equals :func:`rotate_keys` up to rounding, in two fused passes instead of six and a concatenation."""

    def __init__(self, positions: torch.Tensor, spec: RopeSpec, device: torch.device | str | None = None) -> None:
        cos, sin = rope_cos_sin(positions, spec, with_attention_scaling=False, device=device)
        n, r, d = cos.shape[0], spec.rotary_dim, spec.head_dim
        c = torch.ones(n, d, dtype=torch.float32, device=cos.device)
        s = torch.zeros(n, d, dtype=torch.float32, device=cos.device)
        dims = torch.arange(d, device=cos.device)
        if spec.is_neox_style:
            first, second = dims[: r // 2], dims[r // 2: r]
        else:
            first, second = dims[0:r:2], dims[1:r:2]
        c[:, first], c[:, second] = cos, cos
        s[:, first], s[:, second] = -sin, sin
        swap = dims.clone()
        swap[first], swap[second] = second, first
        self.spec = spec
        self._cos, self._sin, self._swap = c[:, None, :], s[:, None, :], swap

    def rotate(self, k: torch.Tensor, rows: torch.Tensor | None = None, inverse: bool = False) -> torch.Tensor:
        """float ``k [n or 1, n_heads, head_dim]`` -> float32 ``[n, n_heads, head_dim]``, row i by position i
        (``rows`` int64 [n]: ``rows[i]``), by ``R(-p) = C - S swap`` with ``inverse``."""
        _check_heads(k, self.spec, "k")
        kf = k.float()
        cos, sin = (self._cos, self._sin) if rows is None else (self._cos[rows], self._sin[rows])
        return torch.addcmul(cos * kf, sin, kf[..., self._swap], value=-1.0 if inverse else 1.0)

    def add_rotated_(self, target: torch.Tensor, k: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``target[i] += R(p_{start+i}) k`` for k float32 ``[n_heads, head_dim]``, target float32 ``[m,
        n_heads, head_dim]`` (a view of pool slots): two fused passes, no temporary of its size."""
        _check_heads(k[None], self.spec, "k")
        rows = slice(start, start + target.shape[0])
        return target.addcmul_(self._cos[rows], k).addcmul_(self._sin[rows], k[..., self._swap])
