"""The repair pass under CUDA's rules, on the CPU (attention/gpu/cuda_rules.py; issue 47).

CI has no GPU, so this is the GPU path's real test: the model, the KV pool and the hidden states
live on the harness's stand-in CUDA device, which raises on what CUDA would refuse or synchronize
on (an op mixing devices, a device tensor indexed by a host index, a blocking or pageable
host-to-device copy, a read of the device on the host) and counts what crosses, per layer. The
pass is the server's: the real layer loop, the real anchor executors (the torch executor in
float32, the FlashInfer layer over FlashInfer's torch model in bfloat16), SGLang's RoPE module
(``get_rope``) in SGLang-shaped decoder layers of a dense and an MoE family, with the stale shift.
It must give the values the same pass gives on the CPU, copy nothing to the device inside the
layers (everything is staged once per pass), and pin nothing per layer.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from test_model_family import hf_model, sglang_model

from relaxkv_sglang.repair.reference import from_hf_state_dict, stale_context
from relaxkv_sglang.repair.repair_config import RepairConfig
from relaxkv_sglang.repair.anchor_schedule import schedule_anchors
from relaxkv_sglang.model.rope_config import rope_spec_from_hf_config
from relaxkv_sglang.attention.staging import HostStage, to_device
from relaxkv_sglang.attention.gpu.cuda_rules import CudaRuleError, CudaRules
from relaxkv_sglang.attention.gpu.flashinfer_attention import FLASHINFER_VERSION
from relaxkv_sglang.attention.gpu.torch_models import flashinfer_stand_in
from relaxkv_sglang.runtime.failures import InvariantError
from relaxkv_sglang.attention.sglang.anchor_attention import AnchorAttention
from relaxkv_sglang.repair.sglang.layer_loop import LayerLoop
from relaxkv_sglang.model.sglang.model_layers import ModelLayers
from relaxkv_sglang.forward.repair_stage import repair_rows

CUDA = torch.device("cuda", 0)

# --- the harness itself ---------------------------------------------------------------------------


def _refused(rules, x, h):
    pinned = h.pin_memory()
    return {
        "blocking copy": lambda: h.to(CUDA),
        "pageable non-blocking copy": lambda: h.to(CUDA, non_blocking=True),
        "blocking copy of pinned memory": lambda: pinned.to(CUDA),
        "host index": lambda: x[h],
        "host index_select": lambda: x.index_select(0, h),
        "list index": lambda: x[[0, 1]],
        "mixed op": lambda: x + h.float(),
        "host index put": lambda: x.__setitem__(h, 1.0),
        "item": lambda: x.sum().item(),
        "bool": lambda: bool(x.any()),
        "int": lambda: int(x.sum()),
        "tolist": lambda: x.tolist(),
        "nonzero": lambda: x.nonzero(),
        "unique": lambda: torch.unique(x),
        "equal": lambda: torch.equal(x, x),
        "mask index": lambda: x[x > 0],
        "repeat_interleave": lambda: torch.repeat_interleave(x.long(), x.long()),
        "cpu": lambda: x.cpu(),
        "to cpu": lambda: x.to("cpu"),
        "copy to host": lambda: h.float().copy_(x),
        "tensor from data": lambda: torch.tensor([1, 2], device=CUDA),
        "print": lambda: repr(x),
    }


def test_the_harness_refuses_what_cuda_refuses_or_syncs_on():
    with CudaRules() as rules:
        x, h = torch.arange(4, device=CUDA).float(), torch.arange(4)
        for what, call in _refused(rules, x, h).items():
            with pytest.raises(CudaRuleError):
                call()
                pytest.fail(f"{what} was not refused")


def test_the_harness_allows_and_counts_what_cuda_runs_without_a_sync():
    with CudaRules() as rules:
        x = torch.arange(4, device=CUDA).float()
        assert x.device == CUDA and x.is_cuda and not torch.arange(2).is_cuda
        h = torch.arange(4).pin_memory()
        rules.layer = 3
        d = h.to(CUDA, non_blocking=True)  # pinned, non-blocking: fine, counted
        assert (x + d).device == CUDA and (x * torch.tensor(2.0)).device == CUDA  # a 0-dim host operand
        idx = torch.arange(2, device=CUDA)
        y = x[idx] + x.index_select(0, idx) + x[1:3]
        y.add_(1.0)
        assert x.max(0).values.device == CUDA and torch.repeat_interleave(idx, idx, output_size=1).device == CUDA
        with rules.host_reads_allowed():
            assert float(y.sum()) == rules.take(y).sum().item()
        stage = HostStage(CUDA)
        a, b = stage.put(torch.arange(5)), stage.put(torch.tensor([True, False]))
        stage.send()
        assert rules.take(a.get()).tolist() == [0, 1, 2, 3, 4] and rules.take(b.get()).tolist() == [True, False]
        assert a.get().device == CUDA
    t = rules.traffic
    assert t.h2d_copies[3] == 2 and t.pinned_allocations[3] == 1 and t.device_reads[3] == 1
    assert t.h2d_bytes[3] == 4 * 8 + 5 * 8 + 8  # the staged buffer is 8-byte aligned


# --- the repair pass ----------------------------------------------------------------------------

N, SPANS, Q0 = 40, [(4, 14), (14, 24), (24, 34)], 34  # 40 tokens: 4 of prefix, 3 chunks, a question of 6
PAGE = 4


def _sglang_rope(hf):
    """SGLang's RoPE module for the model (what the served layer's ``rotary_emb`` is)."""
    from sglang.srt.layers.rotary_embedding import get_rope

    spec = rope_spec_from_hf_config(hf.config.to_dict())
    return get_rope(spec.head_dim, spec.rotary_dim, hf.config.max_position_embeddings, spec.base, True, None,
                    torch.float32)


class _MarkLayers:
    """ModelLayers with the layer being run told to the harness (its counts go under it)."""

    def __init__(self, layers: ModelLayers, rules: CudaRules | None) -> None:
        self.inner, self.rules = layers, rules
        self.model, self.n_layers = layers.model, layers.n_layers

    def qkv(self, l, positions, hidden):
        if self.rules is not None:
            self.rules.layer = l
        return self.inner.qkv(l, positions, hidden)

    def finish(self, l, hidden, attn_out):
        return self.inner.finish(l, hidden, attn_out)

    def attention_params(self, l):
        return self.inner.attention_params(l)


def _model(family: str):
    hf = hf_model(family)
    w = from_hf_state_dict(hf.state_dict(), hf.config.to_dict())
    return hf, w


def _pass(hf, w, policy: str, dtype: torch.dtype, rules: CudaRules | None):
    """The request's repair pass on the stand-in device (rules) or the CPU (None). Returns the final
    hidden states and the pool's K/V at the request's slots, on the host, float32."""
    ids = torch.randint(0, 128, (N,), generator=torch.Generator().manual_seed(3))
    config = RepairConfig.from_knobs(anchor_ratio=0.3, context_ratio=0.5, page_size=PAGE,
                                     stale_shift="kv" if policy == "relaxkv" else "none", chunk_sink_tokens=1)
    stale = stale_context(w, ids, SPANS, Q0)
    plan = schedule_anchors(policy, stale.scores, SPANS, Q0, w.n_layers, config)
    slots = torch.randperm(2 * N, generator=torch.Generator().manual_seed(4))[:N]
    rows = repair_rows(N, plan, slots)
    put = rules.put if rules is not None else (lambda t: t.clone())
    pools = []
    for k, v in stale.kv:
        kp, vp = torch.zeros(2 * N, w.n_kv_heads, w.head_dim), torch.zeros(2 * N, w.n_kv_heads, w.head_dim)
        kp[slots[:k.shape[0]]], vp[slots[:v.shape[0]]] = k, v
        pools.append((put(kp.to(dtype)), put(vp.to(dtype))))
    kv_pool = types.SimpleNamespace(get_key_buffer=lambda l: pools[l][0], get_value_buffer=lambda l: pools[l][1])
    stack = sglang_model(w, ["X"], rope=None)
    stack.config = hf.config
    for layer in stack.layers:
        layer.self_attn.rotary_emb = _sglang_rope(hf)
    _to(stack, dtype, put)
    layers = _MarkLayers(ModelLayers(stack), rules)
    loop = LayerLoop(layers, kv_pool, AnchorAttention(), rope=rope_spec_from_hf_config(hf.config.to_dict()))
    input_ids = put(ids[rows.positions])
    with torch.no_grad():
        out = loop.run([rows], input_ids)
    if rules is not None:
        rules.layer = None
    take = rules.take if rules is not None else (lambda t: t)
    k_all = torch.stack([take(k)[slots].float() for k, _ in pools])
    v_all = torch.stack([take(v)[slots].float() for _, v in pools])
    return take(out).float(), k_all, v_all


def _to(module: torch.nn.Module, dtype: torch.dtype, put) -> None:
    """Every tensor the stand-in modules hold (parameters, buffers, plain tensor attributes, the
    MoE's weight dict) in ``dtype`` (cos/sin caches stay float32) and put on the device."""
    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for name, t in store.items():
                if t is not None:
                    store[name] = put(t.to(dtype) if t.is_floating_point() and "cos_sin" not in name else t)
        for name, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor):
                setattr(m, name, put(value.to(dtype)))
            elif isinstance(value, dict) and all(isinstance(t, torch.Tensor) for t in value.values()):
                setattr(m, name, {k: put(t.to(dtype)) for k, t in value.items()})


