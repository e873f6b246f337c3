"""The startup correctness gate: what is compared, how errors are measured, and the tolerances.

Chunk reuse rests on one identity. A text computed alone at positions ``p..p+n-1`` (attending
only to itself) has, at every layer ``l``, the keys of the same text computed at ``0..n-1``
rotated by ``p``, and the same values:

    K_l(p) = R(p) · K_l(0),    V_l(p) = V_l(0)

because RoPE attention scores depend only on position differences, so the hidden states (and
with them K before RoPE and V) do not depend on ``p``. The plugin's cache applies ``R(Δ)``
itself (:func:`relaxkv_sglang.core.rope.rotate_keys` with the ``RopeSpec`` it built from the
model's config). If that spec is not the rotation the model's own layers apply (a RoPE scaling
or theta read wrongly, a different pairing), re-rotated chunks are garbage and every chunk
policy garbles its output. The gate checks the identity on the loaded model before the server
serves chunk policies:

(a) ``rope_k``: the text at ``0`` and at ``p``, every layer; ``R(p)·K_l(0)`` (the serving
    rotation) against ``K_l(p)``, and ``V_l(0)`` against ``V_l(p)``.
(b) ``pic_kv`` / ``pic_logits``: a one-chunk ``pic`` request against ``full``. The chunk's KV
    cached at canonical start ``p`` (computed there alone) is copied back to position ``0`` with
    ``R(-p)``, then the rest of the text (the query) runs over it; its KV at every layer and its
    logits must equal the ordinary causal prefill of the whole text (for a chunk at position 0
    with nothing before it, ``pic`` is exact).

Error measure, for a check over tensors ``x`` (actual) and ``y`` (expected) of shape
``[n, h, d]`` (keys or values: tokens, heads, head dim; logits are ``[n, 1, vocab]``):

    err = max_{t,h} ‖x_{t,h} − y_{t,h}‖₂ / rms_{t,h} ‖y_{t,h}‖₂

the worst vector's error relative to the layer's typical vector norm (the K norm for keys).
Dividing by the RMS norm, not each vector's own, keeps a near-zero vector from inflating the
error; taking the max keeps one bad head from hiding in an average. A check's error is the
max over layers (and over K and V).

Tolerances (:func:`tolerance_for`): both sides are computed by the same model in the same
dtype, so only rounding differs, and it enters in three places: the pool's storage of K/V
(relative ``u`` per element, ``u`` the dtype's unit roundoff: fp32 2⁻²⁴, fp16 2⁻¹¹, bf16 2⁻⁸),
the model's cos/sin table (SGLang keeps it in the model dtype on a CPU, so cos and sin at
``p`` carry a rounding of ``u`` that the plugin's fp32 rotation does not), and the angle
``p·f`` (SGLang computes the frequencies ``f`` with another fp32 expression than the plugin,
which mirrors HF, and on a GPU on the device: one ulp of ``f`` is ``p·f·2⁻²⁴`` rad at ``p``, up
to 2.4e-4 at ``p = 4096``). Each enters every layer's hidden state at the level of ``u`` and is carried
through the layers (RMSNorm keeps it from growing much, but it accumulates: the largest errors
are in middle and late layers, and in V as much as in K, i.e. drift of the hidden states, not
rotation). Measured (SmolLM2-135M, 30 layers, 27 tokens, ``p = 4096``): fp32 5.8e-5, bf16
0.042 (= 11 u, worst at layer 20's V); tiny model fp32 8.7e-5. The tolerance is ``64·u`` for
the half dtypes (bf16 0.25, fp16 0.031: 6× the bf16 drift measured on SmolLM2, room for deeper
models), and ``2e-3`` for fp32, where the angle term dominates ``u``. A wrong rotation is not
a rounding effect: any pair whose angle is off by ``δ`` contributes ``2·sin(δ/2)`` of its
norm, so a wrong theta, a scaling the model does not use or the other pairing gives errors of
order 1 at ``p`` in the thousands (measured: 1.5 on the tiny model served with theta 20000
instead of 10000; 2.0-2.2 for each of those three on a random Llama in the unit tests), above
every tolerance. A RoPE that is wrong only in the lowest frequencies (a Llama-3 scaling
misread) is the weakest case; the gate uses the largest ``p`` the model allows (up to 4096) to
make it as visible as it can, but in bf16 a small enough such error would pass.

A negative control (``control``, not one of :data:`CHECKS`): ``rope_k`` again, the keys
re-rotated by a RoPE the model does not use (the served one with twice its theta). It must fail;
if it does not, the check cannot tell a wrong rotation on this model (keys that barely depend on
the rotation, a text too short), and the gate fails rather than vouch for the rotation
(:func:`judge`). It runs the same model's layers the real checks ran (no further forward), so
every served model family shows its gate can refuse a wrong rotation.

This module imports only the standard library and torch.
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
