"""Unit tests of bench_frontier's pure parts: costs against pic, interpolation, the paired comparisons
at equal work and at equal median extra TTFT, merging (no server)."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import bench_frontier, frontier_stats
from benchmarks.frontier_stats import ALL

N_LAYERS, PAIR_COST = 30, 1e-3
RATIOS = (0.05, 0.10, 0.15, 0.20)


def row(policy, ratio, example, fmt="plain", *, kl, ttft, per_layer=None, pairs=None, task="hotpotqa"):
    report = {} if per_layer is None else {"anchor_ratio": ratio, "anchors_per_layer": per_layer,
                                           "repair_kv_pairs": pairs}
    return {"task": task, "example_id": str(example), "format": fmt, "policy": policy, "anchor_ratio": ratio,
            "kl_first_token": kl, "ttft_s": ttft, "relaxkv": report}


# ------------------------------------------------------------------ interpolation


def test_interpolate_is_linear_inside_and_none_outside():
    xs, ys = [30.0, 10.0, 20.0], [0.1, 0.5, 0.3]  # any order
    assert frontier_stats.interpolate(xs, ys, 15.0) == pytest.approx(0.4)
    assert frontier_stats.interpolate(xs, ys, 10.0) == pytest.approx(0.5)
    assert frontier_stats.interpolate(xs, ys, 30.0) == pytest.approx(0.1)
    assert frontier_stats.interpolate(xs, ys, 9.999) is None  # no extrapolation
    assert frontier_stats.interpolate(xs, ys, 30.001) is None
    assert frontier_stats.interpolate([], [], 1.0) is None


def test_interpolate_averages_points_at_the_same_cost():
    assert frontier_stats.interpolate([1.0, 1.0, 3.0], [0.2, 0.4, 0.1], 2.0) == pytest.approx((0.3 + 0.1) / 2)
    assert frontier_stats.interpolate([5.0], [0.7], 5.0) == pytest.approx(0.7)


# ------------------------------------------------------------------ costs


def test_costs_are_measured_against_pic_on_the_same_prompt():
    rows = [row("pic", None, 1, kl=0.5, ttft=0.2), row("pic", None, 2, kl=0.5, ttft=1.0),
            row("relaxkv", 0.1, 1, kl=0.1, ttft=0.7, per_layer=20.0, pairs=4000),
            row("relaxkv", 0.1, 2, kl=0.1, ttft=1.2, per_layer=10.0, pairs=0),
            row("relaxkv", 0.1, 3, kl=0.1, ttft=1.2, per_layer=10.0, pairs=0),  # no pic answer for prompt 3
            row("full", None, 1, kl=0.0, ttft=2.0)]
    out = frontier_stats.add_costs(rows, N_LAYERS, PAIR_COST)
    assert "work" not in rows[2]  # the input rows are left as they were
    pic, _, a, b, orphan, full = out
    assert (pic["extra_ttft_s"], pic["work"]) == (0.0, 0.0)
    assert a["extra_ttft_s"] == pytest.approx(0.5) and b["extra_ttft_s"] == pytest.approx(0.2)
    assert a["token_layers"] == pytest.approx(600.0) and a["pairs"] == 4000
    assert a["work"] == pytest.approx(600.0 + 4.0)
    assert orphan["extra_ttft_s"] is None and full["work"] is None


# ------------------------------------------------------------------ equal work, per prompt


def _curves(examples, formats=("plain",), *, method_offset=-0.02, ttft_noise=0.0):
    """Peer KL = 0.5 - work/1000 on a work grid 100..400; the method's points at work 150/250/350
    lie ``method_offset`` off that line; example e's costs scaled by (1 + e/10)."""
    rows = []
    for e in range(examples):
        for fmt in formats:
            scale = 1 + e / 10
            rows.append(row("pic", None, e, fmt, kl=0.6, ttft=0.1))
            for i, work in enumerate((100, 200, 300, 400)):
                w = work * scale
                rows.append(row("prophetkv", RATIOS[i], e, fmt, kl=0.5 - w / 1000, ttft=0.1 + w / 1000,
                                per_layer=w / N_LAYERS, pairs=0))
            for i, work in enumerate((50, 150, 250, 350)):
                w = work * scale
                noise = ttft_noise * (1 if (e + i) % 2 else -1)
                rows.append(row("relaxkv", RATIOS[i], e, fmt, kl=0.5 - w / 1000 + method_offset,
                                ttft=0.1 + w / 1000 + noise, per_layer=w / N_LAYERS, pairs=0))
    return frontier_stats.add_costs(rows, N_LAYERS, PAIR_COST)


def test_equal_work_pairs_each_prompt_with_the_peer_at_its_own_work():
    rows = _curves(8)
    out = {r["ratio"]: r for r in frontier_stats.equal_work(rows, "plain", "relaxkv", "prophetkv")}
    cheapest = out[0.05]  # work 50 x scale: below the peer's cheapest point on every prompt
    assert (cheapest["n_units"], cheapest["n_outside"], cheapest["diff"]) == (0, 8, None)
    for ratio in (0.10, 0.15, 0.20):
        r = out[ratio]
        assert (r["n_units"], r["n_outside"], r["n_examples"]) == (8, 0, 8)
        assert r["diff"] == pytest.approx(-0.02)
        lo, hi = r["diff_ci95"]
        assert lo == pytest.approx(-0.02) and hi == pytest.approx(-0.02)
        assert (r["wins"], r["ties"], r["losses"]) == (8, 0, 0)
        assert r["kl"] - r["kl_peer_at_cost"] == pytest.approx(-0.02)


