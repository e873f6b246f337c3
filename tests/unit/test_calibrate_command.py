"""``python -m scripts.calibrate`` on the tiny model: the rule it keeps candidates by, and the file it writes."""

from __future__ import annotations

import json

import pytest

from relaxkv_sglang import assets
from relaxkv_sglang.repair.calibration import load_calibration, model_fingerprint


def test_calibrate_keeps_a_significant_improvement_and_writes_the_evidence(tmp_path):
    from scripts import calibrate

    out = tmp_path / "tiny-llama.json"
    # one example in two formats: two (example, format) pairs, the fewest the rule decides on
    calibrate.main(["--model", "tiny-llama", "--examples", "1", "--tasks", "niah_multivalue",
                    "--formats", "plain", "document", "--knob", "context_ratio=0.5,1.0",
                    "--knob", "stale_shift=kv,none", "--output", str(out)])
    calibration = load_calibration(out)
    steps = calibration.evidence["steps"]
    assert [s["knob"] for s in steps] == ["context_ratio", "stale_shift"]
    full_context = steps[0]["candidates"][1]
    # the whole context beats half of it on both pairs; no stale shift loses to the K/V shift on both
    assert full_context["value"] == 1.0 and full_context["kept"] and full_context["wtl"] == [2, 0, 0]
    assert full_context["diff"] < 0 and full_context["diff_ci95"][1] < 0
    no_shift = steps[1]["candidates"][1]
    assert no_shift["value"] == "none" and not no_shift["kept"] and no_shift["diff"] > 0
    assert no_shift["versus"] == "kv" and steps[1]["chosen"] == "kv"
    # the same comparison per prompt format: one pair each here, both lower
    assert set(full_context["by_format"]) == {"plain", "document"}
    assert all(part["wtl"] == [1, 0, 0] and part["diff"] < 0 for part in full_context["by_format"].values())
    assert sum(part["diff"] for part in full_context["by_format"].values()) / 2 == pytest.approx(full_context["diff"])
    assert calibration.knobs == {"context_ratio": 1.0}  # only what differs from the defaults
    assert calibration.model == "tiny-llama"
    assert calibration.fingerprint == model_fingerprint(assets.model_path("tiny-llama"))
    ev = calibration.evidence
    assert ev["split"] == "dev" and ev["pairs"] == 2 and ev["synthetic_seeds"] == [0, 0]
    assert ev["command"].startswith("python -m scripts.calibrate --model tiny-llama")
    # every candidate after the kept one is measured against it
    assert steps[1]["candidates"][0]["kl"] == pytest.approx(full_context["kl"])
    assert json.loads(out.read_text())["knobs"] == {"context_ratio": 1.0}


@pytest.mark.parametrize("argv,message", [
    (["--seed", "999", "--examples", "2"], "seeds 999-1000 leave the development split"),
    (["--offset", "3000"], "HotpotQA examples 3000-3002 leave the development split"),
    (["--knob", "anchor_ratio=0.1,0.2"], "per-request setting"),
    (["--knob", "stale_shift_scale=2"], "stale_shift_scale must be in [0, 1]"),
])
def test_calibrate_refuses_test_ranges_and_bad_knobs(argv, message, capsys):
    from scripts import calibrate

    base = ["--model", "tiny-llama", "--knob", "layer_value=ramp,uniform"]
    with pytest.raises(SystemExit):
        calibrate.main(base + argv)
    assert message in capsys.readouterr().err


def test_calibrate_writes_no_repository_file_when_nothing_is_kept(tmp_path, monkeypatch, capsys):
    from scripts import calibrate

    monkeypatch.setattr(calibrate, "calibration_path", lambda model: tmp_path / f"{model}.json")
    calibration = calibrate.main(["--model", "tiny-llama", "--examples", "1", "--tasks", "niah_multivalue",
                                  "--formats", "plain", "document", "--knob", "stale_shift=none"])
    assert calibration.knobs == {} and not (tmp_path / "tiny-llama.json").exists()
    assert "no knob differs from the defaults; nothing written" in capsys.readouterr().out
