"""Reading a tier's configuration from environment variables: a malformed value is a
:class:`TierConfigError` naming the variable, its value and what it must be (one line at startup).
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["TierConfigError", "env_number"]


class TierConfigError(ValueError):
    """A tier variable with a value the tier cannot take."""


def env_number(env: Mapping[str, str], name: str, default: float, unit: str) -> float:
    """``env[name]`` as a finite number >= 0 (``default`` when unset or empty); ``unit`` names what
    it counts (GB, KB, seconds) in the error."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise TierConfigError(f"{name}={raw!r}: not a number of {unit}") from None
    if not value >= 0 or value == float("inf"):
        raise TierConfigError(f"{name}={raw!r}: must be a finite number >= 0")
    return value
