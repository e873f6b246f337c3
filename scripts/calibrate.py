"""Calibrate a model's repair knobs on its development split and write its calibration file.

Coordinate descent on the torch reference (``scripts/ablate_repair.py``'s cases: the prompt split as
the server splits it, full prefill's last logits and the stale state computed once per (example,
format)). Starting from the code defaults, each ``--knob`` in turn tries its candidate values in
order, at ``--anchor-ratio`` under ``--policy``, each measured as the first-token KL to full
prefill over the whole vocabulary. A candidate replaces the current value only when its paired
mean KL difference against the current best is below 0 and the 95% paired bootstrap interval
(``benchmarks.metrics.paired_bootstrap_ci``, the (example, format) pairs resampled) excludes 0;
otherwise the current value stays. With fewer than two pairs nothing is kept (an interval of one
pair says nothing). ``--rounds N`` repeats the pass over the knobs until a pass keeps nothing.

    python -m scripts.calibrate --model qwen2.5-0.5b --examples 3 --formats plain document chat \\
        --knob stale_shift_scale=0.25,0.5,1.0 --knob layer_value=ramp,uniform

Writes ``relaxkv_sglang/calibrations/<model>.json`` (or ``--output``): the knobs whose chosen value
differs from the code default, the model's fingerprint, and the evidence (the command, the
development ranges, per knob and candidate: mean KL, paired difference, its interval, W/T/L,
kept or not, and the same per prompt format; date, git commit). Prints the same as a table. When
no knob differs from the defaults and there is no ``--output``, nothing is written (the model is
served with the defaults; an existing file is left as it is). Development split only: a range that
leaves it is refused, as ``ablate_repair.py`` refuses it.

``--budget FRONTIER_JSON ...`` instead fits the ``auto`` budget's model from ``bench_frontier``
results of the development split (``scripts/calibrate_budget.py``) and writes it into the same
file, its knobs kept; a knob calibration keeps the file's budget model.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import subprocess
import sys
from typing import Any

from relaxkv_sglang import assets
from relaxkv_sglang.repair.calibration import (PER_REQUEST_KNOBS, Calibration, calibration_path, changed_knobs,
                                             load_calibration, model_fingerprint, save_calibration)
from relaxkv_sglang.repair.repair_config import RepairConfig, knob_defaults
from scripts import calibrate_budget
from scripts.ablate_repair import (ReferenceCase, add_case_arguments, dev_split_error, kl_full_vocab, load_reference,
                                   paired_kl, parse_knob_value, reference_cases)

MIN_PAIRS = 2  # a bootstrap interval of one pair is that pair: no evidence


def parse_knob(text: str) -> tuple[str, list]:
    """``NAME=V1,V2,...`` -> (knob, candidate values typed as its default)."""
    name, _, values = text.partition("=")
    defaults = knob_defaults()
    if name not in defaults:
        raise argparse.ArgumentTypeError(f"unknown knob {name!r}; the knobs are {', '.join(defaults)}")
    if name in PER_REQUEST_KNOBS:
        raise argparse.ArgumentTypeError(f"{name} is a per-request setting, not calibrated")
    candidates = [parse_knob_value(defaults[name], v) for v in values.split(",") if v]
    if not candidates:
        raise argparse.ArgumentTypeError(f"knob {name}: expected {name}=V1,V2,...")
    try:
        for value in candidates:
            RepairConfig.from_knobs(**{name: value})
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"knob {name}: {exc}") from None
    return name, candidates


class KLTable:
    """First-token KL to full of each knob setting on every case, each setting run once."""

    def __init__(self, weights: Any, cases: list[ReferenceCase], policy: str, anchor_ratio: float) -> None:
        self.weights, self.cases, self.policy, self.anchor_ratio = weights, cases, policy, anchor_ratio
        self._done: dict[tuple, list[float]] = {}

    def kl(self, knobs: dict[str, Any]) -> list[float]:
        """float per case: KL(full || the repair with ``knobs`` over the defaults)."""
        key = tuple(sorted(knobs.items()))
        if key not in self._done:
            config = RepairConfig.from_knobs(**{**knobs, "anchor_ratio": self.anchor_ratio})
            self._done[key] = [kl_full_vocab(c.full, c.repaired(self.weights, self.policy, config).last_logits)
                               for c in self.cases]
        return self._done[key]


def descend(table: KLTable, knobs: list[tuple[str, list]], rounds: int) -> tuple[dict[str, Any], list[dict]]:
    """Coordinate descent (module doc): (the chosen knobs, one step per knob and round with every
    candidate's evidence)."""
    defaults = knob_defaults()
    best: dict[str, Any] = {}
    steps = []
    for round_ in range(1, rounds + 1):
        kept_any = False
        for name, candidates in knobs:
            best_kl = table.kl(best)
            step = {"round": round_, "knob": name, "start": best.get(name, defaults[name]), "candidates": []}
            for value in candidates:
                current = best.get(name, defaults[name])
                if value == current:
                    step["candidates"].append({"value": value, "versus": current, "kl": statistics.mean(best_kl),
                                               "diff": 0.0, "diff_ci95": None, "wtl": None, "kept": False})
                    continue
                kl = table.kl({**best, name: value})
                evidence = paired_kl(kl, best_kl)
                kept = len(kl) >= MIN_PAIRS and evidence["diff"] < 0 and evidence["diff_ci95"] is not None \
                    and evidence["diff_ci95"][1] < 0
                formats = [c.fmt for c in table.cases]
                by_format = {fmt: paired_kl(*[[v for v, f in zip(x, formats) if f == fmt] for x in (kl, best_kl)])
                             for fmt in dict.fromkeys(formats)}
                step["candidates"].append({"value": value, "versus": current, **evidence, "kept": kept,
                                           "by_format": by_format})
                if kept:
                    best, best_kl, kept_any = {**best, name: value}, kl, True
            step["chosen"] = best.get(name, defaults[name])
            steps.append(step)
        if not kept_any:
            break
    return best, steps


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def git_commit() -> str | None:
    """The checkout's commit (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30,
                             cwd=pathlib.Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def print_steps(steps: list[dict], n_pairs: int) -> None:
    """The evidence as a table: per knob, every candidate against the best at its turn."""
    print(f"\n{'round':<6}{'knob':<20}{'value':>10}{'vs':>10}{'KL':>9}{'diff':>9}  {'95% CI':<20}{'W/T/L':<9}kept"
          f"   ({n_pairs} (example, format) pairs)")
    for step in steps:
        for c in step["candidates"]:
            rows = [(step["knob"], c, "yes" if c["kept"] else "no")]
            if len(c.get("by_format", {})) > 1:
                rows += [(f"  {fmt}", part, "") for fmt, part in c["by_format"].items()]
            for label, row, kept in rows:
                ci = "-" if row["diff_ci95"] is None else f"[{row['diff_ci95'][0]:+.4f}, {row['diff_ci95'][1]:+.4f}]"
                wtl = "-" if row["wtl"] is None else "/".join(map(str, row["wtl"]))
                print(f"{step['round']:<6}{label:<20}{str(c['value']):>10}{str(c['versus']):>10}{row['kl']:>9.4f}"
                      f"{row['diff']:>+9.4f}  {ci:<20}{wtl:<9}{kept}")


def main(argv: list[str] | None = None) -> Calibration:
    """``python -m scripts.calibrate``: measure, print the table, write the calibration file."""
    parser = argparse.ArgumentParser(prog="python -m scripts.calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a prepared model's name or a model folder")
    parser.add_argument("--knob", type=parse_knob, action="append", metavar="NAME=V1,V2,...",
                        help="a knob and its candidate values, tried in order (repeatable; the knobs in order)")
    parser.add_argument("--budget", nargs="+", metavar="FRONTIER_JSON", default=None,
                        help="instead of knobs: fit the auto budget from these bench_frontier results of the "
                             "development split (scripts/calibrate_budget.py)")
    add_case_arguments(parser)
    parser.add_argument("--anchor-ratio", type=float, default=RepairConfig().anchor_ratio)
    parser.add_argument("--policy", default="relaxkv", help="the repair policy calibrated (default relaxkv)")
    parser.add_argument("--rounds", type=int, default=1, help="passes over the knobs (stops early when one keeps nothing)")
    parser.add_argument("--output", type=pathlib.Path, default=None,
                        help="the calibration file (default: relaxkv_sglang/calibrations/<model>.json)")
    args = parser.parse_args(argv)
    command = "python -m scripts.calibrate " + " ".join(sys.argv[1:] if argv is None else argv)
    if bool(args.knob) == bool(args.budget):
        parser.error("give either --knob (the repair knobs) or --budget (the auto budget)")
    if args.budget:
        model_dir = assets.resolve_model(args.model)
        return calibrate_budget.calibrate(model_dir.name, model_dir, args.budget, args.output, command,
                                          {"date": _now(), "git_commit": git_commit(), "split": "dev"})
    outside = dev_split_error(args.offset, args.seed, args.examples)
    if outside:
        parser.error(f"calibration runs on the development split only ({outside})")
    weights, tokenizer, model_dir = load_reference(args.model)
    model = model_dir.name
    cases = list(reference_cases(weights, tokenizer, args.tasks, args.formats, args.examples, seed=args.seed,
                                 offset=args.offset))
    best, steps = descend(KLTable(weights, cases, args.policy, args.anchor_ratio), args.knob, args.rounds)
    print_steps(steps, len(cases))
    evidence = {
        "command": command, "date": _now(),
        "git_commit": git_commit(), "split": "dev", "policy": args.policy, "anchor_ratio": args.anchor_ratio,
        "tasks": args.tasks, "formats": args.formats, "examples": args.examples, "pairs": len(cases),
        "hotpotqa_examples": [args.offset, args.offset + args.examples - 1],
        "synthetic_seeds": [args.seed, args.seed + args.examples - 1],
        "rule": "kept when the paired mean KL difference to the current best is < 0 and its 95% bootstrap CI "
                f"excludes 0 ({MIN_PAIRS}+ pairs)",
        "steps": steps,
    }
    path = args.output or calibration_path(model)
    fingerprint = model_fingerprint(model_dir)
    kept = load_calibration(path) if path.exists() else None
    if kept is None or not kept.matches(fingerprint):
        kept = None
    # the file's budget model stays: it was fitted on its own run (calibrate --budget)
    calibration = Calibration(model, fingerprint, changed_knobs(best), evidence,
                              budget_model=kept.budget_model if kept else None,
                              budget_evidence=kept.budget_evidence if kept else {})
    if not calibration.knobs and calibration.budget_model is None and args.output is None:
        print(f"\ncalibration of {model}: no knob differs from the defaults; nothing written "
              f"({calibration_path(model)} left as it is)")
        return calibration
    path = save_calibration(calibration, path)
    print(f"\ncalibration of {model}: {calibration.describe()}\nwritten to {path}")
    return calibration


if __name__ == "__main__":
    main()
