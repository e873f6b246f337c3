"""The usage examples in the public entry points' docstrings run and say what they show."""

import doctest
import importlib

import pytest

# Modules whose public entry points end their docstring in a runnable example.
MODULES = [
    "relaxkv_sglang.attention.block_sparse",     # block_sparse_attention
    "relaxkv_sglang.request.doc_index",        # discover_chunks
    "relaxkv_sglang.attention.layout",           # build_relaxed_layout
    "relaxkv_sglang.repair.reference",        # reference_prefill
    "relaxkv_sglang.repair.anchor_schedule",      # schedule_anchors
    "relaxkv_sglang.model.rope",             # rotate_keys
    "relaxkv_sglang.repair.selection",        # select_anchors
    "relaxkv_sglang.request.segments",         # common_prefix_len
    "relaxkv_sglang.attention.staging",          # HostStage
    "relaxkv_sglang.cache.chunk_key",        # ChunkKey
    "relaxkv_sglang.cache.tiers.store",      # TieredChunkStore
    "relaxkv_sglang.request.sglang.api",   # plan_item
    "relaxkv_sglang.request.sglang.sglang_fields",  # check_sglang_fields
    "relaxkv_sglang.request.sglang.stop_regex",       # BoundedRe.search
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
