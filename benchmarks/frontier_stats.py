"""The statistics of ``bench_frontier``: each policy's KL against its *measured* repair cost, and
paired comparisons of two policies at equal measured cost.

Rows are ``bench_quality.result_row`` rows (``task``, ``example_id``, ``format``, ``policy``,
``anchor_ratio``, ``kl_first_token``, ``ttft_s``, the plugin's report ``relaxkv``) of one run in
which ``pic`` and every repair point answered the same prompts, interleaved. A *unit* is one
(task, example id, format): one prompt. No server here.

Costs (:func:`add_costs`), per repair row, against ``pic``'s answer to the same prompt:

* ``extra_ttft_s``: the row's TTFT minus ``pic``'s TTFT on the same prompt in the same run;
* ``token_layers``: the anchors' recomputed token-layers (``anchors_per_layer`` x layers; the
  glue and query rows every repair recomputes alike are left out);
* ``pairs``: the (row, key) pairs the anchors attended (``repair_kv_pairs``);
* ``work``: ``token_layers + pair_cost * pairs``, in token-layers (``pair_cost`` from
  ``core.repair_config.RepairCost``: the model's multiply-add ratio times the device's measured
  attention overhead).

Equal measured cost, two ways (:func:`equal_work`, :func:`equal_ttft_gap`), each asking "what
KL would the peer have at the cost this point of the method spent":

* **work, per prompt.** Work counts are exact per request, so every unit has its own curve per
  policy (its points over the ratios, sorted by work); the peer's KL is interpolated linearly at
  the method's work on that same prompt, and the difference is paired per prompt. A unit whose
  method work lies outside the peer's measured range on that prompt is left out (no
  extrapolation; ``n_outside`` counts them). An example's difference is the mean over its
  formats; the 95% interval resamples examples.
* **TTFT, per cell.** One request's TTFT on a shared 2-core machine moves by more than the step
  between neighbouring ratios, so per-prompt TTFT curves would cross themselves. The cost
  coordinate is therefore each point's *median* extra TTFT over the cell's prompts; the peer's
  curve joins its (median extra TTFT, mean KL) points, and ``gap`` is the method's mean KL minus
  the curve at the method's median. The interval resamples examples (all their rows), recomputing
  every median and mean; resamples in which the point falls outside the peer's curve are
  counted (``outside_share``), not extrapolated.
"""

from __future__ import annotations

import statistics
from typing import Iterable, Sequence

import numpy as np

from benchmarks import metrics

__all__ = ["ALL", "COSTS", "unit_of", "add_costs", "interpolate", "frontier_points", "equal_work",
           "equal_ttft_gap", "equal_cost_all"]

ALL = "all"
COSTS = ("extra_ttft_s", "token_layers", "pairs", "work")
Unit = tuple[str, str, str]  # (task, example id, format)


def unit_of(row: dict) -> Unit:
    """The prompt a row answered: (task, example id, format)."""
    return row["task"], row["example_id"], row["format"]


def add_costs(rows: Iterable[dict], n_layers: int, pair_cost: float) -> list[dict]:
    """``rows`` with the costs of the module doc added (copies; the input is not changed).

    ``pic`` rows cost 0; ``full`` rows and rows of a prompt without a ``pic`` answer get None;
    a repair row without a repair report (not repaired) gets None work counts.
    """
    rows = list(rows)
    pic_ttft = {unit_of(r): r["ttft_s"] for r in rows if r["policy"] == "pic"}
    out = []
    for r in rows:
        r = dict(r)
        base = pic_ttft.get(unit_of(r))
        if r["policy"] == "pic":
            r.update(extra_ttft_s=0.0, token_layers=0.0, pairs=0.0, work=0.0)
        elif r["policy"] == "full" or base is None:
            r.update(dict.fromkeys(COSTS))
        else:
            report = r.get("relaxkv") or {}
            per_layer, pairs = report.get("anchors_per_layer"), report.get("repair_kv_pairs")
            token_layers = None if per_layer is None else per_layer * n_layers
            r.update(extra_ttft_s=r["ttft_s"] - base, token_layers=token_layers,
                     pairs=None if pairs is None else float(pairs),
                     work=None if token_layers is None or pairs is None else token_layers + pair_cost * pairs)
        out.append(r)
    return out


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """The piecewise-linear curve through ``(xs[i], ys[i])`` (any order) at ``x``; None outside
    ``[min(xs), max(xs)]`` (no extrapolation). Points at the same x are averaged."""
    merged: dict[float, list[float]] = {}
    for xi, yi in zip(xs, ys):
        merged.setdefault(float(xi), []).append(float(yi))
    pts = sorted((xi, sum(v) / len(v)) for xi, v in merged.items())
    if not pts or x < pts[0][0] or x > pts[-1][0]:
        return None
    if len(pts) == 1 or x == pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None  # unreachable: x lies in the range


