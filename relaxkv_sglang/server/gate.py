"""The startup correctness gate: what is compared, how errors are measured, and the tolerances.

Chunk reuse rests on ``K_l(p) = R(p)·K_l(0)``, ``V_l(p) = V_l(0)`` at every layer ``l`` for a text computed
alone at ``p..p+n-1`` (RoPE scores depend only on position differences). The cache applies ``R(Δ)`` itself
(:func:`relaxkv_sglang.model.rope.rotate_keys`); if that is not the model's rotation, every chunk policy
garbles its output. Checked on the loaded model: ``rope_k``: ``R(p)·K_l(0)`` against ``K_l(p)`` and ``V_l(0)``
against ``V_l(p)``, every layer; ``pic_kv`` / ``pic_logits``: a one-chunk ``pic`` request (cached at ``p``,
copied back to 0 with ``R(-p)``, the query run over it) against ``full``: equal KV and logits.

Error of ``x`` against ``y``, both [n, h, d] (logits [n, 1, vocab]): ``max_{t,h} ‖x_{t,h} − y_{t,h}‖₂ /
rms_{t,h} ‖y_{t,h}‖₂``, max over layers (and K, V). Tolerance: only rounding differs (the pool's storage, the
cos/sin table, the angle ``p·f``), each at the unit roundoff ``u`` (fp32 2⁻²⁴, fp16 2⁻¹¹, bf16 2⁻⁸) carried
through the layers: ``64·u`` for half dtypes, ``2e-3`` for fp32. A wrong rotation by ``δ`` contributes
``2·sin(δ/2)`` of a pair's norm: order 1 at ``p`` up to 4096. Negative control: ``rope_k`` with twice the
served theta must fail, else the gate refuses (:func:`judge`). Measured: docs/experiments/INDEX.md#gate-tolerances.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

__all__ = [
    "CHECKS",
    "GATE_TEXT",
    "CheckResult",
    "GateResult",
    "gate_offset",
    "gate_token_ids",
    "relative_error",
    "compare_layers",
    "tolerance_for",
    "judge",
]

#: The checks, in the order they run.
CHECKS: tuple[str, ...] = ("rope_k", "pic_kv", "pic_logits")

#: The gate's short text (tokenized by the server's tokenizer; a few dozen tokens).
GATE_TEXT = ("The river rises in the northern hills and flows south for two hundred miles. "
             "Which town lies at its mouth, and who founded it?")

_UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
_FP32_TOLERANCE = 2e-3  # the fp32 angle rounding at p <= 4096, with margin (module doc)
_HALF_FACTOR = 64  # tolerance = 64 u for bf16 / fp16 (module doc)
_MAX_OFFSET = 4096


def tolerance_for(dtype: torch.dtype) -> float:
    """The largest relative error a check may show in the KV pool's ``dtype``: 2e-3 (fp32), 0.03125 (fp16), 0.25 (bf16);
    another (an fp8 KV cache) 0.5: not measured, and too loose to catch more than a grossly wrong rotation."""
    if dtype == torch.float32:
        return _FP32_TOLERANCE
    u = _UNIT_ROUNDOFF.get(dtype)
    if u is None:
        return 2 * _HALF_FACTOR * _UNIT_ROUNDOFF[torch.bfloat16]
    return _HALF_FACTOR * u


def gate_offset(context_len: int, n_tokens: int) -> int:
    """The position ``p`` the text is moved to: ``min(4096, context_len - n_tokens)``; ValueError under 1."""
    p = min(_MAX_OFFSET, context_len - n_tokens)
    if p < 1:
        raise ValueError(f"context length {context_len} leaves no room to move a {n_tokens}-token text")
    return p


def gate_token_ids(encoded: Optional[Sequence[int]], vocab_size: int, n_tokens: int = 32) -> list[int]:
    """The tokenized :data:`GATE_TEXT` (``encoded``, None without a tokenizer), or a fixed pseudo-random
    sequence of ``n_tokens``: at least 8 ids, each in ``[0, vocab_size)``."""
    ids = [int(t) for t in encoded or () if 0 <= int(t) < vocab_size]
    if len(ids) >= 8:
        return ids
    return [(1000003 * i + 7919) % vocab_size for i in range(1, n_tokens + 1)]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max_{t,h} ‖actual − expected‖₂ / rms_{t,h} ‖expected‖₂``; both ``[n, h, d]`` (or ``[n, d]``: one head), any
    float dtype, computed in fp32. ``inf`` if only ``expected`` is all zero; ``nan`` if either holds a nan."""
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    x, y = actual.float(), expected.float()
    if y.dim() == 2:
        x, y = x[:, None, :], y[:, None, :]
    diff = (x - y).norm(dim=-1).max()
    scale = y.norm(dim=-1).pow(2).mean().sqrt()
    if bool(torch.isnan(diff)) or bool(torch.isnan(scale)):
        return float("nan")
    if float(scale) == 0.0:
        return 0.0 if float(diff) == 0.0 else float("inf")
    return float(diff / scale)


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One of :data:`CHECKS`: its largest error over layers (and K/V), and where (e.g. ``"layer 3 K"``)."""

    name: str
    max_error: float
    tolerance: float
    worst: str = ""

    @property
    def passed(self) -> bool:
        """Within tolerance (a nan fails)."""
        return self.max_error <= self.tolerance

    def describe(self) -> str:
        """One line: the check, its error, the tolerance, where."""
        verdict = "ok" if self.passed else "FAILED"
        where = f" at {self.worst}" if self.worst else ""
        return f"{self.name} {verdict}: error {self.max_error:.3g}{where} (tolerance {self.tolerance:.3g})"


def compare_layers(name: str, actual: Sequence[tuple[str, torch.Tensor]],
                   expected: Sequence[torch.Tensor], tolerance: float) -> CheckResult:
    """The worst :func:`relative_error` of ``(label, tensor)`` pairs (each ``[n, h, d]``, e.g. every layer's K
    and V) against ``expected`` (same order and shapes); ``worst`` is its label."""
    if len(actual) != len(expected) or not actual:
        raise ValueError(f"{name}: {len(actual)} tensors to compare with {len(expected)}")
    worst, label = -1.0, ""
    for (lab, x), y in zip(actual, expected):
        err = relative_error(x, y)
        if err != err:  # nan: the worst possible
            return CheckResult(name, float("nan"), tolerance, lab)
        if err > worst:
            worst, label = err, lab
    return CheckResult(name, worst, tolerance, label)


@dataclasses.dataclass(frozen=True)
class GateResult:
    """The gate's verdict for one model: ``status`` ``"passed"``, ``"failed"`` (a check out of tolerance, or
    the gate could not run) or ``"skipped"`` (turned off); ``offset`` the ``p`` the text was moved to;
    ``control`` ``rope_k`` under a wrong rotation, which must fail (None: it did not run)."""

    status: str
    checks: tuple[CheckResult, ...] = ()
    reason: str = ""
    offset: int = 0
    n_tokens: int = 0
    dtype: str = ""
    seconds: float = 0.0
    control: Optional[CheckResult] = None

    @property
    def refuses_chunks(self) -> bool:
        """Chunk policies are refused (the gate failed)."""
        return self.status == "failed"

    def to_dict(self) -> dict:
        """JSON form, for /get_server_info: status, reason, per check its error and tolerance, and
        the control's error and whether it told the wrong rotation (``detected``)."""
        control = None if self.control is None else {
            "max_error": self.control.max_error, "tolerance": self.control.tolerance, "worst": self.control.worst,
            "detected": not self.control.passed}
        return {
            "status": self.status,
            "reason": self.reason,
            "offset": self.offset,
            "n_tokens": self.n_tokens,
            "dtype": self.dtype,
            "seconds": self.seconds,
            "checks": {c.name: {"max_error": c.max_error, "tolerance": c.tolerance, "worst": c.worst,
                                "passed": c.passed} for c in self.checks},
            "control": control,
        }

    @staticmethod
    def failure(reason: str, **fields: object) -> "GateResult":
        """A gate that could not run its checks (refuses chunk policies)."""
        return GateResult(status="failed", reason=reason, **fields)


def judge(checks: Sequence[CheckResult], *, offset: int, n_tokens: int, dtype: str,
          control: Optional[CheckResult] = None) -> GateResult:
    """``passed`` when every check is within tolerance and the control (when it ran) is not, else ``failed``
    with ``reason`` naming every failed check (its error, tolerance and where)."""
    failed = [c for c in checks if not c.passed]
    reason = "; ".join(c.describe() for c in failed)
    if any(c.name == "rope_k" for c in failed):
        reason = ("keys re-rotated by the plugin's RoPE (theta, scaling, pairing read from the model's config) "
                  "do not match the model's own RoPE: " + reason)
    blind = control is not None and control.passed
    if blind:
        reason = "; ".join(filter(None, [reason, (
            f"the gate cannot tell a wrong rotation on this model: keys re-rotated with twice the RoPE theta "
            f"give {control.name} error {control.max_error:.2g}, within the tolerance {control.tolerance:.2g}")]))
    return GateResult(status="failed" if failed or blind else "passed", checks=tuple(checks), reason=reason,
                      offset=offset, n_tokens=n_tokens, dtype=dtype, control=control)
