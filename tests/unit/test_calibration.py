"""Per-model repair calibrations: the file, its lookup by fingerprint, the server's use of it."""

from __future__ import annotations

import dataclasses
import json
import logging
import types

import pytest

from relaxkv_sglang import assets
from relaxkv_sglang.runtime.settings import CALIBRATION_ENV, ServerSettings
from relaxkv_sglang.repair.calibration import (CALIBRATION_DIR, FORMAT_VERSION, Calibration, CalibrationError,
                                             base_config, calibration_for_model, changed_knobs, config_fingerprint,
                                             find_calibration, load_calibration, model_fingerprint, rope_parameters,
                                             save_calibration, served_calibration)
from relaxkv_sglang.repair.repair_config import RepairConfig

HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 128,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048, "rope_theta": 1e4}
FINGERPRINT = config_fingerprint(HF_CONFIG)
OTHER = config_fingerprint({**HF_CONFIG, "num_hidden_layers": 24})


def _calibration(**knobs) -> Calibration:
    return Calibration("tiny", FINGERPRINT, knobs or {"stale_shift_scale": 1.0, "layer_value": "uniform"},
                       {"command": "python -m scripts.calibrate ..."})


def _model_dir(tmp_path, config=HF_CONFIG):
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_fingerprint_keeps_the_shape_and_defaults_kv_heads():
    assert FINGERPRINT == {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 128,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
                           "rope": {"rope_theta": 1e4, "rope_type": "default"}}
    no_kv = {k: v for k, v in HF_CONFIG.items() if k != "num_key_value_heads"}
    assert config_fingerprint(no_kv)["num_key_value_heads"] == 4
    nested = {"architectures": ["X"], "text_config": {k: v for k, v in HF_CONFIG.items() if k != "architectures"}}
    assert config_fingerprint(nested) == {**FINGERPRINT, "architectures": ["X"]}


