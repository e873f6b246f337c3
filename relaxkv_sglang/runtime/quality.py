"""What an ``auto`` repair budget aims at (:mod:`relaxkv_sglang.repair.auto_budget`): a level of
:data:`QUALITY_LEVELS` (a price in the model's calibration) or a target mean first-token KL vs full prefill."""

from __future__ import annotations

from typing import Any

__all__ = ["AUTO", "QUALITY_LEVELS", "DEFAULT_QUALITY", "parse_quality"]

AUTO = "auto"  # the relaxkv_budget value that asks for a per-request choice
QUALITY_LEVELS: tuple[str, ...] = ("low", "medium", "high")
DEFAULT_QUALITY = "medium"


def parse_quality(value: Any) -> str | float:
    """A level name (any case; lower-cased) or a target KL (a finite number above 0, or its string); else ValueError.

    >>> parse_quality("High"), parse_quality(0.05), parse_quality("0.1")
    ('high', 0.05, 0.1)
    """
    if isinstance(value, str) and value.strip().lower() in QUALITY_LEVELS:
        return value.strip().lower()
    number = float("nan")
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:
            pass
    if not 0 < number < float("inf"):
        raise ValueError(f"must be one of {', '.join(QUALITY_LEVELS)} or a target KL above 0, got {value!r}")
    return number
