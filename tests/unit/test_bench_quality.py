"""Unit tests of bench_quality's pure parts: splits, per-format summaries, paired comparisons, tables (no server)."""

from __future__ import annotations

import argparse
import math
import random

import pytest

from benchmarks import bench_quality, metrics, prompt_formats, quality_stats, quality_tasks, run_all

# ------------------------------------------------------------ paired statistics


def test_paired_bootstrap_ci_excludes_zero_for_a_consistent_difference():
    rng = random.Random(3)
    b = [rng.uniform(0.05, 0.5) for _ in range(30)]
    a = [x + 0.02 + rng.uniform(-0.01, 0.01) for x in b]  # a is worse on every example, by 0.01-0.03
    lo, hi = metrics.paired_bootstrap_ci(a, b)
    mean_diff = metrics.mean(x - y for x, y in zip(a, b))
    assert 0.01 < lo <= mean_diff <= hi < 0.03  # excludes zero
    # Their marginal intervals overlap all the same: only the paired interval sees the difference.
    a_lo, a_hi = metrics.bootstrap_ci(a, seed=1)
    b_lo, b_hi = metrics.bootstrap_ci(b, seed=1)
    assert a_lo < b_hi and b_lo < a_hi


def test_paired_bootstrap_ci_includes_zero_when_the_signs_alternate():
    b = [0.1 * (i % 7 + 1) for i in range(20)]
    a = [x + (0.05 if i % 2 else -0.05) for i, x in enumerate(b)]
    lo, hi = metrics.paired_bootstrap_ci(a, b)
    assert lo < 0 < hi
    # The interval is that of the differences' mean, as bootstrap_ci gives it with the same seed.
    assert (lo, hi) == metrics.bootstrap_ci([x - y for x, y in zip(a, b)])


def test_bootstrap_edge_cases():
    assert metrics.bootstrap_ci([]) is None and metrics.paired_bootstrap_ci([], []) is None
    assert metrics.bootstrap_ci([0.25]) == (0.25, 0.25)  # one example: every resample is it
    assert metrics.paired_bootstrap_ci([1.0, 2.0], [1.0, 2.0]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="equal lengths"):
        metrics.paired_bootstrap_ci([1.0], [1.0, 2.0])
    values = [0.1, 0.5, 0.9, 0.3]
    assert metrics.bootstrap_ci(values, seed=5) == metrics.bootstrap_ci(values, seed=5)  # seeded


def test_win_counts_lower_wins_and_near_equal_ties():
    a = [0.1, 0.2, 0.3, 0.4, 0.5 + 1e-9]
    b = [0.2, 0.2, 0.1, 0.4, 0.5]
    assert metrics.win_counts(a, b) == (1, 3, 1)  # 0.1 < 0.2; 0.3 > 0.1; the rest tie (within 1e-6)
    assert metrics.win_counts(a, b, tol=0.0) == (1, 2, 2)
    assert metrics.win_counts([], []) == (0, 0, 0)
    with pytest.raises(ValueError):
        metrics.win_counts([1.0], [])


# ------------------------------------------------------------------- splits


def test_split_origins():
    assert bench_quality.split_origin("dev", bench_quality.TASKS, 10) == (0, 0)
    assert bench_quality.split_origin("test", bench_quality.TASKS, 10) == (3000, 1000)
    assert bench_quality.split_origin("test", bench_quality.TASKS, 100) == (3000, 1000)  # the whole test split
    assert bench_quality.split_origin("test", ["hotpotqa"], 200) == (3000, 1000)  # 3000-3199; no seeds used
    assert bench_quality.split_origin("test", ["hotpotqa"], 50, offset=3150) == (3150, 1000)
    assert bench_quality.split_origin("dev", ["squad"], 10, offset=5000, seed=990) == (5000, 990)  # no HotpotQA
    assert bench_quality.split_origin("dev", ["hotpotqa"], 100, offset=2900, seed=4000) == (2900, 4000)


