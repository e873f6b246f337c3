"""The server's settings: every ``RELAXKV_*`` variable the plugin reads, parsed once per process.

SGLang loads the plugin in each of its processes (the HTTP one and every scheduler);
``server/sglang/plugin.py::register`` calls :func:`server_settings` there, so a bad value stops the process
at startup with one line naming the variable, and every later reader (a request's default policy,
the discovery index, the calibration, the tiers) gets the same parsed object. No other module of
the package reads ``os.environ`` (``tests/unit/test_settings.py`` checks the source): a variable
changed after startup changes nothing, as for SGLang's own server arguments.

| variable | field | values |
|---|---|---|
| ``RELAXKV_DEFAULT_POLICY`` | ``default_policy`` | a served policy (default ``prefix``; checked against the policy registry at startup, ``request/schema.py::check_default_policy``) |
| ``RELAXKV_DEFAULT_BUDGET`` | ``default_budget`` | ``auto`` or a share in [0, 1]; unset: none |
| ``RELAXKV_QUALITY`` | ``quality`` | ``low``, ``medium`` (default), ``high`` or a target KL > 0 |
| ``RELAXKV_CALIBRATION`` | ``calibration`` | a calibration file, or ``none``; unset: the shipped one |
| ``RELAXKV_DISCOVERY_INDEX`` | ``discovery_index`` | on/off (default off) |
| ``RELAXKV_ADMISSION_HOLD`` | ``admission_hold`` | on/off (default on) |
| ``RELAXKV_WEIGHTS_FINGERPRINT`` | ``weights_fingerprint`` | ``sampled`` (default) or ``full`` |
| ``RELAXKV_TP_CHECK`` | ``tp_check`` | on/off (default off; the tests' TP servers: on): the ranks compare their decisions |
| ``RELAXKV_TEST_ROPE_OVERRIDE`` | ``rope_override`` | tests only: a JSON object of ``RopeSpec`` fields |
| ``RELAXKV_HOST_CACHE_*``, ``RELAXKV_CHUNK_DIR``, ``RELAXKV_DISK_CACHE_GB``, ``RELAXKV_HICACHE_*`` | ``environment`` | each lower tier parses its own (``cache/sglang/tier_configs.py``) |

On/off: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case); anything else stops
the process. The launchers (``server/launch.py``, ``server/cluster.py``) hand the environment on to their child
processes through :func:`child_environment`; the offline tools find their cache through
:func:`asset_cache_root`.
"""

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
    """The parsed settings (module doc: the variable behind each field).

    Attributes:
        default_policy: the policy of a request that names none.
        default_budget: a repair request's budget when it gives no ratio nor budget (None: none).
        quality: what an ``auto`` budget aims at unless the request says.
        calibration: the calibration file to serve, ``"none"`` for the code defaults, None: the
            one shipped for the served model.
        discovery_index: discovery also finds the chunks it discovered before.
        admission_hold: chunk hits are held for a request waiting on admission.
        weights_fingerprint: how the model identity hashes its weights.
        tp_check: tensor-parallel ranks compare digests of their decisions (one small gather each).
        rope_override: tests only, fields replacing the served RoPE's (None: none).
        environment: every ``RELAXKV_*`` variable as set at startup (the lower tiers read theirs).
    """

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
    """This process's settings, read from its environment on the first call (the plugin's
    ``register``, at startup) and the same object after."""
    return ServerSettings.from_env(os.environ)


def child_environment(**extra: str) -> dict[str, str]:
    """This process's environment with ``extra`` set: what a launched server or gateway gets."""
    return {**os.environ, **extra}


def asset_cache_root() -> pathlib.Path:
    """Where the offline wheels, models and data are cached: ``$RELAXKV_CACHE``, else
    ``~/.cache/relaxkv-sglang`` (read at each call: a tool's setting, not the server's)."""
    return pathlib.Path(os.environ.get(CACHE_ROOT_ENV) or pathlib.Path.home() / ".cache" / "relaxkv-sglang")


def _parsed(env: Mapping[str, str], name: str, default: Any, parse: Any) -> Any:
    """``parse(value)`` of variable ``name`` (``default`` when unset or blank); a ValueError from
    ``parse`` stops the process with one line."""
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