@pytest.fixture
def flashinfer_model(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_stand_in(FLASHINFER_VERSION))


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("policy", ["relaxkv", "prophetkv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32-torch", "bfloat16-flashinfer"])
def test_the_repair_pass_keeps_cuda_rules_and_the_harness_leaves_its_values_alone(flashinfer_model, family, policy,
                                                                                 dtype):
    """The pass under the stand-in device against the same pass without it. float32 (the torch executor on
    both sides): equal to the bit, which checks that the harness changes no value, not that the values are
    right (the server's pass against the torch reference: test_policy_protocol.py, e2e test_families.py);
    bfloat16: the FlashInfer model against the torch executor, within gpu_check.repair.TOLERANCE."""
    hf, w = _model(family)
    expected = _pass(hf, w, policy, dtype, None)
    with CudaRules() as rules:
        got = _pass(hf, w, policy, dtype, rules)
    tol = 0 if dtype == torch.float32 else 0.1
    for name, a, b in zip(("hidden", "K", "V"), got, expected):
        assert (a - b).abs().max().item() <= tol, (name, (a - b).abs().max().item())
    t = rules.traffic
    # Everything the pass needs on the device was made there or staged once, before the layers.
    assert t.in_layers("h2d_copies") == 0, dict(t.h2d_copies)
    assert t.in_layers("pinned_allocations") == 0, dict(t.pinned_allocations)
    assert t.h2d_copies[None] >= 1 and sum(t.device_reads.values()) == 0
    assert sum(t.host_waits.values()) == 0  # 3 layers: the ring of 4 wrappers never comes round


