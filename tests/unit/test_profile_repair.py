"""profile_repair's stage attribution: a sampled stack goes to the most specific stage on it."""

from __future__ import annotations

from benchmarks import profile_repair


def _stack(*names: str) -> list[str]:
    return [f"{name} (some/file.py:{i})" for i, name in enumerate(names)]


ROOT = ("run_scheduler_process", "Scheduler.run_batch", "around_forward_batch_generation", "_forward")


def test_a_stack_goes_to_the_most_specific_stage_with_all_its_markers_in_order():
    loop = (*ROOT, "around_model_forward", "RepairStage.run", "LayerLoop.run")
    cases = {
        (*loop, "LayerLoop._attend", "PreparedAnchors.run", "sdpa_attention"): "loop: anchor attention",
        (*loop, "LayerLoop._attend", "ScopedCausalGroups.run"): "loop: glue+query attention",
        (*loop, "ModelLayers.finish", "SGLangLayerOps.mlp"): "loop: o_proj+MLP",
        (*loop, "index_select"): "loop: other (KV writes, gathers)",
        (*ROOT, "around_model_forward", "RepairStage.run", "RepairStage._plan", "schedule_anchors"):
            "repair: planning (exits, layouts)",
        (*ROOT, "around_model_forward", "RepairStage.run", "RepairStage._plan", "decide_budget"): "repair: budget",
        (*ROOT, "around_model_forward", "LlamaModel.forward", "RelaxKVAttnBackend.forward_extend",
         "record_query_scores", "QueryScores.record"): "query pass: scores",
        (*ROOT, "around_model_forward", "LlamaModel.forward", "RelaxKVAttnBackend.forward_extend",
         "scoped_causal_attention"): "query pass: attention",
        (*ROOT, "around_model_forward", "LlamaMLP.forward"): "query pass: linear and the rest",
        (*ROOT, "fold_batch", "ChunkReuse.reuse"): "fold (warm chunks copied)",
        (*ROOT, "LogitsProcessor.forward"): "SGLang: logits, sampling",
        ("run_scheduler_process", "Scheduler.recv_requests"): profile_repair.OTHER,
    }
    for frames, stage in cases.items():
        assert profile_repair.stage_of(_stack(*frames)) == stage, frames
    # a stage's markers count only in their order, root to leaf
    assert profile_repair.stage_of(_stack("PreparedAnchors.run", "LayerLoop._attend")) == profile_repair.OTHER


def test_raw_samples_of_the_scheduler_loop_are_summed_per_stage_and_other_lines_skipped():
    attend = ";".join(_stack(*ROOT, "around_model_forward", "RepairStage.run", "LayerLoop.run", "LayerLoop._attend",
                             "PreparedAnchors.run"))
    fold = ";".join(_stack(*ROOT, "fold_batch"))
    background = ";".join(_stack("Thread.run", "fold_batch"))  # not the scheduler's loop
    raw = f"{attend} 7\n{fold} 3\n{attend} 2\n{background} 5\nnot a sample line\n\n"
    assert profile_repair.stage_samples(raw) == {"loop: anchor attention": 9, "fold (warm chunks copied)": 3}
