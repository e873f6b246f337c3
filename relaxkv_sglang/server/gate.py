"""The startup correctness gate: what is compared, how errors are measured, and the tolerances.

Chunk reuse rests on one identity: a text computed alone at positions ``p..p+n-1`` has, at every
layer ``l``, the keys of the same text computed at ``0..n-1`` rotated by ``p``, and the same values,

    K_l(p) = R(p) · K_l(0),    V_l(p) = V_l(0)

(RoPE scores depend only on position differences). The cache applies ``R(Δ)`` itself
(:func:`relaxkv_sglang.model.rope.rotate_keys` with the ``RopeSpec`` built from the config); if that
is not the rotation the model's layers apply, every chunk policy garbles its output. The gate
checks, on the loaded model:

(a) ``rope_k``: ``R(p)·K_l(0)`` against ``K_l(p)`` and ``V_l(0)`` against ``V_l(p)``, every layer;
(b) ``pic_kv`` / ``pic_logits``: a one-chunk ``pic`` request (the chunk cached at ``p``, copied back
    to 0 with ``R(-p)``, the query run over it) against ``full``: equal KV and logits.

Error of ``x`` (actual) against ``y`` (expected), both [n, h, d] (logits [n, 1, vocab]):

    err = max_{t,h} ‖x_{t,h} − y_{t,h}‖₂ / rms_{t,h} ‖y_{t,h}‖₂

max over layers (and K, V). Tolerance (:func:`tolerance_for`): only rounding differs (the pool's
storage, the model's cos/sin table, the angle ``p·f``), each at the level of the unit roundoff
``u`` (fp32 2⁻²⁴, fp16 2⁻¹¹, bf16 2⁻⁸) carried through the layers: ``64·u`` for half dtypes,
``2e-3`` for fp32. A wrong rotation by ``δ`` contributes ``2·sin(δ/2)`` of a pair's norm: order 1
at the largest ``p`` the model allows (up to 4096). Negative control (``control``): ``rope_k`` with
twice the served theta must fail, else the gate refuses (:func:`judge`).
Measured errors behind the tolerances: docs/experiments/INDEX.md#gate-tolerances.
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
    """The largest relative error (module doc's measure) a check may show in ``dtype``.

    Args:
        dtype: the KV pool's dtype: float32, float16 or bfloat16. Another (an fp8 KV cache)
            gets 2× the bf16 tolerance (0.5): not measured, and too loose to catch more than a
            grossly wrong rotation.
    Returns:
        The tolerance, a float: 2e-3 (fp32), 0.03125 (fp16), 0.25 (bf16).
    """
    if dtype == torch.float32:
        return _FP32_TOLERANCE
    u = _UNIT_ROUNDOFF.get(dtype)
    if u is None:
        return 2 * _HALF_FACTOR * _UNIT_ROUNDOFF[torch.bfloat16]
    return _HALF_FACTOR * u


def gate_offset(context_len: int, n_tokens: int) -> int:
    """The position ``p`` the text is moved to: as far as the context allows, at most 4096.

    Args:
        context_len: the model's context length (positions ``0..context_len-1`` exist).
        n_tokens: the text's length.
    Returns:
        ``min(4096, context_len - n_tokens)``, at least 1.
    Raises:
        ValueError: the context is too short to hold the text twice (``p < 1``).
    """
    p = min(_MAX_OFFSET, context_len - n_tokens)
    if p < 1:
        raise ValueError(f"context length {context_len} leaves no room to move a {n_tokens}-token text")
    return p


def gate_token_ids(encoded: Optional[Sequence[int]], vocab_size: int, n_tokens: int = 32) -> list[int]:
    """The gate's token ids: the tokenized :data:`GATE_TEXT`, or a fixed pseudo-random sequence.

    Args:
        encoded: the text's ids from the server's tokenizer (None: none available).
        vocab_size: the model's vocabulary size.
        n_tokens: length when no tokenizer is available.
    Returns:
        At least 8 ids, each in ``[0, vocab_size)``.
    """
    ids = [int(t) for t in encoded or () if 0 <= int(t) < vocab_size]
    if len(ids) >= 8:
        return ids
    return [(1000003 * i + 7919) % vocab_size for i in range(1, n_tokens + 1)]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max_{t,h} ‖actual − expected‖₂ / rms_{t,h} ‖expected‖₂`` (module doc).

    Args:
        actual, expected: ``[n, h, d]`` (or ``[n, d]``, read as one head), any float dtype;
            computed in fp32.
    Returns:
        The error, a float >= 0 (``inf`` if ``expected`` is all zero and ``actual`` is not;
        ``nan`` if either holds a nan).
    """
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
    """One check's outcome.

    Attributes:
        name: one of :data:`CHECKS`.
        max_error: the largest relative error over layers (and K/V).
        tolerance: the bound it is held to.
        worst: where the largest error is (e.g. ``"layer 3 K"``).
    """

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
    """The worst :func:`relative_error` over pairs of tensors (e.g. every layer's K and V).

    Args:
        name: the check's name.
        actual: ``(label, tensor)`` pairs, e.g. ``("layer 3 K", k)``, each ``[n, h, d]``.
        expected: the tensors they must equal, same order and shapes.
        tolerance: see :func:`tolerance_for`.
    Returns:
        The check's result; ``worst`` is the label of the largest error.
    """
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
    """The gate's verdict for one model.

    Attributes:
        status: ``"passed"``, ``"failed"`` (a check out of tolerance, or the gate could not run)
            or ``"skipped"`` (turned off by the operator).
        checks: the checks that ran.
        reason: why it failed (empty when passed).
        offset: the position ``p`` the text was moved to.
        n_tokens: the text's length.
        dtype: the KV pool's dtype, as a string.
        seconds: the gate's wall time.
        control: the negative control (module doc): ``rope_k`` under a wrong rotation, which must
            fail (None: it did not run).
    """

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
    """The verdict over the checks: passed when every one is within tolerance and the control
    (when it ran) is not.

    Args:
        checks: the results, in :data:`CHECKS` order.
        offset, n_tokens, dtype: recorded in the result.
        control: the negative control (module doc), or None.
    Returns:
        ``passed``, or ``failed`` with ``reason`` naming every failed check (its error, tolerance
        and where), e.g. ``"keys re-rotated by the plugin's RoPE (...) do not match the model's own
        RoPE: rope_k FAILED: error 1.5 at layer 1 K (tolerance 0.002); ..."``.
    """
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