def test_fingerprint_rope_is_one_form_and_tells_rope_settings_apart():
    # the same model written by older transformers (rope_theta, rope_scaling with "type") and newer
    # (rope_parameters) has one fingerprint; another RoPE base or scaling is another model
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024}
    old = {**HF_CONFIG, "rope_theta": 5e5, "rope_scaling": scaling}
    new = {k: v for k, v in HF_CONFIG.items() if k != "rope_theta"}
    new["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 1024, "rope_theta": 500000}
    assert config_fingerprint(old) == config_fingerprint(new)
    assert config_fingerprint(old) != FINGERPRINT
    assert config_fingerprint({**HF_CONFIG, "rope_theta": 1e6}) != FINGERPRINT
    assert rope_parameters({}) == {"rope_type": "default"}
    # SGLang's loaded config adds the legacy "type" beside "rope_type"
    assert rope_parameters({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default", "type": "default"}}) == \
        {"rope_theta": 1e6, "rope_type": "default"}


def test_prepared_models_of_one_shape_but_other_rope_differ():
    llama, llama3 = (model_fingerprint(assets.model_path(name)) for name in ("tiny-llama", "tiny-llama3"))
    assert {k: v for k, v in llama.items() if k != "rope"} == {k: v for k, v in llama3.items() if k != "rope"}
    assert llama["rope"] != llama3["rope"]


def test_save_load_round_trip_and_base_config(tmp_path):
    path = save_calibration(_calibration(), tmp_path / "tiny.json")
    loaded = load_calibration(path)
    assert loaded == _calibration() and loaded.path == str(path)
    assert json.loads(path.read_text())["version"] == FORMAT_VERSION
    config = loaded.base_config()
    assert config.relaxkv.stale_shift_scale == 1.0 and config.relaxkv.layer_value == "uniform"
    assert config.context_ratio == RepairConfig().context_ratio  # a knob not calibrated keeps its default
    assert base_config(None) == RepairConfig()
    assert "stale_shift_scale=1.0" in loaded.describe() and str(path) in loaded.describe()


def test_changed_knobs_drops_the_defaults():
    assert changed_knobs({"stale_shift_scale": 0.5, "layer_value": "uniform", "context_ratio": 0.5}) == \
        {"layer_value": "uniform"}


@pytest.mark.parametrize("change,message", [
    ({"version": 1}, "format version 1"),
    ({"knobs": {"stale_shfit_scale": 1.0}}, "unknown repair knob 'stale_shfit_scale'"),
    ({"knobs": {"anchor_ratio": 0.3}}, "per-request setting"),
    ({"knobs": {"stale_shift_scale": "1.0"}}, "is not a float"),
    ({"knobs": {"chunk_sink_tokens": 2.5}}, "is not a int"),
    ({"knobs": {"stale_shift_scale": 2.0}}, "stale_shift_scale must be in [0, 1]"),
    ({"fingerprint": {"architectures": ["X"]}}, "fingerprint must have exactly"),
    ({"extra": 1}, "expected the fields"),
])
def test_a_bad_file_is_one_line_naming_it(tmp_path, change, message):
    data = {**_calibration().to_json(), **change}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError) as info:
        load_calibration(path)
    assert message in str(info.value) and str(path) in str(info.value) and "\n" not in str(info.value)


def test_lookup_by_fingerprint_override_and_none(tmp_path):
    repo = tmp_path / "calibrations"
    save_calibration(_calibration(), repo / "tiny.json")
    save_calibration(Calibration("big", OTHER, {"context_ratio": 0.25}), repo / "big.json")
    assert find_calibration(FINGERPRINT, repo).model == "tiny"
    assert find_calibration(OTHER, repo).knobs == {"context_ratio": 0.25}
    assert find_calibration(config_fingerprint({**HF_CONFIG, "vocab_size": 7}), repo) is None
    model = _model_dir(tmp_path)
    assert calibration_for_model(model, directory=repo).model == "tiny"  # found from the folder's config.json
    assert calibration_for_model(model, "none", directory=repo) is None
    assert served_calibration(HF_CONFIG, str(repo / "tiny.json"), repo).knobs["layer_value"] == "uniform"
    with pytest.raises(CalibrationError, match="is for model big .* not the served model"):
        served_calibration(HF_CONFIG, str(repo / "big.json"), repo)
    save_calibration(Calibration("tiny-copy", FINGERPRINT, {}), repo / "tiny-copy.json")
    with pytest.raises(CalibrationError, match="are for the same model"):
        find_calibration(FINGERPRINT, repo)


def test_the_repository_files_are_valid_and_distinct():
    from relaxkv_sglang.repair.calibration import CALIBRATION_DIR

    found = {}
    for path in sorted(CALIBRATION_DIR.glob("*.json")):
        calibration = load_calibration(path)
        assert path.stem == calibration.model
        key = json.dumps(calibration.fingerprint, sort_keys=True)
        assert key not in found, f"{path} and {found.get(key)} are for the same model"
        found[key] = path


# ------------------------------------------------------------------ the server


def _rows(**ratios) -> types.SimpleNamespace:
    from relaxkv_sglang.request.plan import RequestPlan

    return types.SimpleNamespace(fold=types.SimpleNamespace(plan=RequestPlan("relaxkv", ((2, 6),), None, **ratios)))


def test_repair_config_starts_from_the_calibrated_base_and_the_request_overrides():
    from relaxkv_sglang.forward.repair_stage import request_repair_config

    base = RepairConfig.from_knobs(context_ratio=0.25, stale_shift_scale=1.0, layer_value="uniform")
    config = request_repair_config(_rows(), base)
    assert config.context_ratio == 0.25 and config.relaxkv.stale_shift_scale == 1.0
    assert config.anchor_ratio == RepairConfig().anchor_ratio and config.budget is None
    config = request_repair_config(_rows(anchor_ratio=0.3, context_ratio=0.75, budget=0.2), base)
    assert (config.anchor_ratio, config.context_ratio, config.budget) == (0.3, 0.75, None)  # budget: forward/budget.py
    assert config.relaxkv.layer_value == "uniform"  # what a request cannot set stays calibrated
    assert request_repair_config(_rows(), RepairConfig()) == RepairConfig()


def _settings(**env: str) -> ServerSettings:
    return ServerSettings.from_env(env)


def test_the_server_loads_logs_and_shows_its_calibration(tmp_path, caplog):
    from relaxkv_sglang.repair.sglang.served_calibration import load_served_calibration

    with caplog.at_level(logging.INFO, logger="relaxkv_sglang.repair.sglang.served_calibration"):
        served = load_served_calibration("/models/tiny-llama/", HF_CONFIG, _settings())
    assert "relaxkv: no calibration for tiny-llama; repair knobs are the defaults (tuned on SmolLM2-135M)" in caplog.text
    assert served.base == RepairConfig() and served.state()["file"] is None and served.state()["knobs"] == {}

    path = save_calibration(_calibration(context_ratio=0.25), tmp_path / "tiny.json")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="relaxkv_sglang.repair.sglang.served_calibration"):
        served = load_served_calibration("/models/tiny-llama", HF_CONFIG, _settings(RELAXKV_CALIBRATION=str(path)))
    assert f"relaxkv: calibration {path} (knobs: context_ratio=0.25); no auto budget model" in caplog.text
    assert served.base.context_ratio == 0.25
    assert served.state() == {"file": str(path), "model": "tiny-llama", "version": FORMAT_VERSION,
                              "knobs": {"context_ratio": 0.25}, "budget_prices": None,
                              "default_budget": None, "quality": "medium"}

    with pytest.raises(SystemExit, match="relaxkv-sglang: calibration .* is for model tiny"):
        load_served_calibration("/models/big", {**HF_CONFIG, "num_hidden_layers": 24},
                                _settings(RELAXKV_CALIBRATION=str(path)))


def test_serve_checks_the_calibration_before_starting(tmp_path):
    from relaxkv_sglang.cli import calibration_env
    from relaxkv_sglang.server.launch import ServerError

    model = _model_dir(tmp_path)
    path = save_calibration(_calibration(), tmp_path / "tiny.json")
    assert calibration_env(types.SimpleNamespace(calibration=str(path)), str(model)) == {CALIBRATION_ENV: str(path)}
    assert calibration_env(types.SimpleNamespace(calibration="none"), str(model)) == {CALIBRATION_ENV: "none"}
    assert calibration_env(types.SimpleNamespace(calibration=None), str(model)) == {}
    (tmp_path / "other").mkdir()
    other = _model_dir(tmp_path / "other", {**HF_CONFIG, "vocab_size": 9})
    with pytest.raises(ServerError, match="--calibration: calibration .* not the served model"):
        calibration_env(types.SimpleNamespace(calibration=str(path)), str(other))


def test_bench_line_names_the_calibration():
    from benchmarks.common import calibration_line

    assert calibration_line(None).startswith("calibration unknown")
    assert calibration_line({"file": None, "model": "m", "knobs": {}}) == \
        "no calibration for m: the default repair knobs"
    assert calibration_line({"file": "/c/m.json", "model": "m", "knobs": {"context_ratio": 0.25}}) == \
        "calibration /c/m.json (context_ratio=0.25)"


def test_the_repository_files_load_and_match_their_prepared_models():
    # a format or fingerprint change must come with the files rewritten, or the server would refuse them
    files = sorted(CALIBRATION_DIR.glob("*.json"))
    assert files, "the repository carries at least Qwen2.5-0.5B's calibration"
    for path in files:
        calibration = load_calibration(path)
        assert calibration.model == path.stem and calibration.model in assets.MODELS
        folder = assets.cache_root() / "models" / calibration.model
        if (folder / "config.json").exists():  # optional models (Qwen) may be unprepared
            assert calibration.matches(model_fingerprint(folder)), path


def test_a_budget_model_travels_in_the_calibration_file_and_sets_the_server_budget(tmp_path, caplog):
    from relaxkv_sglang.repair.auto_budget import BudgetModel
    from relaxkv_sglang.repair.sglang.served_calibration import load_served_calibration

    model = BudgetModel(("one", "log_ratio"), (-5.0, -1.0), prices={"low": 1.0, "medium": 0.3, "high": 0.05})
    with_budget = dataclasses.replace(_calibration(context_ratio=0.25), budget_model=model,
                                      budget_evidence={"prompts": 96})
    path = save_calibration(with_budget, tmp_path / "tiny.json")
    loaded = load_calibration(path)
    assert loaded.budget_model == model and loaded.budget_evidence == {"prompts": 96}
    assert json.loads(path.read_text())["budget_model"]["evidence"] == {"prompts": 96}

    auto = _settings(RELAXKV_CALIBRATION=str(path), RELAXKV_DEFAULT_BUDGET="auto", RELAXKV_QUALITY="High")
    with caplog.at_level(logging.INFO, logger="relaxkv_sglang.repair.sglang.served_calibration"):
        served = load_served_calibration("/models/tiny-llama", HF_CONFIG, auto)
    assert "auto budget calibrated; default budget auto, quality high" in caplog.text
    assert (served.default_budget, served.quality, served.budget_model) == ("auto", "high", model)
    assert served.state()["budget_prices"] == {"low": 1.0, "medium": 0.3, "high": 0.05}

    broken = json.loads(path.read_text())
    broken["budget_model"]["features"] = ["one", "moon_phase"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(CalibrationError, match="broken.json: unknown budget features"):
        load_calibration(tmp_path / "broken.json")

    plain = save_calibration(_calibration(), tmp_path / "plain.json")
    with pytest.raises(SystemExit, match="RELAXKV_DEFAULT_BUDGET=auto needs a budget model"):
        load_served_calibration("/models/tiny-llama", HF_CONFIG,
                                _settings(RELAXKV_CALIBRATION=str(plain), RELAXKV_DEFAULT_BUDGET="auto"))
    with pytest.raises(SystemExit, match="RELAXKV_DEFAULT_BUDGET='lots'"):
        _settings(RELAXKV_DEFAULT_BUDGET="lots")
    with pytest.raises(SystemExit, match="RELAXKV_QUALITY='best'"):
        _settings(RELAXKV_DEFAULT_BUDGET="0.2", RELAXKV_QUALITY="best")
