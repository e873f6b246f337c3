"""A server with a repair calibration (``RELAXKV_CALIBRATION``): it says so, shows it, and repairs with it."""

from __future__ import annotations

import pathlib
import tempfile

import pytest
from conftest import relaxkv_server_config, start_server
from rag_helpers import documents, flush, generate, marked_prompt

from relaxkv_sglang.client import ServerClient
from relaxkv_sglang.repair.auto_budget import RATIO_LADDER, BudgetModel
from relaxkv_sglang.repair.calibration import FORMAT_VERSION, Calibration, model_fingerprint, save_calibration
from relaxkv_sglang.runtime.settings import CALIBRATION_ENV, DEFAULT_BUDGET_ENV

pytestmark = pytest.mark.e2e

KNOBS = {"context_ratio": 0.25, "stale_shift": "none"}


# A hand-set budget model (the law's shape as fitted on SmolLM2; the tiny model's KL is not
# measured): KL(r) = e^-3 uncovered(r) / r, and prices that buy ~10-15% (low) to 30% (high).
PRICES = {"low": 3.0, "medium": 0.3, "high": 0.01}
BUDGET_MODEL = BudgetModel(("one", "log_ratio", "log_uncovered"), (-3.0, -1.0, 1.0), prices=PRICES)


def calibrated_config(model_path: str):
    """The session's plugin server, with a calibration of the tiny model that changes two knobs and
    carries a budget model, and ``auto`` as the default budget of repair requests without a ratio."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="relaxkv-calibration-"))
    path = save_calibration(Calibration("tiny-llama", model_fingerprint(model_path), dict(KNOBS),
                                        budget_model=BUDGET_MODEL), folder / "tiny-llama.json")
    config = relaxkv_server_config(model_path)
    config.env = {**config.env, CALIBRATION_ENV: str(path), DEFAULT_BUDGET_ENV: "auto"}
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
    assert shown == {"file": path, "model": "tiny-llama", "version": FORMAT_VERSION, "knobs": KNOBS,
                     "budget_prices": PRICES, "default_budget": "auto", "quality": "medium"}
    assert (f"relaxkv: calibration {path} (knobs: context_ratio=0.25, stale_shift=none); auto budget calibrated; "
            "default budget auto, quality medium") in pathlib.Path(calibrated_server.log_path).read_text()
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


def _auto(url: str, prompt, **fields) -> tuple[list[int], list[float], dict]:
    out = generate(url, prompt, policy="relaxkv", max_new_tokens=4, return_logprob=True, **fields)
    return (out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]],
            out["meta_info"]["relaxkv"])


def test_auto_budget_chooses_per_request_reports_why_and_the_cache_does_not_change_it(calibrated_server,
                                                                                     relaxkv_server):
    url = calibrated_server.url
    docs = documents(3, seed=43)
    prompt = marked_prompt("Answer from the documents.", docs, "Question: which?")
    flush(url)
    cold_ids, cold_lp, cold = _auto(url, prompt)  # no ratio, no budget: the server's default, auto
    assert cold["budget"] == "auto" and cold["repaired"] and cold["chunks_hit"] == 0
    choice = cold["budget_choice"]
    assert choice["quality"] == "medium" and choice["anchor_ratio"] in RATIO_LADDER and "fallback" not in choice
    assert choice["price"] == PRICES["medium"] and choice["predicted_kl"] > 0
    assert cold["anchor_ratio"] == pytest.approx(choice["anchor_ratio"], abs=0.02)  # what was chosen is what ran
    signal = cold["budget_signal"]
    assert signal["n_chunks"] == 3 and 0 < signal["chunk_share"] <= 1
    assert signal["answer_entropy"] > 0 and 0 < signal["answer_top1"] <= 1 and 0 <= signal["answer_tail"] < 1
    assert signal["uncovered"] == sorted(signal["uncovered"], reverse=True)
    # the same request on warm chunks: the same signal, the same choice, the same answer
    warm_ids, warm_lp, warm = _auto(url, prompt)
    assert warm["chunks_hit"] == 3
    assert warm["budget_choice"] == choice and warm["budget_signal"] == signal
    assert warm_ids == cold_ids and warm_lp == pytest.approx(cold_lp, abs=1e-5)
    # the quality sets the price: more quality never buys fewer anchors
    ratios = [_auto(url, prompt, budget="auto", quality=q)[2]["budget_choice"]["anchor_ratio"]
              for q in ("low", "medium", "high")]
    assert ratios == sorted(ratios) and ratios[0] < ratios[-1]
    # an explicit ratio wins over the server's default budget; a bad quality is the client's error
    assert _auto(url, prompt, anchor_ratio=0.2)[2]["budget"] is None
    with pytest.raises(RuntimeError, match="HTTP 400.*invalid relaxkv_quality"):
        _auto(url, prompt, budget="auto", quality="best")
    # a server whose calibration has no budget model serves auto at the ratio it would have had, and says so
    fallback = _auto(relaxkv_server.url, prompt, budget="auto")[2]
    assert fallback["budget_choice"]["fallback"].startswith("no budget model in tiny-llama's calibration")
    assert fallback["anchor_ratio"] == pytest.approx(0.15, abs=0.02) and "budget_signal" in fallback


def test_sglang_loaded_configs_find_the_repository_files():
    # the server fingerprints SGLang's loaded config (tree_cache: ModelConfig.hf_config), which adds
    # keys the folder's config.json lacks (rope_parameters.type): each prepared model must find its
    # own repository file, and a model without one none
    from sglang.srt.configs.model_config import ModelConfig

    from relaxkv_sglang import assets
    from relaxkv_sglang.repair.calibration import CALIBRATION_DIR, served_calibration

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