@pytest.mark.parametrize("split, tasks, examples, offset, seed, message", [
    ("test", ["hotpotqa"], 201, None, None, "HotpotQA dev examples 3000-3199; this run would use 3000-3200"),
    ("test", ["hotpotqa"], 10, 0, None, "HotpotQA dev examples 3000-3199; this run would use 0-9"),
    ("test", ["niah_multivalue"], 101, None, None, "synthetic seeds 1000-1099; this run would use 1000-1100"),
    ("test", bench_quality.TASKS, 10, None, 0, "synthetic seeds 1000-1099; this run would use 0-9"),
    ("dev", ["hotpotqa"], 10, 2995, None, "HotpotQA dev examples 0-2999; this run would use 2995-3004"),
    ("dev", ["squad", "hotpotqa"], 10, None, 995, "synthetic seeds 0-999; this run would use 995-1004"),
    ("dev", ["variable_tracking"], 3, None, 1000, "synthetic seeds 0-999"),
])
def test_split_ranges_are_enforced(split, tasks, examples, offset, seed, message):
    with pytest.raises(ValueError, match=message):
        bench_quality.split_origin(split, tasks, examples, offset, seed)


def test_a_run_leaving_its_split_is_refused_in_one_line_before_any_server(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_quality.main(["--split", "test", "--tasks", "hotpotqa", "--examples", "201", "--url", "http://127.0.0.1:1"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench_quality: error: --split test allows HotpotQA")


# ------------------------------------------------------- rows from a fake server


class _FakeServer:
    """Answers like ServerClient: full's top tokens 1 (p=.6), 2 (.3), 3 (.1); other policies shift mass."""

    def __init__(self):
        self.flushed, self.warmed, self.asked = 0, [], []

    def flush(self):
        self.flushed += 1

    def generate(self, text, offsets=None, policy=None, **kwargs):
        self.warmed.append(prompt_formats.chunk_texts(text, offsets))
        return {"meta_info": {}}

    def generate_stream(self, text, offsets, policy, *, max_new_tokens, anchor_ratio=None, context_ratio=None,
                        top_logprobs=0, token_ids_logprob=None):
        self.asked.append((text, offsets, policy, max_new_tokens, anchor_ratio, context_ratio))
        probs = {1: 0.6, 2: 0.3, 3: 0.1} if policy in ("full", "relaxkv") else {1: 0.3, 2: 0.6, 3: 0.1}
        first = max(probs, key=probs.get)
        meta = {"output_token_logprobs": [(math.log(probs[first]), first, None)],
                "prompt_tokens": 100, "cached_tokens": 0 if policy == "full" else 90,
                "relaxkv": {"anchor_ratio": 0.2, "repair_kv_pairs": 10, "repair_kv_pairs_executed": 15}
                if anchor_ratio else None}
        if top_logprobs:
            meta["output_top_logprobs"] = [[(math.log(p), t, None) for t, p in probs.items()]]
        else:
            meta["output_token_ids_logprobs"] = [[(math.log(probs[t]), t, None) for t in token_ids_logprob]]
        return {"text": " Paris\nmore" if first == 1 else " Rome", "meta_info": meta, "ttft_s": 0.5,
                "latency_s": 1.0}


def _example() -> quality_tasks.TaskExample:
    return quality_tasks.TaskExample("hotpotqa", "ex1", "Sys.", ["A: one.", "B: two."], prompt_formats.question_text("Q?"),
                                 ["Paris"], "qa_f1", 16, titles=["A", "B"])


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"kl_only": False, "max_new_tokens": None, "context_ratio": 0.25, **kw})


@pytest.mark.parametrize("fmt", prompt_formats.PROMPT_FORMATS)
def test_answer_example_warms_and_asks_in_the_format(fmt):
    server, ex = _FakeServer(), _example()
    cfgs = bench_quality.configs(["full", "pic", "relaxkv"], [0.15])
    rows = bench_quality.answer_example(server, ex, fmt, cfgs, _args(), random.Random(0))
    assert server.flushed == 1
    assert server.warmed == [ex.chunk_documents(fmt)[::-1]]  # the format's chunks, reversed
    text, offsets = ex.marked(fmt)
    assert {(t, tuple(o)) for t, o, *_ in server.asked} == {(text, tuple(offsets))}
    assert server.asked[0][2] == "full" and all(a[3] == 16 for a in server.asked)
    by = {r["policy"]: r for r in rows}
    assert [r["policy"] for r in rows] == ["full", "pic", "relaxkv"] and all(r["format"] == fmt for r in rows)
    assert by["relaxkv"]["kl_first_token"] == pytest.approx(0.0, abs=1e-12)
    assert by["pic"]["kl_first_token"] == pytest.approx(0.6 * math.log(2) + 0.3 * math.log(0.5))
    assert (by["pic"]["top1_to_full"], by["relaxkv"]["top1_to_full"]) == (0.0, 1.0)
    assert (by["pic"]["score"], by["full"]["score"], by["pic"]["exact_to_full"]) == (0.0, 1.0, 0.0)
    assert by["relaxkv"]["relaxkv"]["repair_kv_pairs_executed"] == 15 and by["pic"]["relaxkv"] == {}


def test_kl_only_asks_one_token_and_scores_no_answer():
    server = _FakeServer()
    rows = bench_quality.answer_example(server, _example(), "plain", [("full", None), ("pic", None)],
                                        _args(kl_only=True, max_new_tokens=30), random.Random(0))
    assert all(a[3] == 1 for a in server.asked)
    assert all(r[k] is None for r in rows for k in bench_quality.ANSWER_METRICS)
    assert rows[1]["kl_first_token"] > 0 and rows[1]["top1_to_full"] == 0.0


# ---------------------------------------------------- summaries and comparisons


def _row(fmt, task, eid, policy, ratio, kl, *, achieved=None, kl_only=False):
    report = {} if ratio is None else {"anchor_ratio": achieved if achieved is not None else ratio,
                                       "repair_kv_pairs": 100, "repair_kv_pairs_executed": 150, "context_ratio": 0.25}
    answer = dict.fromkeys(bench_quality.ANSWER_METRICS) if kl_only else {
        "score": 0.5, "f1_to_full": 1.0 - kl, "exact_to_full": float(kl == 0)}
    return {"task": task, "format": fmt, "example_id": eid, "policy": policy, "anchor_ratio": ratio, **answer,
            "top1_to_full": float(kl < 0.1), "kl_first_token": kl, "ttft_s": 1.0 + kl, "latency_s": 2.0,
            "prompt_tokens": 100, "relaxkv": report}


def _rows(kl_only=False):
    """2 formats x 2 tasks x 2 examples; relaxkv beats prophetkv in ``document`` only, pic loses everywhere."""
    rows = []
    for fmt, relax_gap in (("plain", 0.01), ("document", -0.05)):
        for task in ("hotpotqa", "squad"):
            for i in range(2):
                base = 0.1 + 0.1 * i + (0.05 if task == "squad" else 0.0)
                rows += [_row(fmt, task, f"{task}{i}", "full", None, 0.0, kl_only=kl_only),
                         _row(fmt, task, f"{task}{i}", "pic", None, base + 0.3, kl_only=kl_only),
                         _row(fmt, task, f"{task}{i}", "prophetkv", 0.15, base, kl_only=kl_only),
                         _row(fmt, task, f"{task}{i}", "relaxkv", 0.15, base + relax_gap, kl_only=kl_only),
                         _row(fmt, task, f"{task}{i}", "cacheblend", 0.15, base + 0.1, achieved=0.207,
                              kl_only=kl_only)]
    return rows


CFGS = bench_quality.configs(["full", "pic", "prophetkv", "relaxkv", "cacheblend"], [0.15])


def test_summaries_per_format_task_and_pooled():
    summary = bench_quality.summarize_all(_rows(), ["plain", "document"], ["hotpotqa", "squad"], CFGS)
    cell = {(s["format"], s["task"], s["policy"], s["anchor_ratio"]): s for s in summary}
    assert len(summary) == 3 * 3 * len(CFGS)  # (2 formats + all) x (2 tasks + all) x configs
    assert cell[("plain", "hotpotqa", "relaxkv", 0.15)]["n"] == 2
    assert cell[("plain", "hotpotqa", "relaxkv", 0.15)]["kl_first_token"] == pytest.approx(0.16)  # .11, .21
    assert cell[("document", "hotpotqa", "relaxkv", 0.15)]["kl_first_token"] == pytest.approx(0.10)  # .05, .15
    assert cell[("document", "all", "relaxkv", 0.15)]["n"] == 4
    assert cell[("all", "hotpotqa", "relaxkv", 0.15)]["kl_first_token"] == pytest.approx(0.13)
    pooled = cell[("all", "all", "relaxkv", 0.15)]
    assert pooled["n"] == 8 and pooled["kl_first_token"] == pytest.approx(0.155)
    assert pooled["repair_kv_pairs"] == 100 and pooled["repair_kv_pairs_executed"] == 150
    assert cell[("all", "all", "cacheblend", 0.15)]["anchor_ratio_achieved"] == pytest.approx(0.207)
    assert cell[("all", "all", "pic", None)]["anchor_ratio_achieved"] is None
    lo, hi = pooled["kl_first_token_ci95"]
    assert lo <= pooled["kl_first_token"] <= hi


def test_kl_only_summaries_have_no_answer_metrics():
    summary = bench_quality.summarize_all(_rows(kl_only=True), ["plain", "document"], ["hotpotqa", "squad"], CFGS)
    s = next(s for s in summary if (s["format"], s["task"], s["policy"]) == ("all", "all", "relaxkv"))
    assert all(s[k] is None and s[k + "_ci95"] is None for k in bench_quality.ANSWER_METRICS)
    assert s["kl_first_token"] == pytest.approx(0.155) and s["top1_to_full"] is not None


def test_paired_comparisons_per_format_and_pooled():
    paired = bench_quality.paired_all(_rows(), ["plain", "document"], ["hotpotqa", "squad"], CFGS, "prophetkv")
    cell = {(p["format"], p["task"], p["policy"]): p for p in paired}
    assert {p["policy"] for p in paired} == {"pic", "relaxkv", "cacheblend"}  # not full, not the reference
    assert all(p["anchor_ratio"] == 0.15 and p["versus"] == "prophetkv" for p in paired)
    plain = cell[("plain", "all", "relaxkv")]
    assert (plain["wins"], plain["ties"], plain["losses"]) == (0, 0, 4)
    assert plain["diff"] == pytest.approx(0.01) and plain["diff_ci95"] == pytest.approx((0.01, 0.01))
    doc = cell[("document", "hotpotqa", "relaxkv")]
    assert (doc["wins"], doc["n_examples"], doc["diff"]) == (2, 2, pytest.approx(-0.05))
    assert doc["kl"] == pytest.approx(0.10) and doc["kl_versus"] == pytest.approx(0.15)
    # Formats pooled: one unit per example (its mean difference over the formats), pairs counted per format.
    pooled = cell[("all", "all", "relaxkv")]
    assert (pooled["n_examples"], pooled["n_pairs"]) == (4, 8)
    assert (pooled["wins"], pooled["ties"], pooled["losses"]) == (4, 0, 4)
    assert pooled["diff"] == pytest.approx(-0.02) and pooled["diff_ci95"] == pytest.approx((-0.02, -0.02))
    pic = cell[("all", "all", "pic")]
    assert pic["policy_anchor_ratio"] is None and pic["diff"] == pytest.approx(0.3) and pic["losses"] == 8
    blend = cell[("all", "all", "cacheblend")]
    assert blend["anchor_ratio_achieved"] == pytest.approx(0.207) and blend["anchor_ratio_achieved_versus"] == 0.15
    # A reference that was not run: no comparison; a baseline reference: every repair policy at each ratio.
    assert bench_quality.paired_all(_rows(), ["plain"], ["hotpotqa"], CFGS, "epic") == []
    versus_pic = bench_quality.paired_all(_rows(), ["plain", "document"], ["hotpotqa", "squad"], CFGS, "pic")
    assert {p["policy"] for p in versus_pic} == {"prophetkv", "relaxkv", "cacheblend"}
    assert next(p for p in versus_pic if (p["format"], p["task"], p["policy"]) == ("all", "all", "prophetkv"))[
        "wins"] == 8


def test_ratio_labels_and_report_blocks():
    assert bench_quality.ratio_label(0.15, 0.207) == "15%→20.7%"
    assert bench_quality.ratio_label(0.15, 0.1502) == "15%" and bench_quality.ratio_label(0.15, None) == "15%"
    assert bench_quality.ratio_label(None, None) == "-"
    assert bench_quality.blocks(["plain"], ["hotpotqa"]) == [("plain", "hotpotqa")]
    assert bench_quality.blocks(["plain", "chat"], ["hotpotqa"]) == [
        ("plain", "hotpotqa"), ("chat", "hotpotqa"), ("all", "hotpotqa")]
    assert bench_quality.blocks(["plain"], ["hotpotqa", "squad"])[-1] == ("plain", "all")


def _result(kl_only=False, versus="prophetkv"):
    rows = _rows(kl_only)
    fmts, tasks = ["plain", "document"], ["hotpotqa", "squad"]
    return {"split": {"name": "test", "offset": 3000, "seed": 1000}, "formats": fmts, "versus": versus,
            "kl_only": kl_only, "tasks": {t: {"examples": 2, "scorer": "qa_f1", "example_ids": []} for t in tasks},
            "summary": bench_quality.summarize_all(rows, fmts, tasks, CFGS),
            "paired": bench_quality.paired_all(rows, fmts, tasks, CFGS, versus), "per_example": rows}


def test_print_table_shows_formats_paired_rows_and_dashes_for_kl_only(capsys):
    args = argparse.Namespace(model="m", context_ratio=0.25)
    bench_quality.print_table(_result(kl_only=True), args)
    out = capsys.readouterr().out
    assert "split test (HotpotQA dev from 3000, synthetic seed 1000)" in out and "--kl-only" in out
    assert "format document / squad" in out and "all formats pooled / all" in out
    relax = next(line for line in out.splitlines() if line.startswith("relaxkv "))
    assert relax.split()[1:6] == ["15%", "15.0%", "-", "-", "-"]  # asked, achieved; score, F1, exact
    assert relax.split()[-2:] == ["100", "150"]  # visible and executed repair KV pairs
    assert "paired first-token KL, policy − prophetkv" in out
    blend = next(line for line in out.splitlines() if line.startswith("all       all") and "cacheblend" in line)
    assert "15%→20.7%" in blend and "0/0/8" in blend
    bench_quality.print_table(_result(versus="epic"), args)
    assert "no paired comparison: --versus epic" in capsys.readouterr().out


def test_plot_draws_every_panel(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "q.png"
    bench_quality.plot(_result(), path)
    assert path.stat().st_size > 0


def test_run_all_table_pools_formats_and_adds_the_paired_columns():
    result = {**_result(), "args": {"context_ratio": 0.25, "offset": 3000, "seed": 1000, "model": "m",
                                    "quick": False},
              "machine": {"cpus": 2, "platform": "Linux-x", "date": "2026-11-29T00:00:00"}, "bench": "bench_quality"}
    table = run_all.quality_table(result)
    assert "test split: HotpotQA dev from 3000" in table and "prompt formats plain, document (pooled)" in table
    assert "| KL − prophetkv, paired | W/T/L |" in table
    assert "| relaxkv | 0.155 [" in table and "| -0.020 [-0.020, -0.020] | 4/0/4 |" in table
    assert "| prophetkv | 0.175 [" in table and table.split("| prophetkv |")[1].split("\n")[0].endswith("- | - |")
    kl_only = {**result, **_result(kl_only=True)}
    kl_table = run_all.quality_table(kl_only)
    assert "one answer token (--kl-only): no task scores" in kl_table
    assert "| relaxkv | 0.155 [0.11, 0.20] | - | 0.130 / - | 0.180 / - | 1.16 | -0.020 [" in kl_table


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen2.5-0.5b"])
def test_chat_format_is_the_models_own_chat_template(model):
    """The ``chat`` format renders exactly what the model's own template does with a system turn and
    a user turn (then the answer's lead-in). Checked only where the model is already prepared: the
    test never downloads or converts one."""
    from relaxkv_sglang import assets

    folder = assets.cache_root() / "models" / model
    if not folder.is_dir() or assets.manifest_problem(folder) is not None:
        pytest.skip(f"{model} is not prepared here (relaxkv-sglang model {model})")
    tok = assets.load_tokenizer(folder)
    system, docs, question = "Answer briefly.", ["A: first doc.", "B: second doc."], "Question: Who?"
    text, offsets = prompt_formats.render_marked(system, docs, question + "\nAnswer:", "chat")
    user = "\n\n".join(docs) + "\n\n" + question
    rendered = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": user}],
                                       add_generation_prompt=True, tokenize=False)
    assert text == rendered + "Answer:"
    assert prompt_formats.chunk_texts(text, offsets) == docs


def _part(result: dict, ids: set, path) -> str:
    """``result`` cut to the examples ``ids``, written as a part file at ``path``."""
    import json

    part = {**result, "per_example": [r for r in result["per_example"] if r["example_id"] in ids],
            "tasks": {t: {**info, "example_ids": [i for i in info["example_ids"] if i in ids],
                          "examples": sum(i in ids for i in info["example_ids"])}
                      for t, info in result["tasks"].items()}}
    path.write_text(json.dumps(part))
    return str(path)


def test_merging_parts_gives_the_whole_runs_figures(tmp_path, capsys):
    """Two halves of a committed run, merged, give its means and win counts; overlap and mismatch refused."""
    import json
    import pathlib

    whole = json.loads((pathlib.Path(__file__).parents[2] / "docs/results/bench_quality_test_shift_sweep.json")
                       .read_text())
    ids = sorted({r["example_id"] for r in whole["per_example"]})
    a = _part(whole, set(ids[::2]), tmp_path / "a.json")
    b = _part(whole, set(ids[1::2]), tmp_path / "b.json")
    out = tmp_path / "merged.json"
    bench_quality.main(["--merge", a, b, "--output", str(out)])
    merged = json.loads(out.read_text())
    assert len(merged["per_example"]) == len(whole["per_example"])
    key = lambda p: (p["format"], p["task"], p["anchor_ratio"], p["policy"])  # noqa: E731
    want = {key(p): p for p in whole["paired"]}
    assert {key(p) for p in merged["paired"]} == set(want)
    for p in merged["paired"]:
        w = want[key(p)]
        assert (p["wins"], p["ties"], p["losses"], p["n_examples"]) == (w["wins"], w["ties"], w["losses"],
                                                                         w["n_examples"])
        assert p["diff"] == pytest.approx(w["diff"], abs=1e-12)
    assert "paired first-token KL" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_quality.main(["--merge", a, a, "--output", str(tmp_path / "twice.json")])
    assert "is in an earlier part" in capsys.readouterr().err
    other = json.loads(pathlib.Path(b).read_text())
    other["args"]["anchor_ratios"] = [0.15]
    (tmp_path / "c.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit):
        bench_quality.main(["--merge", a, str(tmp_path / "c.json"), "--output", str(tmp_path / "bad.json")])
    assert "anchor_ratios" in capsys.readouterr().err
    # A file written before --documents existed ran with 10 documents: it merges with a 10, not a 50.
    other = json.loads(pathlib.Path(b).read_text())
    other["args"]["documents"] = 50
    (tmp_path / "d.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit):
        bench_quality.main(["--merge", a, str(tmp_path / "d.json"), "--output", str(tmp_path / "bad.json")])
    assert "documents 50 differs" in capsys.readouterr().err
    other["args"]["documents"] = 10
    (tmp_path / "d.json").write_text(json.dumps(other))
    bench_quality.main(["--merge", a, str(tmp_path / "d.json"), "--output", str(tmp_path / "ok.json")])
    assert json.loads((tmp_path / "ok.json").read_text())["args"]["documents"] == 10
    # parts run against servers with different calibrations are not one run
    other["calibration"] = {"file": "/c/m.json", "model": "m", "version": 1, "knobs": {"context_ratio": 0.25}}
    (tmp_path / "e.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit):
        bench_quality.main(["--merge", a, str(tmp_path / "e.json"), "--output", str(tmp_path / "bad.json")])
    assert "calibration differs" in capsys.readouterr().err


def _timed(fmt, eid, policy, ratio, ttft, kl):
    return {"format": fmt, "task": "hotpotqa", "example_id": eid, "policy": policy, "anchor_ratio": ratio,
            "ttft_s": ttft, "kl_first_token": kl}


def test_equal_ttft_interpolates_the_versus_curve_and_says_where_it_could_not():
    points = [("pic", None, 0.2, 0.3), ("prophetkv", 0.05, 0.5, 0.10), ("prophetkv", 0.15, 0.9, 0.06),
              ("relaxkv", 0.05, 0.7, 0.07), ("relaxkv", 0.15, 0.95, 0.02), ("relaxkv", 0.02, 0.4, 0.2)]
    rows = [_timed("plain", "e", *p) for p in points]
    out = {r["anchor_ratio"]: r for r in bench_quality.equal_ttft(rows, ["plain"], "prophetkv", rounds=50)}
    assert set(out) == {0.02, 0.05, 0.15}  # pic and prophetkv itself get no row
    assert out[0.05]["where"] == "between" and out[0.05]["kl_versus_at_ttft"] == pytest.approx(0.08)
    assert out[0.05]["below"] is True and out[0.05]["gap"] == pytest.approx(-0.01)  # 0.07 < 0.08
    assert (out[0.15]["where"], out[0.15]["kl_versus_at_ttft"], out[0.15]["below"]) == ("dearer", 0.06, True)
    assert (out[0.02]["where"], out[0.02]["kl_versus_at_ttft"], out[0.02]["below"]) == ("cheaper", 0.10, False)
    assert bench_quality.equal_ttft(rows, ["chat"], "prophetkv") == []


def test_curve_stats_under_weights_equal_the_repeated_rows():
    """A resample's weights give the median and mean of the rows repeated that many times."""
    import statistics

    import numpy as np

    rng = random.Random(5)
    rows = [_timed("plain", f"e{i}", "prophetkv", 0.05, round(rng.uniform(0.5, 1.5), 2), rng.random())
            for i in range(7)]
    units = {("hotpotqa", f"e{i}"): i for i in range(7)}
    weights = np.array([[1] * 7, [0, 3, 1, 0, 2, 1, 0], [0, 0, 0, 0, 0, 0, 7], [2, 0, 0, 1, 0, 0, 1]], dtype=float)
    ttft, kl = quality_stats._curve_stats(rows, units, weights)[("prophetkv", 0.05)]
    for k, w in enumerate(weights):
        repeated = [r for r, times in zip(rows, w) for _ in range(int(times))]
        assert ttft[k] == pytest.approx(statistics.median(r["ttft_s"] for r in repeated))
        assert kl[k] == pytest.approx(statistics.mean(r["kl_first_token"] for r in repeated))


def test_equal_ttft_interval_resamples_examples_and_gives_a_verdict():
    """Medians and means over examples; the interval decides ``below`` / ``level`` / ``above``."""
    rng = random.Random(3)
    rows = []
    for i in range(40):
        t = 1.0 + 0.2 * rng.random()  # this example's prompt length sets all its times
        noise = rng.gauss(0, 0.05)
        rows += [_timed("plain", f"e{i}", "prophetkv", 0.05, t, 0.10 + noise),
                 _timed("plain", f"e{i}", "prophetkv", 0.10, t + 0.2, 0.05 + noise),
                 # clearly below: ProphetKV's 5% time, a third lower KL
                 _timed("plain", f"e{i}", "clear", 0.05, t, 0.07 + noise),
                 # level: ProphetKV's own 5% point, with per-example noise of either sign
                 _timed("plain", f"e{i}", "tie", 0.05, t, 0.10 + noise + rng.gauss(0, 0.05)),
                 # above: as slow as ProphetKV at 10% with its 5% KL
                 _timed("plain", f"e{i}", "worse", 0.05, t + 0.2, 0.10 + noise)]
    out = {r["policy"]: r for r in bench_quality.equal_ttft(rows, ["plain"], "prophetkv", rounds=300)}
    assert out["clear"]["verdict"] == "below" and out["clear"]["gap_ci95"][1] < 0
    assert out["tie"]["verdict"] == "level" and out["tie"]["gap_ci95"][0] < 0 < out["tie"]["gap_ci95"][1]
    assert out["worse"]["verdict"] == "above" and out["worse"]["gap"] == pytest.approx(0.05, abs=0.01)
    for r in out.values():
        lo, hi = r["gap_ci95"]
        assert lo <= r["gap"] <= hi


