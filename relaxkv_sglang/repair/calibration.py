"""Per-model calibration of the repair knobs: one versioned JSON file per model, found by its config.

The knobs whose best on a model's development split (``python -m scripts.calibrate``) differs from the defaults
(tuned on SmolLM2-135M). Format (:data:`FORMAT_VERSION` 2), ``relaxkv_sglang/calibrations/<model>.json``::

    {"version": 2, "model": "qwen2.5-0.5b",
     "fingerprint": {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 24, ...,
                     "rope": {"rope_theta": 1000000.0, "rope_type": "default"}},
     "knobs": {"stale_shift_scale": 1.0},
     "evidence": {"command": "...", "date": "...", "git_commit": "...", "steps": [...]},
     "budget_model": {"features": [...], "coefficients": [...], "prices": {"medium": 0.4, ...}, ...}}

A file applies only to a model with its ``fingerprint`` (:func:`config_fingerprint`); ``knobs`` are flat knob names,
never per-request ones (:data:`PER_REQUEST_KNOBS`); without ``budget_model`` an ``auto`` budget falls back to the
anchor ratio's default. Which file is served: docs/api.md#repair-calibration-per-model-knob-defaults.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Mapping, Optional

from relaxkv_sglang.repair.auto_budget import BudgetModel
from relaxkv_sglang.repair.repair_config import RepairConfig, knob_defaults

__all__ = ["FORMAT_VERSION", "FINGERPRINT_KEYS", "PER_REQUEST_KNOBS", "CALIBRATION_DIR",
           "DEFAULTS_NOTE", "NO_CALIBRATION", "CalibrationError", "Calibration", "config_fingerprint",
           "rope_parameters", "model_fingerprint",
           "load_calibration", "save_calibration", "find_calibration", "calibration_for_model",
           "served_calibration", "base_config", "changed_knobs", "calibration_path"]

FORMAT_VERSION = 2
# What identifies a model's shape: two models that agree on all of these share a calibration file.
FINGERPRINT_KEYS = ("architectures", "num_hidden_layers", "hidden_size", "num_attention_heads",
                    "num_key_value_heads", "vocab_size", "rope")
PER_REQUEST_KNOBS = ("anchor_ratio", "budget", "seed")
NO_CALIBRATION = "none"  # the override that serves the code defaults (RELAXKV_CALIBRATION=none)
CALIBRATION_DIR = pathlib.Path(__file__).resolve().parent.parent / "calibrations"
DEFAULTS_NOTE = "repair knobs are the defaults (tuned on SmolLM2-135M)"


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message is one line naming the file."""


