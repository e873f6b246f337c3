"""The FlashInfer layer's plumbing, checked on the CPU.

FlashInfer runs only on a GPU (``python -m relaxkv_sglang.gpu.check`` there).
Here its two wrappers are replaced by their torch models from the core, with
FlashInfer's conventions (HND tensors for the block-sparse wrapper, an NHD paged
cache with page size 1, log-sum-exp in base 2), so what the thin layer itself
does (slot mapping, layouts, the base change, rows without a fully visible page,
the merge) is checked against ``block_sparse_attention``.
"""

from __future__ import annotations

import importlib.metadata
import math
import sys
import types

import pytest
import torch

from relaxkv_sglang.core.attention import block_sparse_attention, ragged_attention, variable_block_sparse_reference
from relaxkv_sglang.core.layout import build_relaxed_layout, full_causal_layout
from relaxkv_sglang.gpu import bundle, flashinfer_attention
from relaxkv_sglang.gpu.flashinfer_attention import FLASHINFER_VERSION, FlashInferRelaxedAttention

LOG2E = 1 / math.log(2.0)


class _VariableBlockModel:
    """torch model of ``VariableBlockSparseAttentionWrapper`` (plan + run, return_lse)."""

    def __init__(self, workspace):
        self.args = None

    def plan(self, block_mask_map, block_row_sz, block_col_sz, num_qo_heads, num_kv_heads, head_dim, *,
             causal, sm_scale, q_data_type, kv_data_type):
        assert not causal and block_mask_map.any(), "the real wrapper cannot plan an empty map"
        self.args = (block_mask_map, block_row_sz, block_col_sz, sm_scale)

    def run(self, q, k, v, return_lse):
        mask, rows, cols, scale = self.args
        assert q.dim() == 3 and q.shape[1] == int(rows[0].sum()) and k.shape[1] == int(cols[0].sum())  # HND
        out, lse = variable_block_sparse_reference(q, k, v, mask, rows, cols, scale, return_lse=True)
        # An empty row: FlashInfer's value there is not specified, so give one the layer must ignore.
        lse = torch.where(torch.isinf(lse), torch.full_like(lse, 7.0), lse * LOG2E)
        return out, lse


class _PagedPrefillModel:
    """torch model of ``BatchPrefillWithPagedKVCacheWrapper`` for page size 1, one query per request."""

    def __init__(self, workspace, kv_layout):
        assert kv_layout == "NHD"
        self.args = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             *, causal, sm_scale, q_data_type, kv_data_type):
        assert page_size == 1 and not causal and torch.equal(qo_indptr, torch.arange(qo_indptr.numel(), dtype=torch.int32))
        self.args = (kv_indptr, kv_indices, sm_scale)

    def run(self, q, paged_kv_cache, return_lse):
        k_cache, v_cache = paged_kv_cache
        assert k_cache.dim() == 4 and k_cache.shape[1] == 1  # [pages, page_size, heads, dim]
        indptr, indices, scale = self.args
        out, lse = ragged_attention(q, k_cache[:, 0], v_cache[:, 0], indptr, indices, scale, return_lse=True)
        return out, lse * LOG2E


