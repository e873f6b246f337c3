"""The statistics of ``bench_quality``'s rows: per-cell summaries, paired KL differences against a
reference policy, and the comparison at equal median TTFT.

A row is one answer (``bench_quality.result_row``): ``format``, ``task``, ``example_id``, ``policy``,
``anchor_ratio`` (None for the baselines), the metrics of :data:`METRICS`, ``ttft_s``,
``latency_s``, ``prompt_tokens`` and the plugin's report ``relaxkv``. A cell is a (format, task)
pair; :data:`ALL` pools the formats or the tasks. No server here: a merged or reloaded result is
summarized by the same functions.
"""

from __future__ import annotations

import statistics
from typing import Iterable

import numpy as np

from benchmarks import metrics
from relaxkv_sglang.repair.policies import Policy

__all__ = ["ALL", "ANSWER_METRICS", "METRICS", "REPORT_KEYS", "in_cell", "achieved_ratio", "summarize",
           "summarize_all", "paired_cell", "paired_all", "equal_ttft"]

ALL = "all"  # the pooled task, the pooled format
ANSWER_METRICS = ("score", "f1_to_full", "exact_to_full")  # need the whole answer: None with --kl-only
METRICS = (*ANSWER_METRICS, "top1_to_full", "kl_first_token")
REPORT_KEYS = (("anchor_ratio", "anchor_ratio_achieved"), ("context_ratio", "context_ratio"),
               ("repair_kv_pairs", "repair_kv_pairs"), ("repair_kv_pairs_executed", "repair_kv_pairs_executed"))


def in_cell(row: dict, fmt: str, task: str) -> bool:
    """Whether ``row`` belongs to the (format, task) cell; ``"all"`` pools."""
    return fmt in (ALL, row["format"]) and task in (ALL, row["task"])


def achieved_ratio(rows: Iterable[dict]) -> float | None:
    """Mean anchor ratio the plugin reports it achieved over ``rows`` (None: no repair reported)."""
    return metrics.mean(r["relaxkv"]["anchor_ratio"] for r in rows if r["relaxkv"].get("anchor_ratio") is not None)


def summarize(rows: list[dict]) -> dict:
    """Means (with paired bootstrap CIs) and the TTFT median of one (format, task, policy, ratio) cell.

    A metric no row has (the answer metrics with ``--kl-only``) is None, its interval too.
    """
    out: dict = {"n": len(rows)}
    for key in METRICS:
        values = [r[key] for r in rows if r.get(key) is not None]
        out[key] = metrics.mean(values)
        out[key + "_ci95"] = metrics.bootstrap_ci(values)
    out["ttft_median_s"] = statistics.median(r["ttft_s"] for r in rows) if rows else None
    out["latency_s"] = metrics.mean(r["latency_s"] for r in rows)
    out["prompt_tokens"] = metrics.mean(r["prompt_tokens"] for r in rows)
    for key, name in REPORT_KEYS:
        out[name] = metrics.mean(r["relaxkv"][key] for r in rows if r["relaxkv"].get(key) is not None)
    return out


def summarize_all(rows: list[dict], formats: list[str], tasks: list[str],
                  cfgs: list[tuple[str, float | None]]) -> list[dict]:
    """One summary per (format, task, policy, ratio); format and task ``"all"`` pool the formats / tasks."""
    out = []
    for fmt in [*formats, ALL]:
        for task in [*tasks, ALL]:
            for policy, ratio in cfgs:
                cell = [r for r in rows if in_cell(r, fmt, task) and r["policy"] == policy
                        and r["anchor_ratio"] == ratio]
                out.append({"format": fmt, "task": task, "policy": policy, "anchor_ratio": ratio, **summarize(cell)})
    return out