def _in_cell(row: dict, fmt: str) -> bool:
    return fmt in (ALL, row["format"])


def frontier_points(rows: list[dict], fmt: str) -> list[dict]:
    """One point per (policy, ratio) of the cell ``fmt`` (``"all"`` pools the formats), ``pic`` included:
    mean KL with its 95% bootstrap interval, median extra TTFT, mean work counts, achieved ratio."""
    groups: dict[tuple[str, float | None], list[dict]] = {}
    for r in rows:
        if _in_cell(r, fmt) and r["policy"] != "full":
            groups.setdefault((r["policy"], r["anchor_ratio"]), []).append(r)
    out = []
    for (policy, ratio), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0.0)):
        extra = [r["extra_ttft_s"] for r in rs if r.get("extra_ttft_s") is not None]
        kls = [r["kl_first_token"] for r in rs]
        out.append({
            "format": fmt, "policy": policy, "anchor_ratio": ratio, "n": len(rs),
            "kl": metrics.mean(kls), "kl_ci95": metrics.bootstrap_ci(kls),
            "extra_ttft_median_s": statistics.median(extra) if extra else None,
            "ttft_median_s": statistics.median(r["ttft_s"] for r in rs),
            "anchor_ratio_achieved": metrics.mean(r["relaxkv"]["anchor_ratio"] for r in rs
                                                  if (r.get("relaxkv") or {}).get("anchor_ratio") is not None),
            **{key: metrics.mean(r[key] for r in rs if r.get(key) is not None)
               for key in ("token_layers", "pairs", "work")}})
    return out


def _by_point(rows: list[dict], policy: str) -> dict[float, dict[Unit, dict]]:
    """``policy``'s rows by ratio, then by unit."""
    out: dict[float, dict[Unit, dict]] = {}
    for r in rows:
        if r["policy"] == policy and r["anchor_ratio"] is not None:
            out.setdefault(r["anchor_ratio"], {})[unit_of(r)] = r
    return out


def equal_work(rows: list[dict], fmt: str, method: str, peer: str, *, cost: str = "work") -> list[dict]:
    """Per ratio of ``method``: its KL minus ``peer``'s KL at the same ``cost`` on the same prompt
    (module doc: "work, per prompt"). Rows: ``ratio``, ``n_units`` compared, ``n_outside``,
    ``n_examples``, ``cost`` (mean of the method's), ``kl``, ``kl_peer_at_cost``, ``diff``,
    ``diff_ci95``, ``wins``/``ties``/``losses`` over units (a win: the method's KL is lower)."""
    cell = [r for r in rows if _in_cell(r, fmt)]
    mine, theirs = _by_point(cell, method), _by_point(cell, peer)
    out = []
    for ratio, units in sorted(mine.items()):
        per_example: dict[tuple[str, str], list[float]] = {}
        a, b, costs, outside = [], [], [], 0
        for unit, row in units.items():
            x = row.get(cost)
            pts = [(t[unit][cost], t[unit]["kl_first_token"]) for t in theirs.values()
                   if unit in t and t[unit].get(cost) is not None]
            at = None if x is None or not pts else interpolate([p[0] for p in pts], [p[1] for p in pts], x)
            if at is None:
                outside += 1
                continue
            a.append(row["kl_first_token"])
            b.append(at)
            costs.append(x)
            per_example.setdefault(unit[:2], []).append(row["kl_first_token"] - at)
        diffs = [metrics.mean(v) for v in per_example.values()]
        wins, ties, losses = metrics.win_counts(a, b)
        out.append({"format": fmt, "method": method, "peer": peer, "cost": cost, "ratio": ratio,
                    "n_units": len(a), "n_outside": outside, "n_examples": len(diffs),
                    "method_cost": metrics.mean(costs), "kl": metrics.mean(a), "kl_peer_at_cost": metrics.mean(b),
                    "diff": metrics.mean(diffs), "diff_ci95": metrics.bootstrap_ci(diffs),
                    "wins": wins, "ties": ties, "losses": losses})
    return out


