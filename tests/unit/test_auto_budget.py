"""The auto budget's signal, model, choice and prices (repair/auto_budget.py), and its fit (scripts/calibrate_budget.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from relaxkv_sglang.repair.auto_budget import (ANSWER_TOP, RATIO_LADDER, BudgetModel, BudgetSignal, PromptCurve,
                                             answer_uncertainty, budget_signal, calibrate_prices, choose_ratios,
                                             fit_budget_model, price_curve)
from relaxkv_sglang.runtime.quality import parse_quality

SPANS = [(4, 20), (20, 36), (36, 52)]
N_CONTEXT = 52


def _scores(n_layers: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.rand(n_layers, N_CONTEXT, generator=torch.Generator().manual_seed(seed))


def test_uniform_attention_leaves_uncovered_what_the_ratio_does_not_take():
    signal = budget_signal(torch.ones(2, N_CONTEXT), SPANS, N_CONTEXT)
    n_elig = 48
    for ratio, uncovered in zip(RATIO_LADDER, signal.uncovered):
        assert uncovered == pytest.approx(1 - max(math.ceil(ratio * n_elig), 1) / n_elig, abs=1e-6)
    assert signal.chunk_share == pytest.approx(48 / 52)
    assert signal.opening_lift == pytest.approx(1.0) and signal.markup_lift == 0.0  # no ids: no markup
    assert (signal.n_chunks, signal.n_eligible) == (3, 48)


def test_concentrated_attention_is_covered_by_few_anchors():
    scores = torch.full((2, N_CONTEXT), 1e-4)
    scores[:, 30] = 10.0  # one token takes the chunks' mass
    spread = budget_signal(torch.ones(2, N_CONTEXT), SPANS, N_CONTEXT)
    peaked = budget_signal(scores, SPANS, N_CONTEXT)
    assert peaked.uncovered[0] < 0.01 < spread.uncovered[0]
    assert list(peaked.uncovered) == sorted(peaked.uncovered, reverse=True)


def test_markup_and_openings_lift_measure_their_share_of_the_chunks_mass():
    ids = torch.arange(100, 100 + N_CONTEXT)
    for s, _ in SPANS:  # every chunk opens with the same three ids: the markup
        ids[s:s + 3] = torch.tensor([7, 8, 9])
    scores = torch.ones(1, N_CONTEXT)
    for s, _ in SPANS:
        scores[0, s:s + 3] = 5.0
    signal = budget_signal(scores, SPANS, N_CONTEXT, ids)
    mass_share = 9 * 5 / (9 * 5 + 39)
    assert signal.markup_lift == pytest.approx(mass_share / (9 / 48))
    assert signal.opening_lift > 1.0


def test_a_chunk_at_position_zero_is_not_eligible():
    signal = budget_signal(_scores(), [(0, 52)], N_CONTEXT)
    assert signal.n_eligible == 0 and signal.chunk_share == 0.0


def test_the_answer_signal_is_the_query_pass_next_token_uncertainty():
    certain = torch.full((1000,), -20.0)
    certain[3] = 20.0
    entropy, top1, tail = answer_uncertainty(certain)
    assert entropy < 1e-6 and top1 == pytest.approx(1.0) and tail == pytest.approx(0.0, abs=1e-6)
    entropy, top1, tail = answer_uncertainty(torch.zeros(1000))  # uniform
    assert entropy == pytest.approx(math.log(1000), rel=1e-5) and top1 == pytest.approx(1e-3)
    assert tail == pytest.approx(1 - ANSWER_TOP / 1000, rel=1e-5)
    signal = budget_signal(_scores(), SPANS, N_CONTEXT, answer_logits=torch.zeros(1000))
    assert signal.answer_entropy == pytest.approx(math.log(1000), rel=1e-5)
    assert BudgetSignal.from_json(signal.to_json()).answer_top1 == pytest.approx(1e-3)
    assert budget_signal(_scores(), SPANS, N_CONTEXT).answer_entropy is None
    model = BudgetModel(("one", "log_ratio", "answer_entropy"), (-5.0, -1.0, 0.5), prices={"low": 1.0, "medium": 0.5, "high": 0.1})
    assert model.reads_answer and not BudgetModel(("one", "log_ratio"), (0.0, -1.0)).reads_answer
    with pytest.raises(ValueError, match="answer, which was not measured"):
        model.predicted_kl(budget_signal(_scores(), SPANS, N_CONTEXT), 0.1)


def _signal(level: float) -> BudgetSignal:
    """A synthetic prompt whose difficulty is ``level`` (carried in chunk_share)."""
    return BudgetSignal(3, 100, level, tuple(1 - r for r in RATIO_LADDER), 0.0, 1.0)


def _true_kl(level: float, ratio: float) -> float:
    return math.exp(-6.0 + 4.0 * level - 1.5 * math.log(ratio))  # KL = e^(4 level - 6) r^-1.5


def test_the_fit_recovers_a_log_linear_law_and_the_choice_follows_difficulty():
    rng = random.Random(0)
    levels = [rng.uniform(0, 1) for _ in range(30)]
    samples = [(_signal(lv), r, _true_kl(lv, r)) for lv in levels for r in RATIO_LADDER]
    model = fit_budget_model(samples, ("one", "log_ratio", "chunk_share"), ridge=0.0)
    assert model.coefficients == pytest.approx((-6.0, -1.5, 4.0), abs=1e-6)
    easy, hard = _signal(0.0), _signal(1.0)
    assert model.predicted_kl(hard, 0.1) == pytest.approx(_true_kl(1.0, 0.1))
    price = 1.0
    assert model.choose_at_price(hard, price).anchor_ratio > model.choose_at_price(easy, price).anchor_ratio
    # a higher price never buys more anchors
    ratios = [model.choose_at_price(hard, p).anchor_ratio for p in (0.01, 0.1, 1, 10, 100, 1e4)]
    assert ratios == sorted(ratios, reverse=True) and ratios[0] == max(RATIO_LADDER) and ratios[-1] == min(RATIO_LADDER)


def test_prices_meet_each_level_target_at_less_mean_ratio_than_the_fixed_one():
    rng = random.Random(1)
    levels = [rng.choice([0.0, 0.1, 1.0]) for _ in range(40)]  # mostly easy, some hard
    curves = [PromptCurve(_signal(lv), {r: _true_kl(lv, r) for r in RATIO_LADDER}) for lv in levels]
    model = fit_budget_model([(c.signal, r, k) for c in curves for r, k in c.kl.items()], ("one", "log_ratio", "chunk_share"))
    target = sum(c.kl[0.15] for c in curves) / len(curves)
    priced = calibrate_prices(model, curves, {"low": target * 2, "medium": target, "high": target / 2})
    assert priced.prices["low"] >= priced.prices["medium"] >= priced.prices["high"]
    ratios = choose_ratios(priced, [c.signal for c in curves], priced.prices["medium"])
    kl = sum(c.kl[r] for c, r in zip(curves, ratios)) / len(curves)
    assert kl <= target and sum(ratios) / len(ratios) < 0.15  # the same mean KL for fewer anchors
    assert priced.choose(_signal(1.0), "medium").anchor_ratio > priced.choose(_signal(0.0), "medium").anchor_ratio
    # a numeric quality: the cheapest price whose mean KL meets it
    assert priced.price_for(target) == max(p for p, k, _ in price_curve(priced, curves) if k <= target)


def test_the_model_round_trips_and_refuses_what_it_cannot_use():
    model = BudgetModel(("one", "log_ratio"), (0.5, -1.0), prices={"low": 1.0, "medium": 0.5, "high": 0.1},
                        price_curve=((0.1, 0.02), (1.0, 0.05)))
    assert BudgetModel.from_json(model.to_json()) == model
    with pytest.raises(ValueError, match="unknown budget features"):
        BudgetModel(("one", "moon_phase"), (0.0, 1.0))
    with pytest.raises(ValueError, match="coefficients"):
        BudgetModel(("one",), (0.0, 1.0))
    with pytest.raises(ValueError, match="quality levels"):
        BudgetModel(("one",), (0.0,), prices={"low": 1.0})
    with pytest.raises(ValueError, match="JSON object"):
        BudgetModel.from_json([1, 2])
    with pytest.raises(ValueError, match="no price for quality"):
        BudgetModel(("one",), (0.0,)).price_for("medium")


def test_quality_settings():
    assert parse_quality("Medium") == "medium" and parse_quality(0.04) == 0.04 and parse_quality("0.1") == 0.1
    for bad in ("best", 0, -1, float("inf"), float("nan"), True, None, [0.1]):
        with pytest.raises(ValueError, match="low, medium, high"):
            parse_quality(bad)
