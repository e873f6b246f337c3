"""The auto budget's fit from a development frontier (scripts/calibrate_budget.py) and the analysis of
bench_auto_budget, on synthetic rows (no server)."""

from __future__ import annotations

import argparse
import json
import math
import random

import pytest

from benchmarks import bench_auto_budget
from relaxkv_sglang.repair.auto_budget import RATIO_LADDER
from scripts import calibrate_budget

N_LAYERS, PAIR_COST = 30, 1e-3


def _signal(level: float) -> dict:
    return {"n_chunks": 3, "n_eligible": 400, "chunk_share": level, "uncovered": [1 - r for r in RATIO_LADDER],
            "markup_lift": 0.0, "opening_lift": 1.0}


def _kl(level: float, ratio: float) -> float:
    return math.exp(-6.0 + 4.0 * level - 1.5 * math.log(ratio))


def _frontier(path, examples: int, split: str = "dev", seed: int = 0) -> str:
    """A bench_frontier file: relaxkv at every ladder ratio; the signal on the 15% rows only (as a
    run of today's server reports it on every relaxkv row, an older one on none)."""
    rng = random.Random(seed)
    rows = []
    for e in range(examples):
        level = rng.choice([0.0, 0.2, 1.0])
        for fmt in ("plain", "tagged"):
            for r in RATIO_LADDER:
                report = {"budget_signal": _signal(level)} if r == 0.15 else {}
                rows.append({"task": "squad", "example_id": str(e), "format": fmt, "policy": "relaxkv",
                             "anchor_ratio": r, "kl_first_token": _kl(level, r), "relaxkv": report})
    path.write_text(json.dumps({"bench": "bench_frontier", "split": {"name": split}, "per_example": rows}))
    return str(path)


def test_the_fit_chooses_features_that_meet_the_target_with_fewer_anchors(tmp_path):
    prompts = calibrate_budget.load_prompts([_frontier(tmp_path / "dev.json", 12)])
    assert len(prompts) == 24 and all(set(p.curve.kl) == set(RATIO_LADDER) for p in prompts)
    best, scores = calibrate_budget.choose_features(
        prompts, {"ratio": ("one", "log_ratio"), "level": ("one", "log_ratio", "chunk_share")})
    assert best == "level"  # the signal that carries the difficulty wins
    medium = scores["level"]["medium"]
    assert medium["kl"] <= medium["target_kl"] and medium["ratio"] < 0.15
    # without the signal every prompt gets one ratio, so the same target costs more
    assert scores["ratio"]["medium"]["ratio"] >= medium["ratio"]


def test_the_fit_refuses_a_test_split_and_other_benches(tmp_path):
    with pytest.raises(ValueError, match="fitted on dev only"):
        calibrate_budget.load_prompts([_frontier(tmp_path / "test.json", 3, split="test")])
    (tmp_path / "other.json").write_text(json.dumps({"bench": "bench_quality", "per_example": []}))
    with pytest.raises(ValueError, match="not a bench_frontier result"):
        calibrate_budget.load_prompts([tmp_path / "other.json"])


def _row(policy, config, example, fmt, *, kl, ttft, per_layer=None, pairs=None, chosen=None):
    report = {} if per_layer is None else {"anchors_per_layer": per_layer, "repair_kv_pairs": pairs}
    if chosen is not None:
        report["budget_choice"] = {"anchor_ratio": chosen}
    return {"task": "squad", "example_id": str(example), "format": fmt, "policy": policy, "anchor_ratio": config,
            "kl_first_token": kl, "ttft_s": ttft, "relaxkv": report}


def test_the_analysis_pairs_auto_with_the_reference_in_kl_and_cost():
    args = argparse.Namespace(formats=["plain", "tagged"], reference_ratio=0.15, peers=["prophetkv"],
                              qualities=["medium"])
    rows = []
    for e in range(4):
        for fmt in args.formats:
            hard = fmt == "tagged"
            rows += [_row("pic", None, e, fmt, kl=1.0, ttft=0.2),
                     _row("relaxkv", 0.15, e, fmt, kl=0.05, ttft=0.8, per_layer=15.0, pairs=1000),
                     _row("prophetkv", 0.15, e, fmt, kl=0.2, ttft=0.8, per_layer=15.0, pairs=3000),
                     _row("relaxkv", "auto:medium", e, fmt, kl=0.04 if hard else 0.06, ttft=0.9 if hard else 0.4,
                          per_layer=20.0 if hard else 4.0, pairs=1200 if hard else 300, chosen=0.2 if hard else 0.04)]
    result = bench_auto_budget.analyse(rows, args, N_LAYERS, PAIR_COST)
    pooled = {(s["policy"], s["config"]): s for s in result["summary"] if s["format"] == "all"}
    assert pooled[("relaxkv", "auto:medium")]["chosen_ratio"] == pytest.approx(0.12)
    assert pooled[("relaxkv", "auto:medium")]["kl"] == pytest.approx(0.05)
    versus = {(v["format"], v["versus"]): v for v in result["versus"]}
    ref = versus[("all", "relaxkv@15%")]
    assert ref["diff"] == pytest.approx(0.0) and ref["n_examples"] == 4
    ref_work = 15 * N_LAYERS + PAIR_COST * 1000
    auto_work = (20 * N_LAYERS + PAIR_COST * 1200 + 4 * N_LAYERS + PAIR_COST * 300) / 2
    assert ref["work_ratio"] == pytest.approx(auto_work / ref_work)
    assert ref["work_ratio_ci95"][0] <= ref["work_ratio"] <= ref["work_ratio_ci95"][1]
    assert ref["extra_ttft_ratio"] == pytest.approx(0.45 / 0.6)  # medians: auto's +0.7 s and +0.2 s halves, 0.6 s
    plain_peer = versus[("plain", "prophetkv@15%")]
    assert plain_peer["diff"] == pytest.approx(0.06 - 0.2) and plain_peer["wins"] == 4
    assert "work_ratio" not in plain_peer



def test_calibrate_writes_the_budget_beside_the_knobs_it_keeps(tmp_path, capsys):
    from relaxkv_sglang.repair.calibration import Calibration, load_calibration, model_fingerprint, save_calibration

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "rope_theta": 1e4}))
    path = save_calibration(Calibration("tiny", model_fingerprint(model_dir), {"stale_shift_scale": 1.0}),
                            tmp_path / "tiny.json")
    frontier = _frontier(tmp_path / "dev.json", 8)
    written = calibrate_budget.calibrate("tiny", model_dir, [frontier], path, "python -m scripts.calibrate ...",
                                         {"split": "dev"})
    loaded = load_calibration(path)
    assert loaded.knobs == {"stale_shift_scale": 1.0} and loaded.budget_model == written.budget_model
    assert set(loaded.budget_model.prices) == {"low", "medium", "high"}
    assert loaded.budget_evidence["sources"] == [frontier] and loaded.budget_evidence["prompts"] == 16
    assert "written to" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="at least 3 examples"):
        calibrate_budget.calibrate("tiny", model_dir, [_frontier(tmp_path / "small.json", 2)], path, "", {})


def test_the_run_stops_before_any_request_without_a_budget_model():
    with pytest.raises(RuntimeError, match="no budget model"):
        bench_auto_budget.require_budget_model({"file": None, "budget_prices": None})
    with pytest.raises(RuntimeError, match="no budget model"):
        bench_auto_budget.require_budget_model(None)
    bench_auto_budget.require_budget_model({"budget_prices": {"low": 1.0, "medium": 0.5, "high": 0.1}})
