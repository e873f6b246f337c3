"""Every ``RELAXKV_*`` variable the plugin reads (table: ``docs/api.md``, server settings), parsed once per
process at startup, so a bad value stops it with one line naming the variable. No other module reads
``os.environ`` (``tests/unit/test_settings.py``): a variable changed after startup changes nothing."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import types
from typing import Any, Mapping, Optional

from relaxkv_sglang.runtime.quality import AUTO, DEFAULT_QUALITY, parse_quality

DEFAULT_POLICY_ENV = "RELAXKV_DEFAULT_POLICY"
DEFAULT_BUDGET_ENV = "RELAXKV_DEFAULT_BUDGET"
QUALITY_ENV = "RELAXKV_QUALITY"
CALIBRATION_ENV = "RELAXKV_CALIBRATION"
DISCOVERY_INDEX_ENV = "RELAXKV_DISCOVERY_INDEX"
ADMISSION_HOLD_ENV = "RELAXKV_ADMISSION_HOLD"
FINGERPRINT_ENV = "RELAXKV_WEIGHTS_FINGERPRINT"
TP_CHECK_ENV = "RELAXKV_TP_CHECK"
ROPE_OVERRIDE_ENV = "RELAXKV_TEST_ROPE_OVERRIDE"
CACHE_ROOT_ENV = "RELAXKV_CACHE"
PREFIX = "RELAXKV_"

_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
FINGERPRINT_MODES = ("sampled", "full")

__all__ = ["ServerSettings", "server_settings", "child_environment", "asset_cache_root", "bad_variable"]


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """The parsed settings (module doc: the variable behind each field)."""

    default_policy: str = "prefix"
    default_budget: float | str | None = None
    quality: str | float = DEFAULT_QUALITY
    calibration: Optional[str] = None
    discovery_index: bool = False
    admission_hold: bool = True
    weights_fingerprint: str = FINGERPRINT_MODES[0]
    tp_check: bool = False
    rope_override: Optional[dict[str, Any]] = None
    environment: Mapping[str, str] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "ServerSettings":
        """The settings ``env`` gives; ``SystemExit`` with one line naming the first bad variable."""
        return cls(
            default_policy=env.get(DEFAULT_POLICY_ENV, "").strip() or cls.default_policy,
            default_budget=_parsed(env, DEFAULT_BUDGET_ENV, None, _budget),
            quality=_parsed(env, QUALITY_ENV, DEFAULT_QUALITY, parse_quality),
            calibration=env.get(CALIBRATION_ENV) or None,
            discovery_index=_parsed(env, DISCOVERY_INDEX_ENV, False, _switch),
            admission_hold=_parsed(env, ADMISSION_HOLD_ENV, True, _switch),
            weights_fingerprint=_parsed(env, FINGERPRINT_ENV, FINGERPRINT_MODES[0], _fingerprint_mode),
            tp_check=_parsed(env, TP_CHECK_ENV, False, _switch),
            rope_override=_parsed(env, ROPE_OVERRIDE_ENV, None, _json_object),
            environment=types.MappingProxyType({k: v for k, v in env.items() if k.startswith(PREFIX)}),
        )


@functools.cache
def server_settings() -> ServerSettings:
    """This process's settings, read on the first call (the plugin's ``register``) and the same object after."""
    return ServerSettings.from_env(os.environ)


def child_environment(**extra: str) -> dict[str, str]:
    """This process's environment with ``extra`` set: what a launched server or gateway gets."""
    return {**os.environ, **extra}


def asset_cache_root() -> pathlib.Path:
    """Where the offline wheels, models and data are cached: ``$RELAXKV_CACHE``, else
    ``~/.cache/relaxkv-sglang`` (read at each call: a tool's setting, not the server's)."""
    return pathlib.Path(os.environ.get(CACHE_ROOT_ENV) or pathlib.Path.home() / ".cache" / "relaxkv-sglang")


def _parsed(env: Mapping[str, str], name: str, default: Any, parse: Any) -> Any:
    """``parse(value)`` of variable ``name`` (``default`` when unset or blank); stops on a ValueError."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        raise bad_variable(name, raw, str(exc)) from None


def bad_variable(name: str, raw: str, reason: str) -> SystemExit:
    """What stops the process for variable ``name`` set to ``raw``: one line saying why."""
    return SystemExit(f"relaxkv-sglang: {name}={raw!r}: {reason}")


def _budget(raw: str) -> float | str:
    if raw == AUTO:
        return AUTO
    share = float(raw)
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"must be {AUTO!r} or a share in [0, 1] (as relaxkv_budget), got {share}")
    return share


def _switch(raw: str) -> bool:
    value = raw.lower()
    if value not in _ON + _OFF:
        raise ValueError("must be 1 or 0 (or true/false, yes/no, on/off)")
    return value in _ON


def _fingerprint_mode(raw: str) -> str:
    if raw not in FINGERPRINT_MODES:
        raise ValueError(f"must be {' or '.join(FINGERPRINT_MODES)}")
    return raw


def _json_object(raw: str) -> dict[str, Any]:
    value = json.loads(raw)  # json.JSONDecodeError is a ValueError
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return value