def equal_ttft_gap(rows: list[dict], fmt: str, method: str, peer: str, *, rounds: int = 1000,
                   seed: int = 0) -> list[dict]:
    """Per ratio of ``method``: its mean KL minus ``peer``'s (median extra TTFT, mean KL) curve at
    the method's median extra TTFT (module doc: "TTFT, per cell"). Rows: ``ratio``,
    ``extra_ttft_s``, ``kl``, ``kl_peer_at_cost`` (None when the point lies outside the peer's
    curve: ``where`` is then ``cheaper``/``dearer``), ``gap``, ``gap_ci95``, ``outside_share``
    (of the resamples), ``verdict`` (``below``/``above`` when the interval excludes 0, else ``level``)."""
    cell = [r for r in rows if _in_cell(r, fmt) and r.get("extra_ttft_s") is not None]
    mine, theirs = _by_point(cell, method), _by_point(cell, peer)
    examples = sorted({unit_of(r)[:2] for r in cell})
    if not mine or not theirs or not examples:
        return []
    index = {e: i for i, e in enumerate(examples)}
    rng = np.random.default_rng(seed)
    draws = [np.arange(len(examples))] + [rng.integers(0, len(examples), len(examples)) for _ in range(rounds)]
    weights = [np.bincount(d, minlength=len(examples)) for d in draws]

    def arrays(units: dict[Unit, dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(extra TTFT, KL, example index) of one point's rows."""
        rs = list(units.items())
        return (np.array([r["extra_ttft_s"] for _, r in rs]), np.array([r["kl_first_token"] for _, r in rs]),
                np.array([index[u[:2]] for u, _ in rs]))

    def point(data: tuple[np.ndarray, np.ndarray, np.ndarray], w: np.ndarray) -> tuple[float, float]:
        """(median extra TTFT, mean KL) of one point with example weights ``w`` (rows repeated)."""
        extra, kl, idx = data
        counts = w[idx]
        return float(np.median(np.repeat(extra, counts))), float((kl * counts).sum() / counts.sum())

    mine_data = {ratio: arrays(units) for ratio, units in mine.items()}
    peer_data = [arrays(units) for units in theirs.values()]
    curves = [[point(d, w) for d in peer_data] for w in weights]  # the peer's curve, once per resample
    out = []
    for ratio, data in sorted(mine_data.items()):
        results = []
        for w, curve in zip(weights, curves):
            x, kl = point(data, w)
            results.append((x, kl, interpolate([c[0] for c in curve], [c[1] for c in curve], x)))
        x, kl, at = results[0]
        boot = [kl_b - at_b for _, kl_b, at_b in results[1:] if at_b is not None]
        lo_x = min(c[0] for c in curves[0])
        where = "between" if at is not None else "cheaper" if x < lo_x else "dearer"
        ci = (metrics.percentile(boot, 2.5), metrics.percentile(boot, 97.5)) if boot and at is not None else None
        out.append({"format": fmt, "method": method, "peer": peer, "cost": "extra_ttft_s", "ratio": ratio,
                    "extra_ttft_s": x, "kl": kl, "kl_peer_at_cost": at, "where": where,
                    "gap": None if at is None else kl - at, "gap_ci95": ci,
                    "outside_share": 1 - len(boot) / rounds if rounds else 0.0,
                    "verdict": None if ci is None else "below" if ci[1] < 0 else "above" if ci[0] > 0 else "level"})
    return out


def equal_cost_all(rows: list[dict], formats: list[str], method: str, peers: list[str]) -> dict[str, list[dict]]:
    """Every comparison of ``method`` with each of ``peers``, per format and pooled (``"all"``):
    ``{"work": equal_work rows, "extra_ttft_s": equal_ttft_gap rows}``."""
    cells = [*formats, ALL] if len(formats) > 1 else list(formats)
    return {"work": [row for f in cells for p in peers for row in equal_work(rows, f, method, p)],
            "extra_ttft_s": [row for f in cells for p in peers for row in equal_ttft_gap(rows, f, method, p)]}
