"""Fit a model's ``auto`` budget (``repair/auto_budget.py``) from its measured development frontier.

Input: ``bench_frontier`` result files of the development split (``--split dev``, ``relaxkv`` at
every ratio of ``auto_budget.RATIO_LADDER``), whose rows carry each prompt's query-pass signal
(``meta_info.relaxkv.budget_signal``); several files are joined per prompt (task, example, format),
so a signal measured in a later run of the same prompts serves too. Steps:

1. per prompt, its signal and its measured KL at each ladder ratio (:class:`PromptCurve`);
2. for each ``--features`` set, leave-one-example-out: fit on the other examples, price the
   levels on them, choose for the held-out example's prompts; the set with the least mean chosen
   ratio whose pooled mean KL at ``medium`` is within its target wins (ties: fewer features);
3. the winner is fitted on all prompts and priced (``calibrate_prices``): each level's target is
   the mean KL ``relaxkv`` measured at its reference ratio (``LEVEL_REFERENCE_RATIOS``).

``python -m scripts.calibrate --budget FILE [FILE ...] --model M`` runs it and writes the model into
the model's calibration file (its knobs kept; one made with no knob when the model has none).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
from typing import Any, Sequence

from relaxkv_sglang.repair.auto_budget import (ANSWER_FEATURES, LEVEL_REFERENCE_RATIOS, RATIO_LADDER, BudgetModel, BudgetSignal,
                                             PromptCurve, calibrate_prices, choose_ratios, fit_budget_model)
from relaxkv_sglang.repair.calibration import (Calibration, calibration_path, load_calibration, model_fingerprint,
                                             save_calibration)

# Candidate feature sets, from the plainest (a power law in the ratio with a per-prompt level) up.
FEATURE_SETS: dict[str, tuple[str, ...]] = {
    "ratio": ("one", "log_ratio"),
    "uncovered": ("one", "log_ratio", "log_uncovered"),
    "uncovered+markup": ("one", "log_ratio", "log_uncovered", "markup_lift", "log_ratio_x_markup"),
    "shares": ("one", "log_ratio", "log_uncovered", "chunk_share", "markup_lift", "opening_lift"),
    "all": ("one", "log_ratio", "log_uncovered", "chunk_share", "markup_lift", "opening_lift", "log_chunks",
            "log_eligible", "log_ratio_x_markup", "log_ratio_x_chunk_share"),
    "answer": ("one", "log_ratio", "answer_entropy", "answer_top1", "log_answer_tail"),
    "answer+attention": ("one", "log_ratio", "answer_entropy", "answer_top1", "log_answer_tail", "log_uncovered",
                         "markup_lift", "opening_lift"),
    "answer+slope": ("one", "log_ratio", "answer_entropy", "answer_top1", "log_answer_tail",
                     "log_ratio_x_answer_entropy", "markup_lift", "log_ratio_x_markup"),
}

Unit = tuple[str, str, str]


@dataclasses.dataclass(frozen=True)
class DevPrompt:
    """One development prompt: its unit (task, example id, format) and its curve."""

    unit: Unit
    curve: PromptCurve

    @property
    def example(self) -> tuple[str, str]:
        return self.unit[:2]


def load_prompts(paths: Sequence[str | pathlib.Path], policy: str = "relaxkv") -> list[DevPrompt]:
    """The prompts measured at every ladder ratio with a signal, from ``bench_frontier`` files of the
    development split (ValueError naming a file of another split or bench)."""
    kl: dict[Unit, dict[float, float]] = {}
    signals: dict[Unit, BudgetSignal] = {}
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        if data.get("bench") != "bench_frontier":
            raise ValueError(f"{path}: not a bench_frontier result")
        if (data.get("split") or {}).get("name") != "dev":
            raise ValueError(f"{path}: split {(data.get('split') or {}).get('name')!r}; a budget is fitted on dev only")
        for row in data["per_example"]:
            unit = (row["task"], row["example_id"], row["format"])
            report = row.get("relaxkv") or {}
            if report.get("budget_signal") is not None:
                signals[unit] = BudgetSignal.from_json(report["budget_signal"])
            if row["policy"] == policy and isinstance(row["anchor_ratio"], float):
                kl.setdefault(unit, {})[round(row["anchor_ratio"], 6)] = float(row["kl_first_token"])
    ladder = [round(r, 6) for r in RATIO_LADDER]
    return [DevPrompt(u, PromptCurve(signals[u], {r: kl[u][r] for r in ladder}))
            for u in sorted(kl) if u in signals and all(r in kl[u] for r in ladder)]


def level_targets(prompts: Sequence[DevPrompt]) -> dict[str, float]:
    """Each level's target: the mean KL at its reference ratio over ``prompts``."""
    return {level: statistics.fmean(p.curve.kl[ratio] for p in prompts)
            for level, ratio in LEVEL_REFERENCE_RATIOS.items()}


