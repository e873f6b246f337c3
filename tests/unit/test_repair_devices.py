"""The repair pass on a device it never reads back (srt/layer_loop.py, issue 38 items 1 and 3).

The model, the KV pool and the hidden states live on PyTorch's ``meta`` device, which holds shapes
but no values: an op that needs a device value on the host (``.item()``, ``bool()``, ``nonzero``,
a boolean-mask index: the host syncs of a GPU) raises there, and so does an op mixing a device
tensor with a host one. The pass's bookkeeping stays on the host, as the planner made it. The
stand-in layer refuses host positions (SGLang's CUDA RoPE kernel would crash on them) and the
stand-in anchor executor refuses host queries or pool slots: so a pass that completes here makes
no host sync per layer and hands the device no host tensor where it computes.

CacheBlend's check layer reads its deviation back by design (its decision is the plan's, on the
host), so it is not run here; the reference-equality tests of the executor are in
``test_stale_shift.py``.
"""

from __future__ import annotations

import types

import pytest
import torch
from test_reference import GLUE_SPANS, PS, Q0, ids, model  # noqa: F401 (fixtures)

from relaxkv_sglang.core.reference import stale_context
from relaxkv_sglang.core.repair_plan import RepairConfig, plan_anchors
from relaxkv_sglang.core.rope import rope_spec_from_hf_config
from relaxkv_sglang.srt.failures import InvariantError
from relaxkv_sglang.srt.layer_loop import LayerLoop
from relaxkv_sglang.srt.repair import repair_rows

DEVICE = torch.device("meta")


class _DeviceLayers:
    """ModelLayers' surface with weights on the device: the shapes of a Llama layer, no values."""

    def __init__(self, w) -> None:
        self.w, self.n_layers = w, w.n_layers
        hidden = w.embed.shape[1]
        self.model = types.SimpleNamespace(embed_tokens=lambda i: torch.empty(i.shape[0], hidden, device=i.device),
                                           norm=lambda h: h * 1.0)
        self.calls = 0

    def qkv(self, l: int, positions: torch.Tensor, hidden: torch.Tensor):
        if positions.device != hidden.device:
            raise AssertionError(f"positions on {positions.device}, hidden on {hidden.device}")
        self.calls += 1
        n, w = hidden.shape[0], self.w
        q = torch.empty(n, w.n_heads, w.head_dim, device=hidden.device) + positions[:, None, None]
        k = torch.empty(n, w.n_kv_heads, w.head_dim, device=hidden.device) + positions[:, None, None]
        return q, k, torch.empty_like(k)

    def finish(self, l: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        return hidden + attn_out.flatten(1)[:, : hidden.shape[1]]

    def attention_params(self, l: int):
        return l, self.w.head_dim ** -0.5


class _DeviceAnchors:
    """The anchor executor's surface (FlashInfer on a GPU: host layouts, device tensors)."""

    def __init__(self) -> None:
        self.layers = []

    def begin_pass(self) -> None:
        pass

    def __call__(self, q, k_cache, v_cache, layout, scale, key_rows, layer=None, layouts=None, work=None):
        for name, x in (("q", q), ("k_cache", k_cache), ("key_rows", key_rows)):
            if x.device != DEVICE:
                raise AssertionError(f"{name} on {x.device}")
        if layout.q_pos.device.type != "cpu":
            raise AssertionError("layouts are the planner's, on the host")
        self.layers.append(layer)
        return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])


@pytest.mark.parametrize("policy,stale_shift", [("relaxkv", "kv"), ("relaxkv", "v"), ("prophetkv", "none"),
                                                ("epic", "none")])
def test_a_repair_pass_runs_on_the_device_without_reading_it_back(model, ids, policy, stale_shift):  # noqa: F811
    hf, w = model
    n = ids.numel()
    config = RepairConfig.from_knobs(anchor_ratio=0.3, context_ratio=0.5, page_size=PS, stale_shift=stale_shift,
                                     chunk_sink_tokens=2)
    plan = plan_anchors(policy, stale_context(w, ids, GLUE_SPANS, Q0).scores, GLUE_SPANS, Q0, w.n_layers, config)
    slots = torch.arange(n) + 5  # the request's pool slots, read back once before the pass
    rows = repair_rows(n, plan, slots)
    pool = [torch.empty(n + 7, w.n_kv_heads, w.head_dim, device=DEVICE) for _ in range(w.n_layers)]
    kv_pool = types.SimpleNamespace(get_key_buffer=lambda l: pool[l], get_value_buffer=lambda l: pool[l])
    layers, anchors = _DeviceLayers(w), _DeviceAnchors()
    loop = LayerLoop(layers, kv_pool, anchors, rope=rope_spec_from_hf_config(hf.config.to_dict()))
    out = loop.run([rows], ids[rows.positions].to(DEVICE))
    assert out.device == DEVICE and out.shape == (rows.n_rows, w.embed.shape[1])
    assert layers.calls == w.n_layers  # every layer ran
    assert anchors.layers == [l for l in range(w.n_layers) if plan.layouts[l].n_rows]
    assert (rows.shift_target is not None) == (stale_shift != "none")
    if rows.shift_target is not None:
        assert rows.shift_target.slots.device == DEVICE and rows.shift_target.rows.device == DEVICE


def test_the_pass_bookkeeping_on_the_device_is_refused(model, ids):  # noqa: F811
    """A LoopRows tensor on the device would be read back at every layer: refused up front."""
    hf, w = model
    n = ids.numel()
    plan = plan_anchors("epic", None, GLUE_SPANS, Q0, w.n_layers, RepairConfig(anchor_ratio=0.3, page_size=PS))
    rows = repair_rows(n, plan, torch.arange(n).to(DEVICE))
    loop = LayerLoop(_DeviceLayers(w), types.SimpleNamespace(), _DeviceAnchors())
    with pytest.raises(InvariantError, match="slots must be a host tensor"):
        loop.run([rows], ids.to(DEVICE))


def test_the_query_pass_records_scores_without_reading_the_device_back():
    """The attention backend's share of a repair's query pass (srt/context.py::QueryScores): the
    query's rows are found on the host; the scores are computed where q and the pool are."""
    from relaxkv_sglang.srt.context import QueryScores

    scores = QueryScores(n_context=7, query_end=9, slots=torch.arange(3, 13).to(DEVICE))
    q, k_cache = torch.empty(8, 4, 8, device=DEVICE), torch.empty(16, 2, 8, device=DEVICE)
    for _ in range(2):
        scores.record(q, torch.arange(2, 10), k_cache, 0.3)  # rows 2..9; 9: a generated token
    assert [s.shape for s in scores.layers] == [(7,), (7,)] and scores.layers[0].device == DEVICE