def paired_cell(rows: list[dict], policy: tuple[str, float | None], versus: tuple[str, float | None]) -> dict:
    """First-token KL of ``policy`` minus ``versus`` (each a ``(policy, ratio)``) over the examples of ``rows``.

    The unit is the example (task, id): its difference is the mean over the formats in ``rows``;
    the CI resamples examples (:func:`metrics.paired_bootstrap_ci`). Wins, ties and losses count
    (example, format) pairs; a win is a lower KL for ``policy``.
    """
    mine = {(r["format"], r["task"], r["example_id"]): r for r in rows if (r["policy"], r["anchor_ratio"]) == policy}
    per_example: dict[tuple[str, str], list[tuple[float, float]]] = {}
    a_rows, b_rows = [], []
    for r in rows:
        if (r["policy"], r["anchor_ratio"]) != versus or (r["format"], r["task"], r["example_id"]) not in mine:
            continue
        own = mine[(r["format"], r["task"], r["example_id"])]
        a_rows.append(own)
        b_rows.append(r)
        per_example.setdefault((r["task"], r["example_id"]), []).append((own["kl_first_token"], r["kl_first_token"]))
    a = [metrics.mean(x for x, _ in pairs) for pairs in per_example.values()]
    b = [metrics.mean(y for _, y in pairs) for pairs in per_example.values()]
    wins, ties, losses = metrics.win_counts([r["kl_first_token"] for r in a_rows],
                                            [r["kl_first_token"] for r in b_rows])
    return {"n_examples": len(a), "n_pairs": len(a_rows), "kl": metrics.mean(a), "kl_versus": metrics.mean(b),
            "diff": metrics.mean(x - y for x, y in zip(a, b)), "diff_ci95": metrics.paired_bootstrap_ci(a, b),
            "wins": wins, "ties": ties, "losses": losses,
            "anchor_ratio_achieved": achieved_ratio(a_rows), "anchor_ratio_achieved_versus": achieved_ratio(b_rows)}


def paired_all(rows: list[dict], formats: list[str], tasks: list[str], cfgs: list[tuple[str, float | None]],
               versus: str) -> list[dict]:
    """Paired KL differences against ``versus`` per (format, task, ratio) and policy, ``"all"`` pooling.

    At each anchor ratio every other policy but ``full`` is compared (``pic`` with its one answer);
    ``versus`` at that ratio (once, if it is a baseline). Empty when ``versus`` was not run.
    """
    if versus not in {p for p, _ in cfgs}:
        return []
    ratios = sorted({r for _, r in cfgs if r is not None})
    out = []
    for fmt in [*formats, ALL]:
        for task in [*tasks, ALL]:
            cell = [r for r in rows if in_cell(r, fmt, task)]
            for ratio in ratios:
                ref = (versus, ratio if Policy(versus).repairs else None)
                for policy, r in cfgs:
                    if policy in ("full", versus) or r not in (None, ratio):
                        continue
                    out.append({"format": fmt, "task": task, "anchor_ratio": ratio, "policy": policy,
                                "policy_anchor_ratio": r, "versus": versus,
                                **paired_cell(cell, (policy, r), ref)})
    return out


PolicyPoint = tuple[str, "float | None"]  # (policy, anchor ratio)


