"""Unit tests of the benchmarks' pure helpers: eviction accounting, quality scoring and tables (no server)."""

from __future__ import annotations

import pytest

from benchmarks import bench_cache_hit, bench_quality, cache_hit_pressure, replay, run_all, tables


def _req(sent: float, first: float, reused: int) -> dict:
    return {"sent_at": sent, "first_token_at": first, "chunk_tokens_reused": reused}


def test_seen_before_missed_tokens_counts_only_documents_already_computed():
    tokens = {1: 10, 2: 20, 3: 30}
    doc_ids = [[1, 2], [2, 3], [1, 3], [1, 2]]
    per_request = [
        _req(0.0, 1.0, 0),   # first sight of 1 and 2
        _req(0.5, 2.0, 0),   # sent while request 0 was in flight: 2 was not computed yet, nothing expected
        _req(2.5, 3.0, 10),  # 1 (request 0) and 3 (request 1) were computed: 40 expected, 10 reused -> 30 missed
        _req(3.5, 4.0, 30),  # 1 and 2 computed: 30 expected, all reused
    ]
    assert bench_cache_hit.seen_before_missed_tokens(doc_ids, per_request, tokens) == 30
    # Hits beyond the seen-before documents never make the count negative.
    per_request[1]["chunk_tokens_reused"] = 20
    assert bench_cache_hit.seen_before_missed_tokens(doc_ids, per_request, tokens) == 30
    # Everything sequential and everything reused: nothing lost to evictions.
    sequential = [_req(i, i + 0.5, r) for i, r in enumerate([0, 20, 40, 30])]
    assert bench_cache_hit.seen_before_missed_tokens(doc_ids, sequential, tokens) == 0
    sequential[3]["chunk_tokens_reused"] = 0  # all of request 3's documents evicted
    assert bench_cache_hit.seen_before_missed_tokens(doc_ids, sequential, tokens) == 30


def test_best_with_pool_keeps_the_documents_used_soonest():
    docs = [[1, 2], [3, 4], [1, 3], [2, 4], [1, 2]]
    trace = [replay.TraceRequest("S", [f"doc {i}" for i in d], "Q", d) for d in docs]
    tokens = {1: 10, 2: 10, 3: 10, 4: 10}
    # room for everything: every repeat hits
    assert cache_hit_pressure.best_with_pool(trace, tokens, [100] * 5) == (6, 60)
    # room for two documents: after [3, 4] it keeps 1 and 3 (used next), after [1, 3] only 1
    # (3 is never used again), then [2, 4] misses and [1, 2] hits both
    assert cache_hit_pressure.best_with_pool(trace, tokens, [20] * 5) == (4, 40)
    assert cache_hit_pressure.best_with_pool(trace, tokens, [0] * 5) == (0, 0)


def test_replay_in_order_starts_requests_in_trace_order_one_per_client_in_flight():
    import threading

    in_flight, most, lock = [0], [0], threading.Lock()

    def send(i: int, client: int, sent_at: float) -> dict:
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        with lock:
            in_flight[0] -= 1
        return {"index": i, "client": client, "sent_at": sent_at}

    done = []
    records, wall = replay.replay_in_order(send, 20, 3, on_done=lambda i, r: done.append(i))
    assert [r["index"] for r in records] == list(range(20)) and sorted(done) == list(range(20))
    assert {r["client"] for r in records} <= {0, 1, 2} and most[0] <= 3 and wall >= 0


def test_replay_in_order_stops_at_the_first_failure_and_names_its_request():
    sent = []

    def send(i: int, client: int, sent_at: float) -> dict:
        sent.append(i)
        if i == 2:
            raise ValueError("invalid relaxkv_policy")
        return {}

    with pytest.raises(replay.ReplayError, match=r"^request 2: invalid relaxkv_policy$") as info:
        replay.replay_in_order(send, 50, 1)
    assert info.value.index == 2 and isinstance(info.value.cause, ValueError) and sent == [0, 1, 2]


