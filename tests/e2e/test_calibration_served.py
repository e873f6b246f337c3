"""A server with a repair calibration (``RELAXKV_CALIBRATION``): it says so, shows it, and repairs with it."""

from __future__ import annotations

import pathlib
import tempfile

import pytest
from conftest import relaxkv_server_config, start_server
from rag_helpers import documents, flush, generate, marked_prompt

from relaxkv_sglang.client import ServerClient
from relaxkv_sglang.core.calibration import (CALIBRATION_ENV, FORMAT_VERSION, Calibration, model_fingerprint,
                                             save_calibration)

pytestmark = pytest.mark.e2e

KNOBS = {"context_ratio": 0.25, "stale_shift": "none"}


def calibrated_config(model_path: str):
    """The session's plugin server, with a calibration of the tiny model that changes two knobs."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="relaxkv-calibration-"))
    path = save_calibration(Calibration("tiny-llama", model_fingerprint(model_path), dict(KNOBS)),
                            folder / "tiny-llama.json")
    config = relaxkv_server_config(model_path)
    config.env = {**config.env, CALIBRATION_ENV: str(path)}
    return config


PRESTART_SERVERS = {"calibrated_server": start_server(calibrated_config)}


@pytest.fixture(scope="module")
def calibrated_server(tiny_model_path, prestart):
    with prestart.serving("calibrated_server", lambda: PRESTART_SERVERS["calibrated_server"](tiny_model_path)) as srv:
        yield srv


def _repair(url: str, docs: list[str], **ratios) -> tuple[list[float], dict]:
    """A relaxkv request on warm chunks (cached by a first request in another order): (its output
    logprobs, its report)."""
    flush(url)
    generate(url, marked_prompt("You are a helpful assistant.", docs[::-1], "Question: first?"), policy="pic")
    prompt = marked_prompt("Answer from the documents.", docs, "Question: which?")
    out = generate(url, prompt, policy="relaxkv", max_new_tokens=4, return_logprob=True,
                   anchor_ratio=0.15, **ratios)
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], out["meta_info"]["relaxkv"]


def test_the_server_reports_its_calibration_and_repairs_with_it(calibrated_server, relaxkv_server):
    shown = ServerClient(calibrated_server.url).calibration()
    path = calibrated_server.config.env[CALIBRATION_ENV]
    assert shown == {"file": path, "model": "tiny-llama", "version": FORMAT_VERSION, "knobs": KNOBS}
    assert f"relaxkv: calibration {path} (knobs: context_ratio=0.25, stale_shift=none)" in \
        pathlib.Path(calibrated_server.log_path).read_text()
    default = ServerClient(relaxkv_server.url).calibration()
    assert default["file"] is None and default["knobs"] == {}
    assert "relaxkv: no calibration for tiny-llama; repair knobs are the defaults" in \
        pathlib.Path(relaxkv_server.log_path).read_text()

    docs = documents(3, seed=41)
    # no context ratio in the request: the calibrated 0.25 attends to fewer pairs than the default 0.5
    _, calibrated = _repair(calibrated_server.url, docs)
    _, uncalibrated = _repair(relaxkv_server.url, docs)
    assert calibrated["repaired"] and uncalibrated["repaired"]
    assert calibrated["repair_kv_pairs"] < uncalibrated["repair_kv_pairs"]
    # the request's own ratio wins (same anchors, same pairs), but the stale shift is the calibration's
    lp_calibrated, calibrated = _repair(calibrated_server.url, docs, context_ratio=0.5)
    lp_default, uncalibrated = _repair(relaxkv_server.url, docs, context_ratio=0.5)
    for key in ("anchor_ratio", "repair_kv_pairs", "repair_kv_pairs_executed"):
        assert calibrated[key] == uncalibrated[key], key
    assert lp_calibrated != pytest.approx(lp_default, abs=1e-5)


def test_sglang_loaded_configs_find_the_repository_files():
    # the server fingerprints SGLang's loaded config (tree_cache: ModelConfig.hf_config), which adds
    # keys the folder's config.json lacks (rope_parameters.type): each prepared model must find its
    # own repository file, and a model without one none
    from sglang.srt.configs.model_config import ModelConfig

    from relaxkv_sglang import assets
    from relaxkv_sglang.core.calibration import CALIBRATION_DIR, served_calibration

    calibrated = {path.stem for path in CALIBRATION_DIR.glob("*.json")}
    checked = set()
    for name in assets.MODELS:
        folder = assets.cache_root() / "models" / name
        if not (folder / "config.json").exists():
            continue  # optional models may be unprepared
        found = served_calibration(ModelConfig(str(folder)).hf_config.to_dict(), None)
        assert (found.model if found else None) == (name if name in calibrated else None), name
        checked.add(name)
    assert "tiny-llama" in checked
