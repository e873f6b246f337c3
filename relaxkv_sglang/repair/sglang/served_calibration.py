"""The served model's repair calibration and ``auto`` budget settings in the scheduler: chosen once at startup and
handed to the repair stage in its services (:mod:`.services`)."""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Any, Optional

from relaxkv_sglang.repair.calibration import DEFAULTS_NOTE, Calibration, CalibrationError, served_calibration
from relaxkv_sglang.repair.auto_budget import BudgetModel
from relaxkv_sglang.runtime.quality import AUTO, DEFAULT_QUALITY
from relaxkv_sglang.repair.repair_config import RepairConfig
from relaxkv_sglang.runtime.settings import CALIBRATION_ENV, DEFAULT_BUDGET_ENV, ServerSettings

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServedCalibration:
    """The calibration a server runs with (``calibration`` None: the code defaults; ``base``: what every repair starts
    from) and its ``default_budget`` (``"auto"``, a cost share, None) and ``quality``."""

    model: str
    calibration: Optional[Calibration]
    base: RepairConfig
    default_budget: float | str | None = None
    quality: str | float = DEFAULT_QUALITY

    @property
    def budget_model(self) -> Optional[BudgetModel]:
        """The auto budget's model (None: the calibration has none)."""
        return self.calibration.budget_model if self.calibration is not None else None

    def line(self) -> str:
        """The startup log's line."""
        budget = (f"; default budget {self.default_budget}, quality {self.quality}"
                  if self.default_budget is not None else "")
        if self.calibration is None:
            return f"relaxkv: no calibration for {self.model}; {DEFAULTS_NOTE}{budget}"
        auto = "auto budget calibrated" if self.budget_model is not None else "no auto budget model"
        return f"relaxkv: calibration {self.calibration.describe()}; {auto}{budget}"

    def state(self) -> dict[str, Any]:
        """``relaxkv.calibration`` of /get_server_info: ``file`` None and ``knobs`` {} without one."""
        budget = {"default_budget": self.default_budget, "quality": self.quality}
        if self.calibration is None:
            return {"file": None, "model": self.model, "version": None, "knobs": {}, "budget_prices": None,
                    "note": DEFAULTS_NOTE, **budget}
        return {**self.calibration.state(), "model": self.model, **budget}


def load_served_calibration(model_path: str, hf_config: dict, settings: ServerSettings, *,
                            log: bool = True) -> ServedCalibration:
    """Choose the calibration (``RELAXKV_CALIBRATION``, else the repository's file for the model's fingerprint, else
    none) and log it (``log``: this rank); SystemExit with one line for an unusable file."""
    try:
        calibration = served_calibration(hf_config, settings.calibration)
    except CalibrationError as exc:
        raise SystemExit(f"relaxkv-sglang: {exc} ({CALIBRATION_ENV} or relaxkv_sglang/calibrations/)") from None
    base = calibration.base_config() if calibration is not None else RepairConfig()
    served = ServedCalibration(pathlib.Path(str(model_path).rstrip("/")).name, calibration, base,
                               settings.default_budget, settings.quality)
    if served.default_budget == AUTO and served.budget_model is None:
        raise SystemExit(f"relaxkv-sglang: {DEFAULT_BUDGET_ENV}=auto needs a budget model in {served.model}'s "
                         f"calibration (python -m scripts.calibrate --budget ...); "
                         f"{'it has none' if calibration else 'there is no calibration'}")
    if log:
        logger.info(served.line())
    return served