def config_fingerprint(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """:data:`FINGERPRINT_KEYS` of a HF config dict (a multimodal config's ``text_config`` when
    the top level lacks them); ``num_key_value_heads`` defaults to the attention heads, as HF does."""
    source = hf_config
    if "num_hidden_layers" not in hf_config and isinstance(hf_config.get("text_config"), Mapping):
        source = {**hf_config["text_config"], "architectures": hf_config.get("architectures")}
    fingerprint = {key: source.get(key) for key in FINGERPRINT_KEYS}
    fingerprint["rope"] = rope_parameters(source)
    if fingerprint["num_key_value_heads"] is None:
        fingerprint["num_key_value_heads"] = fingerprint["num_attention_heads"]
    fingerprint["architectures"] = list(fingerprint["architectures"] or [])
    return fingerprint


def rope_parameters(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The config's RoPE parameters in one form: ``rope_parameters``, else ``rope_scaling`` with ``rope_theta``; the
    legacy ``type`` key folded into ``rope_type`` (SGLang's loaded config has both, a ``config.json`` one)."""
    params = hf_config.get("rope_parameters")
    if isinstance(params, Mapping):
        params = dict(params)
    else:
        params = dict(hf_config.get("rope_scaling") or {})
        if hf_config.get("rope_theta") is not None:
            params["rope_theta"] = hf_config["rope_theta"]
    legacy_type = params.pop("type", None)
    params.setdefault("rope_type", legacy_type or "default")
    return params


def _model_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    path = pathlib.Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"{path}: cannot read the model's config ({exc})") from None


def model_fingerprint(model_dir: str | os.PathLike) -> dict[str, Any]:
    return config_fingerprint(_model_config(model_dir))


def _check_knob(name: str, value: Any, defaults: Mapping[str, Any]) -> None:
    """A calibrated knob is a known, model-dependent knob whose value has its default's type."""
    if name not in defaults:
        raise CalibrationError(f"unknown repair knob {name!r}; the knobs are {', '.join(defaults)}")
    if name in PER_REQUEST_KNOBS:
        raise CalibrationError(f"knob {name!r} is a per-request setting, not a model calibration")
    default = defaults[name]
    if isinstance(default, bool) or isinstance(value, bool):
        same_type = isinstance(value, bool) and isinstance(default, bool)
    elif isinstance(default, float):  # JSON writes 1.0 as 1.0, but a hand-written 1 is a number too
        same_type = isinstance(value, (int, float))
    else:
        same_type = isinstance(value, type(default))
    if not same_type:
        raise CalibrationError(f"knob {name!r}: {value!r} is not a {type(default).__name__}")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """One model's calibrated repair knobs (module doc); treat the dicts as read-only. ``knobs``: only those
    that differ from the code defaults; ``path``: None when not read from a file."""

    model: str
    fingerprint: dict[str, Any]
    knobs: dict[str, Any]
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)
    version: int = FORMAT_VERSION
    path: Optional[str] = dataclasses.field(default=None, compare=False)
    budget_model: Optional[BudgetModel] = None
    budget_evidence: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.version != FORMAT_VERSION:
            raise CalibrationError(f"format version {self.version!r}; this plugin reads version {FORMAT_VERSION}")
        if sorted(self.fingerprint) != sorted(FINGERPRINT_KEYS):
            raise CalibrationError(f"fingerprint must have exactly {', '.join(FINGERPRINT_KEYS)}")
        defaults = knob_defaults()
        for name, value in self.knobs.items():
            _check_knob(name, value, defaults)
        try:
            RepairConfig.from_knobs(**self.knobs)
        except (TypeError, ValueError) as exc:
            raise CalibrationError(f"knobs: {exc}") from None

    def base_config(self) -> RepairConfig:
        return RepairConfig.from_knobs(**self.knobs)

    def matches(self, fingerprint: Mapping[str, Any]) -> bool:
        return dict(fingerprint) == dict(self.fingerprint)

    def describe(self) -> str:
        """``<file> (knobs: a=1, b=x)``, as the server's startup line names it."""
        knobs = ", ".join(f"{k}={v}" for k, v in sorted(self.knobs.items())) or "none differ from the defaults"
        return f"{self.path or self.model} (knobs: {knobs})"

    def to_json(self) -> dict[str, Any]:
        data = {"version": self.version, "model": self.model, "fingerprint": dict(self.fingerprint),
                "knobs": dict(sorted(self.knobs.items())), "evidence": dict(self.evidence)}
        if self.budget_model is not None:
            data["budget_model"] = {**self.budget_model.to_json(), "evidence": dict(self.budget_evidence)}
        return data

    def state(self) -> dict[str, Any]:
        """What a client sees of it (the server's info route); ``budget_prices`` None without a budget model."""
        prices = dict(self.budget_model.prices) if self.budget_model is not None else None
        return {"file": self.path, "model": self.model, "version": self.version, "knobs": dict(self.knobs),
                "budget_prices": prices}


def changed_knobs(knobs: Mapping[str, Any]) -> dict[str, Any]:
    """The knobs whose value differs from the code default (what a calibration file holds)."""
    defaults = knob_defaults()
    return {name: value for name, value in knobs.items() if defaults.get(name) != value}


def load_calibration(path: str | os.PathLike) -> Calibration:
    """The calibration in ``path``; :class:`CalibrationError` (naming the file) when it is unusable."""
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"calibration {path}: cannot read it ({exc})") from None
    if not isinstance(data, dict):
        raise CalibrationError(f"calibration {path}: not a JSON object")
    unknown = set(data) - {"version", "model", "fingerprint", "knobs", "evidence", "budget_model"}
    if unknown or not {"version", "model", "fingerprint", "knobs"} <= set(data):
        raise CalibrationError(f"calibration {path}: expected the fields version, model, fingerprint, knobs, "
                               f"evidence, budget_model; got {', '.join(sorted(data))}")
    if not isinstance(data["knobs"], dict) or not isinstance(data["fingerprint"], dict):
        raise CalibrationError(f"calibration {path}: knobs and fingerprint must be JSON objects")
    budget = data.get("budget_model")
    try:
        model = BudgetModel.from_json(budget) if budget is not None else None
    except ValueError as exc:
        raise CalibrationError(f"calibration {path}: {exc}") from None
    try:
        return Calibration(str(data["model"]), data["fingerprint"], data["knobs"], data.get("evidence") or {},
                           data["version"], path=str(path), budget_model=model,
                           budget_evidence=dict((budget or {}).get("evidence") or {}))
    except CalibrationError as exc:
        raise CalibrationError(f"calibration {path}: {exc}") from None


def save_calibration(calibration: Calibration, path: str | os.PathLike) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration.to_json(), indent=1) + "\n")
    return path


def calibration_path(model: str, directory: str | os.PathLike = CALIBRATION_DIR) -> pathlib.Path:
    return pathlib.Path(directory) / f"{model}.json"


def find_calibration(fingerprint: Mapping[str, Any],
                     directory: str | os.PathLike = CALIBRATION_DIR) -> Optional[Calibration]:
    """The file of ``directory`` with ``fingerprint``, or None; every file is read, so a broken one is found anyway."""
    found = [c for c in (load_calibration(p) for p in sorted(pathlib.Path(directory).glob("*.json")))
             if c.matches(fingerprint)]
    if len(found) > 1:
        raise CalibrationError(f"calibrations {' and '.join(str(c.path) for c in found)} are for the same model")
    return found[0] if found else None


def served_calibration(hf_config: Mapping[str, Any], override: Optional[str] = None,
                       directory: str | os.PathLike = CALIBRATION_DIR) -> Optional[Calibration]:
    """``override`` (a path, or ``none``: the defaults), else the repository's file for ``hf_config``'s model;
    CalibrationError for another model's file."""
    fingerprint = config_fingerprint(hf_config)
    if override is not None and override.strip().lower() == NO_CALIBRATION:
        return None
    if override:
        calibration = load_calibration(override)
        if not calibration.matches(fingerprint):
            raise CalibrationError(f"calibration {override} is for model {calibration.model} "
                                   f"{calibration.fingerprint}, not the served model {fingerprint}")
        return calibration
    return find_calibration(fingerprint, directory)


def calibration_for_model(model_dir: str | os.PathLike, override: Optional[str] = None,
                          directory: str | os.PathLike = CALIBRATION_DIR) -> Optional[Calibration]:
    """:func:`served_calibration` of a model folder (its ``config.json``); None: no calibration."""
    return served_calibration(_model_config(model_dir), override, directory)


def base_config(calibration: Optional[Calibration]) -> RepairConfig:
    return calibration.base_config() if calibration is not None else RepairConfig()
