"""A per-request repair budget (``relaxkv_budget: "auto"``): the anchor ratio chosen from what the query pass measured,
at a price the operator's ``quality`` sets.

**Signal** (:func:`budget_signal`): from the stale attention, how much the query reads the chunks, how much of that
the ``r|E|`` most-read eligible tokens leave unrepaired per :data:`RATIO_LADDER` ratio r, how much more than their
share it reads the markup every chunk repeats and the chunks' openings; how unsure ``pic``'s answer is. **Model**
(:class:`BudgetModel`, fitted per model on the development split by ``scripts/calibrate.py --budget``): ``log KL(r)
~= theta . phi(signal, r)``, least squares against the measured first-token KL. **Choice**: the ladder ratio
minimizing ``KL^(r) + price * r``: one price for all requests spends anchors where the predicted KL falls most per
anchor, so it minimizes the mean KL for its mean cost (a Lagrangian relaxation). ``quality`` (a level, or a target
mean KL) picks the price from the calibration's (price, development mean KL) table. Why these values:
docs/experiments/INDEX.md#auto-budget.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from relaxkv_sglang.runtime.quality import AUTO, QUALITY_LEVELS
from relaxkv_sglang.repair.token_sets import check_spans, eligible_tokens, shared_runs

Span = tuple[int, int]

__all__ = ["RATIO_LADDER", "OPENING_TOKENS", "ANSWER_TOP", "KL_FLOOR", "FEATURES", "ANSWER_FEATURES", "BudgetSignal",
           "answer_uncertainty", "budget_signal", "BudgetChoice", "BudgetModel", "fit_budget_model", "choose_ratios",
           "LEVEL_REFERENCE_RATIOS", "PRICE_GRID", "PromptCurve", "price_curve", "calibrate_prices"]

# The anchor ratios a choice is made among (and the calibration measures).
RATIO_LADDER: tuple[float, ...] = (0.02, 0.04, 0.06, 0.08, 0.10, 0.15, 0.20, 0.30)
OPENING_TOKENS = 4  # a chunk's opening: its first tokens, read as the chunk's own sink
ANSWER_TOP = 20  # the answer's tail: the mass outside its most likely tokens
KL_FLOOR = 1e-3  # log KL is fitted on max(KL, floor): below it, differences are rounding


@dataclasses.dataclass(frozen=True)
class BudgetSignal:
    """What the query pass says about a request's need for repair (module doc)."""

    n_chunks: int
    n_eligible: int
    chunk_share: float
    uncovered: tuple[float, ...]
    markup_lift: float
    opening_lift: float
    answer_entropy: Optional[float] = None
    answer_top1: Optional[float] = None
    answer_tail: Optional[float] = None

    def uncovered_at(self, ratio: float) -> float:
        """``uncovered(ratio)``, interpolated linearly between the ladder's ratios."""
        ladder = list(RATIO_LADDER)
        if ratio <= ladder[0]:
            return self.uncovered[0]
        for i in range(1, len(ladder)):
            if ratio <= ladder[i]:
                w = (ratio - ladder[i - 1]) / (ladder[i] - ladder[i - 1])
                return (1 - w) * self.uncovered[i - 1] + w * self.uncovered[i]
        return self.uncovered[-1]

    def to_json(self) -> dict[str, Any]:
        """The report's form (``meta_info.relaxkv.budget_signal``), rounded."""
        return {"n_chunks": self.n_chunks, "n_eligible": self.n_eligible, "chunk_share": round(self.chunk_share, 4),
                "uncovered": [round(u, 4) for u in self.uncovered], "markup_lift": round(self.markup_lift, 3),
                "opening_lift": round(self.opening_lift, 3),
                **{name: None if value is None else round(value, 5) for name, value in
                   (("answer_entropy", self.answer_entropy), ("answer_top1", self.answer_top1),
                    ("answer_tail", self.answer_tail))}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "BudgetSignal":
        answer = [None if data.get(k) is None else float(data[k])
                  for k in ("answer_entropy", "answer_top1", "answer_tail")]
        return cls(int(data["n_chunks"]), int(data["n_eligible"]), float(data["chunk_share"]),
                   tuple(float(u) for u in data["uncovered"]), float(data["markup_lift"]),
                   float(data["opening_lift"]), *answer)


def _lift(mass: torch.Tensor, elig_mass: torch.Tensor, marked: torch.Tensor) -> float:
    """Mass share of the ``marked`` eligible tokens over their token share (0 when none is marked).
    mass [L, |E|], elig_mass [L], marked bool [|E|]."""
    n_marked = int(marked.sum())
    if n_marked == 0:
        return 0.0
    share = (mass[:, marked].sum(dim=1) / elig_mass).mean()
    return float(share / (n_marked / marked.numel()))


def answer_uncertainty(logits: torch.Tensor) -> tuple[float, float, float]:
    """(entropy in nats, top-1 probability, mass outside the top :data:`ANSWER_TOP`) of one
    next-token distribution; logits float [vocab] (any dtype, read in float32)."""
    logp = torch.log_softmax(logits.float().flatten(), dim=0)
    p = logp.exp()
    top = torch.topk(p, min(ANSWER_TOP, p.numel())).values
    return float(-(p * logp).sum()), float(top[0]), float((1 - top.sum()).clamp_min(0))


def budget_signal(scores: torch.Tensor, chunk_spans: Sequence[Span], n_context: int,
                  input_ids: Optional[torch.Tensor] = None,
                  answer_logits: Optional[torch.Tensor] = None) -> BudgetSignal:
    """``scores`` float [n_layers, n_context] ``s_l``; ``input_ids`` int64 [>= n_context] (None: no markup);
    ``answer_logits`` float [vocab] at the prompt's last token (None: no answer fields)."""
    spans = check_spans(chunk_spans, n_context)
    elig = eligible_tokens(spans, n_context)
    n_elig = int(elig.numel())
    answer = answer_uncertainty(answer_logits) if answer_logits is not None else (None, None, None)
    if n_elig == 0:
        return BudgetSignal(len(spans), 0, 0.0, tuple(0.0 for _ in RATIO_LADDER), 0.0, 0.0, *answer)
    s = scores.float().clamp_min(0)
    total = s.sum(dim=1).clamp_min(1e-12)  # [L]
    mass = s[:, elig]  # [L, |E|]
    elig_mass = mass.sum(dim=1).clamp_min(1e-12)
    ranked = torch.sort(mass, dim=1, descending=True).values.cumsum(dim=1) / elig_mass[:, None]
    uncovered = tuple(float((1 - ranked[:, min(max(math.ceil(r * n_elig), 1), n_elig) - 1]).clamp_min(0).mean())
                      for r in RATIO_LADDER)
    openings = torch.zeros(n_context, dtype=torch.bool)
    for start, end in spans:
        openings[start:min(start + OPENING_TOKENS, end)] = True
    markup = (shared_runs(input_ids, spans, n_context) if input_ids is not None
              else torch.zeros(n_context, dtype=torch.bool))
    return BudgetSignal(len(spans), n_elig, float((elig_mass / total).mean()), uncovered,
                        _lift(mass, elig_mass, markup[elig]), _lift(mass, elig_mass, openings[elig]), *answer)


# phi(signal, ratio) by name: a model file names its features, readable while each name is here.
FEATURES: dict[str, Callable[[BudgetSignal, float], float]] = {
    "one": lambda s, r: 1.0,
    "log_ratio": lambda s, r: math.log(r),
    "log_uncovered": lambda s, r: math.log(max(s.uncovered_at(r), 1e-4)),
    "chunk_share": lambda s, r: s.chunk_share,
    "markup_lift": lambda s, r: s.markup_lift,
    "opening_lift": lambda s, r: s.opening_lift,
    "log_chunks": lambda s, r: math.log(max(s.n_chunks, 1)),
    "log_eligible": lambda s, r: math.log(max(s.n_eligible, 1)),
    "log_ratio_x_markup": lambda s, r: math.log(r) * s.markup_lift,
    "log_ratio_x_chunk_share": lambda s, r: math.log(r) * s.chunk_share,
    "answer_entropy": lambda s, r: _answer(s.answer_entropy),
    "answer_top1": lambda s, r: _answer(s.answer_top1),
    "log_answer_tail": lambda s, r: math.log(max(_answer(s.answer_tail), 1e-4)),
    "log_ratio_x_answer_entropy": lambda s, r: math.log(r) * _answer(s.answer_entropy),
}
# The features that read the query pass's answer (a signal without it cannot use them).
ANSWER_FEATURES = frozenset(f for f in FEATURES if "answer" in f)


@dataclasses.dataclass(frozen=True)
class BudgetChoice:
    """One request's budget decision; ``price``: the KL one unit of anchor ratio was worth."""

    anchor_ratio: float
    predicted_kl: float
    quality: str | float
    price: float

    def to_json(self) -> dict[str, Any]:
        return {"mode": AUTO, "quality": self.quality, "anchor_ratio": self.anchor_ratio,
                "predicted_kl": round(self.predicted_kl, 4), "price": round(self.price, 4)}


@dataclasses.dataclass(frozen=True)
class BudgetModel:
    """A model's fitted budget predictor (theta per feature) and its prices: per quality level, and ``price_curve``
    ``[(price, development mean KL), ...]`` by increasing price for a numeric quality."""

    features: tuple[str, ...]
    coefficients: tuple[float, ...]
    ladder: tuple[float, ...] = RATIO_LADDER
    prices: Mapping[str, float] = dataclasses.field(default_factory=dict)
    price_curve: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        unknown = [f for f in self.features if f not in FEATURES]
        if unknown:
            raise ValueError(f"unknown budget features {unknown}; known: {', '.join(FEATURES)}")
        if len(self.features) != len(self.coefficients):
            raise ValueError(f"{len(self.features)} features but {len(self.coefficients)} coefficients")
        if not self.ladder or any(not 0 < r <= 1 for r in self.ladder):
            raise ValueError(f"the ladder's ratios must be in (0, 1], got {list(self.ladder)}")
        missing = [q for q in QUALITY_LEVELS if q not in self.prices]
        if self.prices and missing:
            raise ValueError(f"prices lack the quality levels {missing}")

    @property
    def reads_answer(self) -> bool:
        """Whether a choice needs the query pass's answer (:data:`ANSWER_FEATURES`)."""
        return any(f in ANSWER_FEATURES for f in self.features)

    def predicted_kl(self, signal: BudgetSignal, ratio: float) -> float:
        """exp(theta . phi(signal, ratio))."""
        z = sum(c * FEATURES[f](signal, ratio) for f, c in zip(self.features, self.coefficients))
        return math.exp(min(z, 50.0))

    def price_for(self, quality: str | float) -> float:
        """The price a quality setting stands for (ValueError when the model has no prices)."""
        if isinstance(quality, str):
            if quality not in self.prices:
                raise ValueError(f"the budget model has no price for quality {quality!r}")
            return float(self.prices[quality])
        if not self.price_curve:
            raise ValueError("the budget model has no price curve for a numeric quality")
        meeting = [price for price, kl in self.price_curve if kl <= quality]
        return max(meeting) if meeting else min(price for price, _ in self.price_curve)

    def choose(self, signal: BudgetSignal, quality: str | float) -> BudgetChoice:
        """The ladder ratio minimizing ``KL^(r) + price * r`` (module doc)."""
        price = self.price_for(quality)
        return self.choose_at_price(signal, price, quality)

    def choose_at_price(self, signal: BudgetSignal, price: float, quality: str | float = "") -> BudgetChoice:
        if signal.n_eligible == 0:
            return BudgetChoice(min(self.ladder), 0.0, quality, price)
        best = min(self.ladder, key=lambda r: (self.predicted_kl(signal, r) + price * r, r))
        return BudgetChoice(best, self.predicted_kl(signal, best), quality, price)

    def to_json(self) -> dict[str, Any]:
        return {"features": list(self.features), "coefficients": [float(c) for c in self.coefficients],
                "ladder": list(self.ladder), "prices": dict(self.prices),
                "price_curve": [[p, k] for p, k in self.price_curve]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "BudgetModel":
        """The model from a calibration file's ``budget_model`` (ValueError naming what is wrong)."""
        if not isinstance(data, Mapping):
            raise ValueError("budget_model must be a JSON object")
        try:
            return cls(tuple(data["features"]), tuple(float(c) for c in data["coefficients"]),
                       tuple(float(r) for r in data.get("ladder", RATIO_LADDER)),
                       {str(k): float(v) for k, v in (data.get("prices") or {}).items()},
                       tuple((float(p), float(k)) for p, k in data.get("price_curve") or ()))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"budget_model: {exc!r}") from None


def _answer(value: Optional[float]) -> float:
    if value is None:
        raise ValueError("this budget model reads the query pass's answer, which was not measured")
    return value


def fit_budget_model(samples: Sequence[tuple[BudgetSignal, float, float]], features: Sequence[str],
                     ridge: float = 1e-3) -> BudgetModel:
    """theta: ridge least squares (not on ``one``) of ``log max(KL, KL_FLOOR)`` on ``phi(signal, ratio)``; no prices."""
    if len(samples) < len(features):
        raise ValueError(f"{len(samples)} samples cannot fit {len(features)} features")
    x = torch.tensor([[FEATURES[f](s, r) for f in features] for s, r, _ in samples], dtype=torch.float64)
    y = torch.tensor([math.log(max(kl, KL_FLOOR)) for _, _, kl in samples], dtype=torch.float64)
    penalty = torch.diag(torch.tensor([0.0 if f == "one" else ridge * len(samples) for f in features],
                                      dtype=torch.float64))
    theta = torch.linalg.solve(x.T @ x + penalty, x.T @ y)
    return BudgetModel(tuple(features), tuple(float(t) for t in theta))


def choose_ratios(model: BudgetModel, signals: Sequence[BudgetSignal], price: float) -> list[float]:
    return [model.choose_at_price(s, price).anchor_ratio for s in signals]


# Each quality level aims at the development mean KL of a fixed anchor ratio (medium: the 15% default).
LEVEL_REFERENCE_RATIOS: dict[str, float] = {"low": 0.08, "medium": 0.15, "high": 0.30}
PRICE_GRID: tuple[float, ...] = tuple(round(10 ** (k / 32), 6) for k in range(-128, 65))  # 1e-4 .. 100


@dataclasses.dataclass(frozen=True)
class PromptCurve:
    """One development prompt: its signal and its measured KL at each ladder ratio."""

    signal: BudgetSignal
    kl: Mapping[float, float]


def price_curve(model: BudgetModel, prompts: Sequence[PromptCurve],
                prices: Sequence[float] = PRICE_GRID) -> list[tuple[float, float, float]]:
    """``[(price, mean measured KL, mean chosen ratio), ...]`` over ``prompts`` (each prompt's KL at
    the ratio the model chooses for it: measured, so the ladder must be among each curve's ratios)."""
    out = []
    for price in prices:
        ratios = choose_ratios(model, [p.signal for p in prompts], price)
        kls = [p.kl[r] for p, r in zip(prompts, ratios)]
        out.append((float(price), sum(kls) / len(kls), sum(ratios) / len(ratios)))
    return out


def calibrate_prices(model: BudgetModel, prompts: Sequence[PromptCurve],
                     targets: Mapping[str, float]) -> BudgetModel:
    """``model`` priced: per level the largest price whose mean KL over ``prompts`` meets ``targets[level]``."""
    curve = price_curve(model, prompts)
    least = min(curve, key=lambda c: (c[1], -c[0]))[0]
    prices = {level: max((p for p, kl, _ in curve if kl <= target), default=least)
              for level, target in targets.items()}
    # a numeric quality takes the largest price meeting it: of a run of prices with one mean KL, the last
    kept = [(p, kl) for i, (p, kl, _) in enumerate(curve) if i + 1 == len(curve) or curve[i + 1][1] != kl]
    return dataclasses.replace(model, prices=prices, price_curve=tuple(kept))
