"""The served model's repair calibration in the scheduler: chosen once at startup, read by every repair.

:func:`load_served_calibration` (called by the tree cache factory) picks the calibration
(:mod:`relaxkv_sglang.core.calibration`: ``RELAXKV_CALIBRATION``, else the repository's file for
the model's fingerprint, else none), logs one line saying which, and keeps it on the tree cache.
An unusable file (malformed, another version, an unknown knob, another model's fingerprint) stops
the server with one line. Every repair's ``RepairConfig`` starts from :func:`repair_base` (the
request's own ratios override it, ``repair.request_repair_config``); ``/get_server_info`` shows
:func:`calibration_state` as ``relaxkv.calibration``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from typing import Any, Optional

from relaxkv_sglang.core.calibration import (CALIBRATION_ENV, DEFAULTS_NOTE, Calibration, CalibrationError,
                                             served_calibration)
from relaxkv_sglang.core.repair_config import RepairConfig

logger = logging.getLogger(__name__)

_CALIBRATION_ATTR = "relaxkv_calibration"  # on the tree cache: the ServedCalibration


@dataclasses.dataclass(frozen=True)
class ServedCalibration:
    """The calibration a server runs with.

    Attributes:
        model: the served model's name (its path's last part).
        calibration: the calibration, or None (the code defaults).
        base: the RepairConfig every repair starts from.
    """

    model: str
    calibration: Optional[Calibration]
    base: RepairConfig

    def line(self) -> str:
        """The startup log's line."""
        if self.calibration is None:
            return f"relaxkv: no calibration for {self.model}; {DEFAULTS_NOTE}"
        return f"relaxkv: calibration {self.calibration.describe()}"

    def state(self) -> dict[str, Any]:
        """``relaxkv.calibration`` of /get_server_info: ``file`` None and ``knobs`` {} without one."""
        if self.calibration is None:
            return {"file": None, "model": self.model, "version": None, "knobs": {}, "note": DEFAULTS_NOTE}
        return {**self.calibration.state(), "model": self.model}


def load_served_calibration(cache: Any, model_path: str, hf_config: dict, *, log: bool = True) -> ServedCalibration:
    """Choose the served model's calibration (module doc), keep it on ``cache`` and log it (``log``:
    this rank logs); SystemExit with one line for an unusable file."""
    try:
        calibration = served_calibration(hf_config, os.environ.get(CALIBRATION_ENV) or None)
    except CalibrationError as exc:
        raise SystemExit(f"relaxkv-sglang: {exc} ({CALIBRATION_ENV} or relaxkv_sglang/calibrations/)") from None
    base = calibration.base_config() if calibration is not None else RepairConfig()
    served = ServedCalibration(pathlib.Path(str(model_path).rstrip("/")).name, calibration, base)
    setattr(cache, _CALIBRATION_ATTR, served)
    if log:
        logger.info(served.line())
    return served


def repair_base(cache: Any) -> RepairConfig:
    """The RepairConfig the server's repairs start from (the defaults before a calibration is loaded)."""
    served = getattr(cache, _CALIBRATION_ATTR, None)
    return served.base if served is not None else RepairConfig()


def calibration_state(cache: Any) -> Optional[dict]:
    """What /get_server_info shows (None before the calibration was chosen)."""
    served = getattr(cache, _CALIBRATION_ATTR, None)
    return None if served is None else served.state()