def test_text_table_pads_to_the_widest_cell_and_markdown_rows_are_piped():
    columns = [tables.left("policy", 8), tables.right("hit rate", 9)]
    assert tables.text_table(columns, [["pic", "40.0%"], ["relaxkv-long", "9.5%"]]) == [
        "policy       hit rate", "---------------------", "pic             40.0%", "relaxkv-long     9.5%"]
    assert tables.text_table([tables.left("a"), tables.right("bb")], [["x", "1"]], gap="  ") == [
        "a  bb", "-  --", "x   1"]
    assert tables.markdown_table(["a", "b"], [["1", "2"]]) == ["| a | b |", "|---|---|", "| 1 | 2 |"]
    with pytest.raises(ValueError, match="2 cells for 1 columns"):
        tables.text_table([tables.left("a")], [["x", "y"]])


def test_task_score_uses_the_first_line_for_qa_and_all_text_for_ruler():
    from benchmarks.quality_tasks import TaskExample

    qa = TaskExample("squad", "q", "S", ["d"], "Q", ["Paris"], "qa_f1", 16)
    assert bench_quality.task_score(qa, " Paris\nRome Rome") == 1.0
    ruler = TaskExample("niah_multivalue", "n", "S", ["d"], "Q", ["1234567", "7654321"], "string_match_all", 40)
    assert bench_quality.task_score(ruler, " 1234567,\n 7654321") == 1.0
    assert bench_quality.task_score(ruler, " 1234567") == 0.5


def test_configs_answer_baselines_once_and_repairs_per_ratio():
    cfgs = bench_quality.configs(["full", "pic", "relaxkv", "epic"], [0.05, 0.3])
    assert cfgs == [("full", None), ("pic", None), ("relaxkv", 0.05), ("epic", 0.05), ("relaxkv", 0.3), ("epic", 0.3)]
    assert bench_quality.headline_ratio([0.05, 0.3]) == 0.05 and bench_quality.headline_ratio([0.3, 0.15]) == 0.15


def _row(task, policy, ratio, kl, score, ttft):
    return {"task": task, "format": "plain", "example_id": "e", "policy": policy, "anchor_ratio": ratio,
            "score": score, "f1_to_full": 1.0 - kl, "exact_to_full": float(kl == 0), "top1_to_full": float(kl == 0),
            "kl_first_token": kl, "ttft_s": ttft, "latency_s": ttft + 1, "prompt_tokens": 100, "relaxkv": {}}


def test_quality_summary_and_table():
    rows = []
    for task, k in (("hotpotqa", 1.0), ("niah_multivalue", 2.0)):
        rows += [_row(task, "full", None, 0.0, 0.5, 3.0), _row(task, "pic", None, 0.4 * k, 0.25, 0.2)]
        rows += [_row(task, "relaxkv", r, 0.1 * k / r, 0.5, 1 + r) for r in (0.05, 0.3)]
    cfgs = bench_quality.configs(["full", "pic", "relaxkv"], [0.05, 0.3])
    summary = bench_quality.summarize_all(rows, ["plain"], ["hotpotqa", "niah_multivalue"], cfgs)
    cell = {(s["task"], s["policy"], s["anchor_ratio"]): s for s in summary if s["format"] == "plain"}
    assert len(summary) == 2 * 3 * 4  # the format and all formats (the same here) x (2 tasks + all) x configs
    assert [s for s in summary if s["format"] == "all"] == [{**s, "format": "all"} for s in summary[:12]]
    assert cell[("all", "pic", None)]["kl_first_token"] == pytest.approx(0.6)  # mean of 0.4 and 0.8
    assert cell[("niah_multivalue", "relaxkv", 0.3)]["kl_first_token"] == pytest.approx(0.2 / 0.3)
    assert cell[("all", "relaxkv", 0.05)]["ttft_median_s"] == pytest.approx(1.05)
    result = {"args": {"context_ratio": 0.25, "offset": 0, "seed": 0, "model": "m", "quick": False},
              "machine": {"cpus": 2, "platform": "Linux-x", "date": "2026-11-29T00:00:00"}, "bench": "bench_quality",
              "wall_s": 150.0, "tasks": {"hotpotqa": {"examples": 1}, "niah_multivalue": {"examples": 1}},
              "summary": summary}
    table = run_all.quality_table(result)
    assert "at 5% anchors" in table and "ran in 2.5 min" in table
    assert "| pic | 0.600 [0.40, 0.80] | 0.000 | 0.400 / 0.25 | 0.800 / 0.25 | 0.20 |" in table
    assert "| relaxkv | 3.000 [2.00, 4.00] | 0.000 | 2.000 / 0.50 | 4.000 / 0.50 | 1.05 |" in table  # at 5%
    assert "full: 0.000 / 3.00; pic: 0.600 / 0.20." in table
    assert "| relaxkv | 3.000 / 1.05 | 0.500 / 1.30 |" in table  # the sweep: KL / TTFT per ratio