def test_the_pass_bookkeeping_on_the_device_is_refused():
    """A LoopRows tensor on the device would be read back at every layer: refused up front."""
    hf, w = _model("llama")
    plan = schedule_anchors("epic", None, SPANS, Q0, w.n_layers, RepairConfig(anchor_ratio=0.3, page_size=PAGE))
    with CudaRules():
        rows = repair_rows(N, plan, CudaRules.put(torch.arange(N)))
        layers = types.SimpleNamespace(n_layers=1, model=types.SimpleNamespace(embed_tokens=lambda ids: ids.float()))
        loop = LayerLoop(layers, types.SimpleNamespace(), AnchorAttention())
        with pytest.raises(InvariantError, match="slots must be a host tensor"):
            loop.run([rows], CudaRules.put(torch.zeros(N, dtype=torch.long)))


def test_the_query_pass_records_scores_under_cuda_rules():
    """The attention backend's share of a repair's query pass (forward/context.py::QueryScores): the
    query's rows are found on the host; the scores are computed where q and the pool are."""
    from relaxkv_sglang.attention.extend_rows import QueryScores

    with CudaRules() as rules:
        scores = QueryScores(n_context=7, query_end=9, slots=rules.put(torch.arange(3, 13)))
        q, k_cache = rules.put(torch.randn(8, 4, 8)), rules.put(torch.randn(16, 2, 8))
        for _ in range(2):
            scores.record(q, torch.arange(2, 10), k_cache, 0.3)  # rows 2..9; 9: a generated token
        assert [s.shape for s in scores.layers] == [(7,), (7,)] and scores.layers[0].device == CUDA


def test_rope_frequencies_reach_the_device_once_without_blocking():
    from relaxkv_sglang.model.rope import RopeSpec, RotationTable

    spec = RopeSpec(head_dim=8, base=12345.0)
    with CudaRules() as rules:
        for _ in range(3):
            table = RotationTable(torch.arange(5, device=CUDA), spec)
        assert table.rotate(rules.put(torch.randn(5, 2, 8))).device == CUDA
    assert sum(rules.traffic.h2d_copies.values()) <= 1  # cached per (spec, device)


def test_to_device_outside_cuda_is_a_plain_move():
    assert to_device(torch.arange(3), "cpu").tolist() == [0, 1, 2]