def test_equal_work_averages_an_example_over_its_formats_and_pools():
    rows = _curves(6, formats=("plain", "tagged"))
    # In tagged the method is worse than the peer by 0.04: pooled, each example's difference is
    # the mean of -0.02 and +0.04.
    for r in rows:
        if r["format"] == "tagged" and r["policy"] == "relaxkv":
            r["kl_first_token"] += 0.06
    pooled = {r["ratio"]: r for r in frontier_stats.equal_work(rows, ALL, "relaxkv", "prophetkv")}[0.15]
    assert (pooled["n_units"], pooled["n_examples"]) == (12, 6)
    assert pooled["diff"] == pytest.approx(0.01)
    assert (pooled["wins"], pooled["losses"]) == (6, 6)
    tagged = {r["ratio"]: r for r in frontier_stats.equal_work(rows, "tagged", "relaxkv", "prophetkv")}[0.15]
    assert tagged["diff"] == pytest.approx(0.04) and tagged["diff_ci95"][0] > 0


# ------------------------------------------------------------------ equal median extra TTFT


def test_equal_ttft_gap_uses_medians_and_leaves_points_outside_the_curve():
    rows = _curves(10, ttft_noise=0.01)  # one prompt's TTFT off by 0.01 s either way
    out = {r["ratio"]: r for r in frontier_stats.equal_ttft_gap(rows, "plain", "relaxkv", "prophetkv", rounds=200)}
    assert out[0.05]["where"] == "cheaper" and out[0.05]["gap"] is None and out[0.05]["verdict"] is None
    for ratio in (0.10, 0.15, 0.20):
        r = out[ratio]
        assert r["where"] == "between"
        # Without the noise the gap is -0.02 exactly (next test); the noise moves the medians a little.
        assert r["gap"] == pytest.approx(-0.02, abs=0.01)
        assert r["gap_ci95"][1] < 0 and r["verdict"] == "below"
    assert frontier_stats.equal_ttft_gap(rows, "plain", "relaxkv", "cacheblend") == []


def test_equal_ttft_gap_is_exact_without_noise():
    rows = _curves(5)
    r = {r["ratio"]: r for r in frontier_stats.equal_ttft_gap(rows, "plain", "relaxkv", "prophetkv", rounds=100)}[0.15]
    # Extra TTFT = work/1000 per prompt. The method's point: median scale 1.2 -> 0.30 s, mean KL
    # 0.5 - 0.30 - 0.02; the peer's (median, mean) points lie on KL = 0.5 - extra (median and mean
    # scale are both 1.2), so it has 0.20 there. In a resample the scales' median and mean differ,
    # alike for both curves, and the gap stays -0.02.
    assert r["extra_ttft_s"] == pytest.approx(0.30)
    assert r["kl_peer_at_cost"] == pytest.approx(0.20)
    assert r["gap"] == pytest.approx(-0.02, abs=1e-9)
    assert r["gap_ci95"] == pytest.approx((-0.02, -0.02))
    assert r["outside_share"] == 0.0 and r["verdict"] == "below"


def test_frontier_points_pool_formats_and_carry_costs():
    rows = _curves(4, formats=("plain", "tagged"))
    pts = {(p["policy"], p["anchor_ratio"]): p for p in frontier_stats.frontier_points(rows, ALL)}
    pic = pts[("pic", None)]
    assert pic["n"] == 8 and pic["work"] == 0.0 and pic["extra_ttft_median_s"] == 0.0
    p = pts[("prophetkv", 0.10)]
    assert p["n"] == 8 and p["work"] == pytest.approx(200 * (1 + 0.15))  # mean scale over e = 0..3
    assert p["kl_ci95"][0] <= p["kl"] <= p["kl_ci95"][1]


# ------------------------------------------------------------------ the tool around them


def _args(**kw):
    base = dict(model="smollm2-135m", split="dev", formats=["plain"], tasks=["hotpotqa"], documents=10,
                policies=["relaxkv", "prophetkv"], anchor_ratios=[0.05, 0.1, 0.15, 0.2], context_ratio=0.5,
                method="relaxkv", output=None)
    return argparse.Namespace(**{**base, **kw})


def _part(tmp_path, name, rows, args):
    raw = [{k: v for k, v in r.items() if k not in frontier_stats.COSTS} for r in rows]
    ids = sorted({r["example_id"] for r in raw})
    body = {"bench": bench_frontier.BENCH, "args": vars(args), "split": {"name": "dev", "offset": 0, "seed": 0},
            "tasks": {"hotpotqa": {"examples": len(ids), "example_ids": ids}}, "calibration": None,
            **bench_frontier.analyse(raw, args, N_LAYERS, PAIR_COST)}
    path = tmp_path / name
    path.write_text(json.dumps(body))
    return str(path)


def test_merge_pools_disjoint_parts_and_refuses_a_repeated_prompt(tmp_path, capsys):
    rows = _curves(6)
    a = _part(tmp_path, "a.json", [r for r in rows if int(r["example_id"]) < 3], _args())
    b = _part(tmp_path, "b.json", [r for r in rows if int(r["example_id"]) >= 3], _args())
    merged = bench_frontier.merge([a, b], _args())
    whole = bench_frontier.analyse([{k: v for k, v in r.items() if k not in frontier_stats.COSTS} for r in rows],
                                   _args(), N_LAYERS, PAIR_COST)
    assert merged["equal_work"] == whole["equal_work"] and merged["tasks"]["hotpotqa"]["examples"] == 6
    bench_frontier.print_report(merged, _args())
    assert "equal work" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="earlier part"):
        bench_frontier.merge([a, a], _args())
    c = _part(tmp_path, "c.json", rows, _args(anchor_ratios=[0.1]))
    with pytest.raises(RuntimeError, match="anchor_ratios"):
        bench_frontier.merge([a, c], _args())