def fitted(prompts: Sequence[DevPrompt], features: Sequence[str]) -> BudgetModel:
    """The model fitted on ``prompts`` and priced for their level targets."""
    samples = [(p.curve.signal, r, kl) for p in prompts for r, kl in p.curve.kl.items()]
    model = fit_budget_model(samples, features)
    return calibrate_prices(model, [p.curve for p in prompts], level_targets(prompts))


def cross_validate(prompts: Sequence[DevPrompt], features: Sequence[str]) -> dict[str, Any]:
    """Leave-one-example-out: per level, the held-out prompts' mean KL and mean chosen ratio (pooled
    over the folds) against the fixed reference ratio's mean KL."""
    examples = sorted({p.example for p in prompts})
    chosen: dict[str, list[tuple[float, float]]] = {level: [] for level in LEVEL_REFERENCE_RATIOS}
    for held in examples:
        train = [p for p in prompts if p.example != held]
        test = [p for p in prompts if p.example == held]
        model = fitted(train, features)
        for level in LEVEL_REFERENCE_RATIOS:
            ratios = choose_ratios(model, [p.curve.signal for p in test], model.prices[level])
            chosen[level] += [(p.curve.kl[r], r) for p, r in zip(test, ratios)]
    targets = level_targets(prompts)
    return {level: {"kl": statistics.fmean(k for k, _ in pairs), "ratio": statistics.fmean(r for _, r in pairs),
                    "target_kl": targets[level], "reference_ratio": LEVEL_REFERENCE_RATIOS[level]}
            for level, pairs in chosen.items()}


def choose_features(prompts: Sequence[DevPrompt], sets: dict[str, tuple[str, ...]] = FEATURE_SETS,
                    slack: float = 0.0) -> tuple[str, dict[str, dict]]:
    """The feature set (name) whose held-out ``medium`` mean KL is within ``target + slack`` at the
    least mean ratio (none within: the least KL), and every set's cross-validation; sets reading the
    query pass's answer only when every prompt's signal has it."""
    answered = all(p.curve.signal.answer_entropy is not None for p in prompts)  # else no answer feature
    sets = {n: f for n, f in sets.items() if answered or not ANSWER_FEATURES.intersection(f)}
    scores = {name: cross_validate(prompts, features) for name, features in sets.items()}
    within = [n for n, s in scores.items() if s["medium"]["kl"] <= s["medium"]["target_kl"] + slack]
    if within:
        best = min(within, key=lambda n: (scores[n]["medium"]["ratio"], len(sets[n])))
    else:
        best = min(scores, key=lambda n: scores[n]["medium"]["kl"])
    return best, scores


def print_cross_validation(scores: dict[str, dict], best: str) -> None:
    """Each feature set's held-out mean KL and mean chosen ratio per level."""
    print("feature set         | level  | held-out KL | target KL | mean ratio | reference ratio")
    for name, levels in scores.items():
        for level, s in levels.items():
            mark = " *" if name == best else ""
            print(f"{name + mark:<19} | {level:<6} | {s['kl']:.4f}      | {s['target_kl']:.4f}    | "
                  f"{s['ratio']:.3f}      | {s['reference_ratio']:.2f}")


def calibrate(model: str, model_dir: pathlib.Path, paths: Sequence[str], output: pathlib.Path | None,
              command: str, evidence: dict[str, Any]) -> Calibration:
    """Fit, price and write ``model``'s budget into its calibration file (module doc)."""
    prompts = load_prompts(paths)
    examples = {p.example for p in prompts}
    if len(examples) < 3:
        raise SystemExit(f"calibrate --budget: {len(prompts)} prompts of {len(examples)} examples with a signal "
                         f"and every ladder ratio in {', '.join(map(str, paths))}; at least 3 examples are needed")
    best, scores = choose_features(prompts)
    print_cross_validation(scores, best)
    budget = fitted(prompts, FEATURE_SETS[best])
    path = output or calibration_path(model)
    fingerprint = model_fingerprint(model_dir)
    existing = load_calibration(path) if path.exists() else None
    if existing is not None and not existing.matches(fingerprint):
        raise SystemExit(f"calibrate --budget: {path} is another model's calibration")
    base = existing or Calibration(model, fingerprint, {}, {"note": "no knob calibrated: the code defaults"})
    budget_evidence = {**evidence, "command": command, "sources": list(map(str, paths)), "prompts": len(prompts),
                       "examples": len(examples), "formats": sorted({p.unit[2] for p in prompts}),
                       "feature_set": best, "targets": level_targets(prompts), "cross_validation": scores}
    calibration = dataclasses.replace(base, budget_model=budget, budget_evidence=budget_evidence, path=None)
    written = save_calibration(calibration, path)
    print(f"\nbudget of {model}: features {', '.join(budget.features)}; prices "
          + ", ".join(f"{k}={v:g}" for k, v in budget.prices.items()) + f"\nwritten to {written}")
    return calibration