def _curve_stats(rows: list[dict], units: dict[tuple[str, str], int],
                 weights: "np.ndarray") -> dict[PolicyPoint, tuple["np.ndarray", "np.ndarray"]]:
    """(median TTFT, mean first-token KL) of each swept (policy, ratio) over ``rows``, once per
    weighting of the examples.

    Args:
        rows: the cell's rows; units: the index of each example (task, id) in ``weights``.
        weights: float64 [n_weightings, n_examples] how many times each example counts (a
            bootstrap resample's draws; all ones: the rows as measured).
    Returns:
        per point, float64 [n_weightings] medians (as ``statistics.median`` of the repeated rows)
        and means.
    """
    by_cfg: dict[PolicyPoint, list[dict]] = {}
    for r in rows:
        if r["anchor_ratio"] is not None:
            by_cfg.setdefault((r["policy"], r["anchor_ratio"]), []).append(r)
    out = {}
    for cfg, rs in by_cfg.items():
        rs = sorted(rs, key=lambda r: r["ttft_s"])
        ttft = np.array([r["ttft_s"] for r in rs])
        kl = np.array([r["kl_first_token"] for r in rs])
        w = weights[:, [units[(r["task"], r["example_id"])] for r in rs]]  # [n_weightings, rows]
        cum, n = w.cumsum(axis=1), w.sum(axis=1)
        # The sorted repeated rows' elements at positions (n-1)//2 and n//2: the row whose run covers them.
        lower = (cum <= ((n - 1) // 2)[:, None]).sum(axis=1)
        upper = (cum <= (n // 2)[:, None]).sum(axis=1)
        out[cfg] = ((ttft[lower] + ttft[upper]) / 2, (w @ kl) / n)
    return out


def _on_curve(curve: list[tuple[float, float]], t: float) -> tuple[str, float]:
    """(where, KL) of the (TTFT, KL) ``curve`` (sorted by TTFT) at TTFT ``t``: linear between the two
    points that bracket ``t``, else the nearest end point (no extrapolation)."""
    if t <= curve[0][0]:
        return "cheaper", curve[0][1]
    if t >= curve[-1][0]:
        return "dearer", curve[-1][1]
    (t0, k0), (t1, k1) = next((a, b) for a, b in zip(curve, curve[1:]) if a[0] <= t <= b[0])
    return "between", k0 + (k1 - k0) * (t - t0) / (t1 - t0)


def equal_ttft(rows: list[dict], formats: list[str], versus: str, *, rounds: int = 1000,
               seed: int = 0) -> list[dict]:
    """Each policy point against ``versus``'s KL-vs-TTFT curve at the same median TTFT (tasks pooled).

    ``versus``'s points (one per anchor ratio: median TTFT, mean KL) are joined in order of TTFT;
    a policy point whose TTFT lies between two of them is compared with the straight line between
    them (``where``: ``"between"``), one cheaper or dearer than all of them with ``versus``'s
    cheapest or dearest point (``"cheaper"``, ``"dearer"``: no interpolation past the measured
    curve). ``gap`` is the point's KL minus that curve KL (negative: below the curve).

    Its 95% interval resamples the examples (task, id) with replacement, ``rounds`` times, each
    keeping all its rows (every policy, ratio and format: the comparison stays paired), and
    recomputes every median TTFT, mean KL, the curve and the gap: it carries the examples'
    spread in both TTFT and KL (not the machine's drift between runs, which all rows of a run
    share). ``verdict``: ``below`` / ``above`` when the interval excludes 0, else ``level``.

    Rows: ``format``, ``policy``, ``anchor_ratio``, ``ttft_s``, ``kl``, ``kl_versus_at_ttft``,
    ``where``, ``below`` (the point estimate is lower), ``gap``, ``gap_ci95``, ``verdict``.
    Baselines and ``versus`` itself get no row.
    """
    out = []
    for fmt in formats:
        cell = [r for r in rows if in_cell(r, fmt, ALL)]
        if not cell:
            continue
        units = {u: i for i, u in enumerate(sorted({(r["task"], r["example_id"]) for r in cell}))}
        n = len(units)
        draws = np.random.default_rng(seed).integers(0, n, size=(rounds, n))
        weights = np.ones((rounds + 1, n))  # row 0: the examples as measured; then the resamples
        weights[1:] = np.apply_along_axis(np.bincount, 1, draws, minlength=n)
        stats = _curve_stats(cell, units, weights)
        versus_points = [v for (policy, _), v in stats.items() if policy == versus]
        if not versus_points:
            continue
        curves = [sorted((vt[k], vk[k]) for vt, vk in versus_points) for k in range(rounds + 1)]
        for (policy, ratio), (t, kl) in sorted((kv for kv in stats.items() if kv[0][0] != versus),
                                               key=lambda kv: kv[0]):
            gaps = [kl[k] - _on_curve(curve, t[k])[1] for k, curve in enumerate(curves)]
            where = _on_curve(curves[0], t[0])[0]
            lo, hi = metrics.percentile(gaps[1:], 2.5), metrics.percentile(gaps[1:], 97.5)
            out.append({"format": fmt, "policy": policy, "anchor_ratio": ratio, "ttft_s": float(t[0]),
                        "kl": float(kl[0]), "kl_versus_at_ttft": float(kl[0] - gaps[0]), "where": where,
                        "below": bool(gaps[0] < 0), "gap": float(gaps[0]), "gap_ci95": (float(lo), float(hi)),
                        "verdict": "below" if hi < 0 else "above" if lo > 0 else "level"})
    return out
