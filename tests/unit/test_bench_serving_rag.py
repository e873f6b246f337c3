"""The RAG dataset as ``sglang.bench_serving``'s own loader reads it, for every policy the runner sends."""

from __future__ import annotations

import argparse
import pathlib

import pytest

from benchmarks import bench_serving_rag, rag_dataset, replay

EXPECTED_PARAMS = {
    "full": {"relaxkv_policy": "full"},
    "pic": {"relaxkv_policy": "pic"},
    "relaxkv": {"relaxkv_policy": "relaxkv", "relaxkv_anchor_ratio": 0.15},
    "prophetkv": {"relaxkv_policy": "prophetkv", "relaxkv_anchor_ratio": 0.15},
    "relaxkv@auto": {"relaxkv_policy": "relaxkv", "relaxkv_budget": "auto"},
    "relaxkv@0.3": {"relaxkv_policy": "relaxkv", "relaxkv_budget": 0.3},
}


@pytest.fixture(scope="module")
def trace():
    args = argparse.Namespace(source="hotpotqa", pool=8, zipf=1.0, docs_per_request=3, topics=0, requests=6,
                              seed=5, max_new_tokens=4)
    return replay.make_trace(args)


def test_bench_serving_loads_each_policy_row_with_its_fields_and_the_flattened_prompt_length(
        tmp_path, tiny_model_path, trace):
    from sglang.benchmark.datasets.openai_dataset import sample_openai_requests
    from transformers import AutoTokenizer

    bench_tokenizer = tmp_path / "tokenizer"
    rag_dataset.write_bench_tokenizer(pathlib.Path(tiny_model_path), bench_tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(bench_tokenizer)
    plain = AutoTokenizer.from_pretrained(tiny_model_path)
    for policy, expected in EXPECTED_PARAMS.items():
        params = rag_dataset.check_params(rag_dataset.policy_params(policy, 0.15))
        assert params == expected, policy
        path = tmp_path / f"{policy}.jsonl"
        assert rag_dataset.write_dataset(path, trace, 4, params) == len(trace)
        rows = sample_openai_requests(str(path), 0, tokenizer)
        assert len(rows) == len(trace)
        for row, request in zip(rows, trace):
            assert row.extra_request_body == {"custom_params": expected}
            assert row.output_len == 4
            system, user = row.prompt
            assert system == {"role": "system", "content": request.system}
            assert [part["text"] for part in user["content"]] == [*request.documents, request.question]
            # the server joins text parts with a space; the template prelude renders them so
            flat = [system, {"role": "user", "content": " ".join([*request.documents, request.question])}]
            assert row.prompt_len == len(plain.apply_chat_template(flat, tokenize=True, add_generation_prompt=True,
                                                                   return_dict=False))


@pytest.mark.parametrize("policy, field", [("pic-auto", "pic-auto"), ("relaxkv@2", "relaxkv_budget"),
                                           ("nosuch", "relaxkv_policy")])
def test_a_policy_the_rows_cannot_carry_is_refused_naming_why(policy, field):
    with pytest.raises(ValueError, match=field):
        rag_dataset.check_params(rag_dataset.policy_params(policy, 0.15))


def test_rows_take_bench_serving_figures_and_ratios_to_pic():
    def result(throughput, ttft):
        return {"completed": 10, "request_throughput": throughput, "mean_ttft_ms": ttft, "median_ttft_ms": ttft,
                "p99_ttft_ms": 2 * ttft,
                "cache_report": {"total_prompt_tokens": 100, "total_cached_tokens": 80, "cache_hit_rate_pct": 80.0}}

    rows = [bench_serving_rag.policy_row("pic", result(4.0, 200), 10),
            bench_serving_rag.policy_row("relaxkv", result(3.0, 500), 10)]
    bench_serving_rag.add_ratios(rows)
    assert rows[1]["throughput_vs_pic"] == pytest.approx(0.75)
    assert rows[1]["ttft_p50_vs_pic"] == pytest.approx(2.5)
    assert rows[1]["ttft_ms"]["p99"] == 1000 and rows[1]["cache_hit_rate_pct"] == 80.0
    with pytest.raises(RuntimeError, match="completed 9 of the 10"):
        bench_serving_rag.policy_row("pic", {**result(1.0, 1), "completed": 9}, 10)