# ------------------------------------------------------------- benchmarks/common


class _RecordingClient:
    """Records what a benchmark sends, like ServerClient.generate (no server)."""

    def __init__(self):
        self.sent = []

    def generate(self, text, offsets=None, policy=None, **kwargs):
        self.sent.append((text, offsets, policy, kwargs))
        return {"meta_info": {"relaxkv": None}}


def test_parse_args_applies_the_quick_sizes_only_with_quick():
    from benchmarks import common

    parser = common.bench_parser("bench_x", "Title line.\n\nMore.", quick_help="small")
    parser.add_argument("--requests", type=int, default=100)
    assert common.parse_args(parser, [], quick={"requests": 4}).requests == 100
    args = common.parse_args(parser, ["--quick", "--requests", "7"], quick={"requests": 4})
    assert args.requests == 4 and args.quick
    assert (args.model, args.url, args.max_total_tokens, args.output) == ("smollm2-135m", None, 65536, None)
    assert parser.prog == "python -m benchmarks.bench_x" and parser.description == "Title line."
    # A benchmark without a server has no server flags.
    bare = common.parse_args(common.bench_parser("bench_y", "Y.", server=False), ["--output", "o.json"])
    assert vars(bare) == {"output": "o.json", "quick": False}


def test_warm_chunks_sends_the_documents_reversed_behind_another_system_prompt():
    from benchmarks import common, prompt_formats

    client = _RecordingClient()
    common.warm_chunks(client, ["doc A", "doc B"], "Other system.")
    (text, offsets, policy, kwargs), = client.sent
    assert prompt_formats.chunk_texts(text, offsets) == ["doc B", "doc A"] and text.startswith("Other system.")
    assert policy == "pic" and kwargs == {"max_new_tokens": 1}
    assert common.relaxkv_report({"meta_info": {"relaxkv": None}}) == {}
    assert common.relaxkv_report({"meta_info": {"relaxkv": {"chunks_hit": 2}}}) == {"chunks_hit": 2}


def test_run_bench_writes_the_result_and_fails_in_one_line(tmp_path, capsys):
    import json

    from benchmarks import common

    parser = common.bench_parser("bench_x", "X.", server=False)
    args = common.parse_args(parser, ["--output", str(tmp_path / "x.json")])
    shown, plotted = [], []
    path = common.run_bench("bench_x", args, lambda a: {"results": [1, 2]}, report=shown.append,
                            plot=lambda result, png: plotted.append(png))
    written = json.loads(path.read_text())
    assert written["bench"] == "bench_x" and written["results"] == [1, 2] and written["args"]["output"] == str(path)
    assert shown == [{"results": [1, 2]}] and plotted == [tmp_path / "x.png"]

    def broken(a):
        raise RuntimeError("no server")

    with pytest.raises(SystemExit) as exc:
        common.run_bench("bench_x", args, broken)
    assert exc.value.code == 1
    assert capsys.readouterr().err == "bench_x: error: no server\n"


def test_bench_client_uses_the_given_url_without_starting_a_server():
    import argparse

    from benchmarks import common

    args = argparse.Namespace(url="http://127.0.0.1:1/", model="/nonexistent", max_total_tokens=1)
    with common.bench_client(args, "bench_x") as client:
        assert client.url == "http://127.0.0.1:1"


def test_document_tokens_counts_each_document_once_as_a_chunk():
    class CharTokenizer:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": ([0] if add_special_tokens else []) + [ord(c) for c in text]}

    reqs = [replay.TraceRequest("S", docs, "Q", ids) for ids, docs in (([3, 1], ["ccc", "a"]), ([1, 2], ["a", "bb"]))]
    tokens = replay.document_tokens(reqs, CharTokenizer())
    assert tokens == {3: 3, 1: 1, 2: 2}
    assert replay.best_possible_pct(reqs, tokens, prompt_tokens=10) == pytest.approx(10.0)


