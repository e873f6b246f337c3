"""The usage examples in the public entry points' docstrings run and say what they show."""

import doctest
import importlib

import pytest

# Modules whose public entry points end their docstring in a runnable example.
MODULES = [
    "relaxkv_sglang.core.block_sparse",     # block_sparse_attention
    "relaxkv_sglang.core.doc_index",        # discover_chunks
    "relaxkv_sglang.core.layout",           # build_relaxed_layout
    "relaxkv_sglang.core.reference",        # reference_prefill
    "relaxkv_sglang.core.repair_plan",      # plan_anchors
    "relaxkv_sglang.core.rope",             # rotate_keys
    "relaxkv_sglang.core.selection",        # select_anchors
    "relaxkv_sglang.core.segments",         # common_prefix_len
    "relaxkv_sglang.core.staging",          # HostStage
    "relaxkv_sglang.core.tiers.store",      # TieredChunkStore
    "relaxkv_sglang.srt.entrypoints.api",   # plan_item
    "relaxkv_sglang.srt.entrypoints.sglang_fields",  # check_sglang_fields
    "relaxkv_sglang.srt.scheduler.stop_regex",       # BoundedRe.search
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