@pytest.fixture
def flashinfer_model(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.__version__ = FLASHINFER_VERSION
    module.sparse = types.SimpleNamespace(VariableBlockSparseAttentionWrapper=_VariableBlockModel)
    module.BatchPrefillWithPagedKVCacheWrapper = _PagedPrefillModel
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def _case(seed: int, n: int = 90, ratio: float = 0.3, page_size: int = 8, full: bool = False):
    g = torch.Generator().manual_seed(seed)
    spans = [(4, 30), (30, 61), (61, n)]
    # Anchor 5 sits on the first page: its row block has no fully visible page.
    anchors = torch.tensor(sorted({5} | set(torch.randint(4, n, (18,), generator=g).tolist())))
    scores = torch.rand(n, generator=g)
    layout = (full_causal_layout(anchors, spans, n, page_size) if full
              else build_relaxed_layout(anchors, scores, spans, n, ratio, page_size))
    pool = 3 * n
    key_rows = torch.randperm(pool, generator=g)[:n]
    k_cache, v_cache = torch.randn(pool, 2, 16, generator=g), torch.randn(pool, 2, 16, generator=g)
    q = torch.randn(anchors.numel(), 6, 16, generator=g)
    return layout, key_rows, q, k_cache, v_cache


@pytest.mark.parametrize("seed,ratio,full", [(0, 0.3, False), (1, 0.1, False), (2, 1.0, False), (3, 0.5, True)])
def test_layer_equals_the_torch_executor(flashinfer_model, seed, ratio, full):
    layout, key_rows, q, k_cache, v_cache = _case(seed, ratio=ratio, full=full)
    attn = FlashInferRelaxedAttention("cpu", workspace_bytes=16)
    attn.plan(layout, num_qo_heads=6, num_kv_heads=2, head_dim=16, dtype=q.dtype, scale=0.3, key_rows=key_rows)
    got = attn.run(q, k_cache, v_cache)
    want = block_sparse_attention(q, k_cache, v_cache, layout, scale=0.3, key_rows=key_rows)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_layout_with_no_fully_visible_page_skips_the_block_call(flashinfer_model):
    # Anchors all on the first page: every key they see is on their own (diagonal) page.
    n, spans = 40, [(0, 40)]
    layout = build_relaxed_layout(torch.tensor([1, 3, 6]), torch.rand(n), spans, n, 0.5, page_size=8, sink_tokens=1)
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(3, 4, 8, generator=g), torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g)
    attn = FlashInferRelaxedAttention("cpu", workspace_bytes=16)
    attn.plan(layout, num_qo_heads=4, num_kv_heads=2, head_dim=8, dtype=q.dtype)
    assert attn._blocks.args is None  # never planned
    torch.testing.assert_close(attn.run(q, k, v), block_sparse_attention(q, k, v, layout), atol=1e-5, rtol=1e-5)


def test_run_before_plan_and_wrong_rows_are_refused(flashinfer_model):
    attn = FlashInferRelaxedAttention("cpu", workspace_bytes=16)
    layout, key_rows, q, k_cache, v_cache = _case(5)
    with pytest.raises(RuntimeError, match="before plan"):
        attn.run(q, k_cache, v_cache)
    attn.plan(layout, num_qo_heads=6, num_kv_heads=2, head_dim=16, dtype=q.dtype, key_rows=key_rows)
    with pytest.raises(ValueError, match="rows"):
        attn.run(q[1:], k_cache, v_cache)


def test_other_flashinfer_version_is_refused(flashinfer_model):
    flashinfer_model.__version__ = "0.6.0"
    with pytest.raises(RuntimeError, match="written for 0.7.2"):
        flashinfer_attention.import_flashinfer()


def test_pin_is_the_version_sglang_requires():
    required = [r for r in importlib.metadata.requires("sglang") if r.lower().startswith("flashinfer_python")
                and "extra" not in r]
    assert required, "sglang no longer names flashinfer_python"
    assert any(r.endswith(f"=={FLASHINFER_VERSION}") for r in required), required
    assert bundle.FLASHINFER_WHEEL.version == FLASHINFER_VERSION


def test_bundle_keeps_python_and_prefill_sources_only():
    assert bundle.kept("flashinfer/sparse.py") and bundle.kept("flashinfer/jit/attention/modules.py")
    assert bundle.kept("flashinfer/data/csrc/batch_prefill.cu")
    assert bundle.kept("flashinfer/data/csrc/tvm_ffi_utils.h")
    assert bundle.kept("flashinfer/data/include/flashinfer/attention/prefill.cuh")
    assert bundle.kept("flashinfer/data/cutlass/include/cute/tensor.hpp")
    assert not bundle.kept("flashinfer/data/csrc/trtllm_alltoall.cu")
    assert not bundle.kept("flashinfer/data/cutlass/examples/00_basic_gemm/basic_gemm.cu")
    assert not bundle.kept("flashinfer/fused_moe/backends/x.cu")