def test_cold_trace_has_one_example_per_request_and_a_chunk_per_paragraph():
    from benchmarks import bench_cold

    trace = bench_cold.make_trace(6, offset=1000)
    assert len(trace) == 6 and len({text for text, _ in trace}) == 6
    for text, offsets in trace:
        assert len(offsets) == 20  # ten paragraphs, two offsets each
        assert offsets == sorted(offsets) and offsets[-1] <= len(text)


def test_cold_bench_refuses_a_run_without_pic_in_one_line(capsys):
    from benchmarks import bench_cold

    with pytest.raises(SystemExit):
        bench_cold.main(["--policies", "full", "relaxkv", "--url", "http://127.0.0.1:9"])
    assert capsys.readouterr().err.strip() == "bench_cold: error: --policies must include pic (the figures are ratios to it)"


def test_cold_summary_takes_medians_of_each_rounds_ratio_and_excess_cold_and_warm():
    from benchmarks import bench_cold

    def cell(wall, warm):
        return {"wall_s": wall, "chunks_hit": 0, "chunks_seen": 10, "repaired": 0,
                "warm": {"wall_s": warm, "chunks_hit": 10}}

    rounds = [{"pic": cell(10.0, 2.0), "relaxkv": cell(13.0, 4.0)},
              {"pic": cell(20.0, 3.0), "relaxkv": cell(22.0, 6.0)},
              {"pic": cell(12.0, 2.0), "relaxkv": cell(15.0, 5.0)}]
    s = bench_cold.summarize(rounds)["relaxkv"]
    assert s["median_wall_s"] == 15.0 and s["median_ratio_to_pic"] == pytest.approx(1.25)  # 1.3, 1.1, 1.25
    assert s["median_excess_over_pic_s"] == pytest.approx(3.0)  # 3, 2, 3
    assert s["median_warm_wall_s"] == 5.0 and s["median_warm_excess_over_pic_s"] == pytest.approx(3.0)  # 2, 3, 3
    assert s["warm_chunks_hit"] == 10
    del rounds[0]["pic"]["warm"]  # a run without warm replays reports none
    assert "median_warm_wall_s" not in bench_cold.summarize(rounds)["pic"]


def test_replay_shape_routed_sends_the_discovered_documents_key():
    """``bench_cache_hit --replicas N --frameworks``: under document routing each LangChain-shaped
    request carries the key of its documents (discovered in the string content), none otherwise."""
    import argparse

    from benchmarks import cache_hit_frameworks
    from benchmarks.replay import TraceRequest
    from relaxkv_sglang.request.routing import ROUTING_HEADER, routing_key_of_documents

    docs = [f"The river town of Alder{i} grew around a mill built in {1700 + i}, and its stone bridge was rebuilt "
            "twice after the floods." for i in range(4)]
    trace = [TraceRequest("You answer.", docs[:3], "Question: Which?\nAnswer:", [0, 1, 2]),
             TraceRequest("You answer.", docs[1:][::-1], "Question: What?\nAnswer:", [3, 2, 1])]

    class Response:
        status_code = 200

        def json(self):
            return {"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}}

    class Client:
        url, timeout = "http://gw", 5

        def __init__(self):
            self.headers = []
            self.session = self

        def flush(self):
            pass

        def post(self, url, json, timeout, headers):
            assert url == "http://gw/v1/chat/completions" and isinstance(json["messages"][0]["content"], str)
            self.headers.append(headers)
            return Response()

    args = argparse.Namespace(max_new_tokens=1, clients=1)
    for routed, want in [(True, [routing_key_of_documents(docs[:3]), routing_key_of_documents(docs[1:])]),
                         (False, [None, None])]:
        client = Client()
        row = cache_hit_frameworks.replay_shape(client, "m", trace, "langchain-chat", args, routed=routed)
        assert [h and h[ROUTING_HEADER] for h in client.headers] == want
        assert row["routing_keys"] == (2 if routed else 0) and row["cache_hit_rate_pct"] == 40.0
