"""The device check of the plugin's repair pass: the layer loop on a GPU against the same loop on the CPU.

The server's executor (:class:`~relaxkv_sglang.srt.layer_loop.LayerLoop`: anchors through
:class:`~relaxkv_sglang.srt.layer_loop.AnchorAttention`, glue and query through
``scoped_causal_attention``, the stale shift) runs over stand-in decoder layers (the torch
reference's layer maths, :class:`~relaxkv_sglang.core.reference.ReferenceLayerOps`, over random
weights of a SmolLM2-shaped model) and a KV pool holding one request's stale context at scattered
slots, as the server leaves it. One request: 10 chunks, 15% anchors, 25% context, the ``relaxkv``
plan of the torch planner on the reference's query scores.

Two runs on the device, each compared with the same pass in float32 on the CPU:

* ``float32``: the torch executors on the device (a device mix or a host read would fail or
  differ here first);
* ``bfloat16``: the anchors through FlashInfer, as served.

Each device pass runs under ``torch.cuda.set_sync_debug_mode("error")``: a host sync inside it is
an error, so the check proves the per-layer path never reads the device back. The error measures
are the last row's logits and the request's repaired K/V (max abs), and the pass's time.

    python -m relaxkv_sglang.gpu.check --repair-only      (part of the full and --quick checks)
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import types
from typing import Iterator

import torch

from relaxkv_sglang.core.model_family import finish_layer, project_qkv
from relaxkv_sglang.core.reference import LlamaWeights, ReferenceLayerOps, StaleContext, apply_neox_rope, stale_context
from relaxkv_sglang.core.reference_model import rms_norm
from relaxkv_sglang.core.repair_plan import AnchorPlan, RepairConfig, plan_anchors
from relaxkv_sglang.core.rope import RopeSpec
from relaxkv_sglang.srt.layer_loop import AnchorAttention, LayerLoop
from relaxkv_sglang.srt.repair import repair_rows

TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1}  # max |err|; bfloat16 on a CPU: 0.031 (seed 0)


@dataclasses.dataclass(frozen=True)
class RepairCase:
    """One request through the repair pass (SmolLM2-135M's attention shape, fewer layers)."""

    n_context: int = 1536
    n_layers: int = 4
    hidden: int = 576
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    intermediate: int = 1536
    vocab: int = 2048
    n_chunks: int = 10
    query: int = 64


def random_weights(case: RepairCase, seed: int) -> LlamaWeights:
    """float32 random weights of a Llama-family model of the case's shape (scaled to keep
    activations O(1) over the layers)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5

    h, qd, kd = case.hidden, case.n_heads * case.head_dim, case.n_kv_heads * case.head_dim
    layers = [{"attn_norm": torch.ones(h), "q": w(qd, h), "k": w(kd, h), "v": w(kd, h), "o": w(h, qd),
               "mlp_norm": torch.ones(h), "gate": w(case.intermediate, h), "up": w(case.intermediate, h),
               "down": w(h, case.intermediate)} for _ in range(case.n_layers)]
    embed = torch.randn(case.vocab, h, generator=g)
    return LlamaWeights(embed, layers, torch.ones(h), w(case.vocab, h), case.n_heads, case.n_kv_heads, case.head_dim,
                        rope_theta=100000.0)


@dataclasses.dataclass(frozen=True)
class DeviceLayerOps(ReferenceLayerOps):
    """The reference's layer ops with weights on a device in any dtype: inputs cast to the weights'
    dtype, RoPE's frequencies on the positions' device, q/k/v in the weights' dtype."""

    def qkv_proj(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return super().qkv_proj(x.to(self.layer["q"].dtype))

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv, dtype = self.w.rope_inv_freq().to(positions.device), self.layer["q"].dtype
        return (apply_neox_rope(q, positions, inv, self.w.rotary_dim).to(dtype),
                apply_neox_rope(k, positions, inv, self.w.rotary_dim).to(dtype))

    def o_proj(self, attn_out: torch.Tensor) -> torch.Tensor:
        return super().o_proj(attn_out.to(self.layer["o"].dtype)).float()

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return super().mlp(x.to(self.layer["gate"].dtype)).float()


class DeviceLayers:
    """``ModelLayers``' surface (what ``LayerLoop`` calls) over :class:`DeviceLayerOps`."""

    def __init__(self, w: LlamaWeights) -> None:
        self.w, self.n_layers = w, w.n_layers
        self.model = types.SimpleNamespace(embed_tokens=lambda ids: w.embed[ids].float(),
                                           norm=lambda h: rms_norm(h, w.norm, w.rms_eps))

    def qkv(self, l: int, positions: torch.Tensor, hidden: torch.Tensor):
        return project_qkv(DeviceLayerOps(self.w, self.w.layers[l]), self.w.family, hidden, positions)

    def finish(self, l: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        return finish_layer(DeviceLayerOps(self.w, self.w.layers[l]), hidden, attn_out)

    def attention_params(self, l: int) -> tuple[int, float]:
        return l, self.w.head_dim ** -0.5


def _on(w: LlamaWeights, device: torch.device, dtype: torch.dtype) -> LlamaWeights:
    """The weights on a device in a dtype (the embedding and norms stay float32, as served)."""
    return dataclasses.replace(w, embed=w.embed.to(device), norm=w.norm.to(device), lm_head=w.lm_head.to(device),
                               layers=[{k: t.to(device, dtype if t.dim() == 2 else torch.float32)
                                        for k, t in layer.items()} for layer in w.layers])


@contextlib.contextmanager
def _no_host_sync(device: torch.device) -> Iterator[None]:
    """On CUDA, a host sync inside is an error (``torch.cuda.set_sync_debug_mode``)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def repair_pass(w: LlamaWeights, case: RepairCase, stale: StaleContext, plan: AnchorPlan, ids: torch.Tensor,
                slots: torch.Tensor, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """One repair pass of the request on ``device`` in ``dtype``.

    Returns: (float32 [vocab] last row's logits, float32 [n_layers, n, Hkv, d] the request's K and
    its V after the pass, on the CPU, and the pass's wall time in ms)."""
    n = ids.numel()
    pool_size = int(slots.max()) + 1
    k_pool = [torch.zeros(pool_size, case.n_kv_heads, case.head_dim, device=device, dtype=dtype)
              for _ in range(case.n_layers)]
    v_pool = [torch.zeros_like(k) for k in k_pool]
    on_device = slots.to(device)
    for l, (k, v) in enumerate(stale.kv):  # the stale context at the request's slots, as reused
        k_pool[l][on_device[: k.shape[0]]], v_pool[l][on_device[: v.shape[0]]] = k.to(device, dtype), v.to(device, dtype)
    pool = types.SimpleNamespace(get_key_buffer=lambda l: k_pool[l], get_value_buffer=lambda l: v_pool[l])
    wd = _on(w, device, dtype)
    rows = repair_rows(n, plan, slots)
    loop = LayerLoop(DeviceLayers(wd), pool, AnchorAttention(), rope=RopeSpec(head_dim=case.head_dim, base=w.rope_theta))
    input_ids = ids[rows.positions].to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with torch.no_grad(), _no_host_sync(device):
        out = loop.run([rows], input_ids)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - t0) * 1e3
    logits = torch.nn.functional.linear(out[-1].float(), wd.lm_head.float()).cpu()
    k_all = torch.stack([k[on_device].float().cpu() for k in k_pool])
    v_all = torch.stack([v[on_device].float().cpu() for v in v_pool])
    return logits, k_all, v_all, ms


def request(case: RepairCase, seed: int):
    """The case's request: random ids, 8 prefix tokens, ``n_chunks`` equal chunks, the query; its
    stale context and ``relaxkv`` plan from the torch reference; scattered pool slots."""
    g = torch.Generator().manual_seed(seed)
    w = random_weights(case, seed)
    n = case.n_context + case.query
    ids = torch.randint(0, case.vocab, (n,), generator=g)
    bounds = torch.linspace(8, case.n_context, case.n_chunks + 1).long().tolist()
    spans = list(zip(bounds[:-1], bounds[1:]))
    stale = stale_context(w, ids, spans, case.n_context)
    config = RepairConfig.from_knobs(anchor_ratio=0.15, context_ratio=0.25, stale_shift="kv")
    plan = plan_anchors("relaxkv", stale.scores, spans, case.n_context, case.n_layers, config)
    slots = torch.randperm(2 * n, generator=g)[:n]
    return w, ids, stale, plan, slots


def run_repair(device: torch.device, seed: int = 0, case: RepairCase = RepairCase()) -> list[dict]:
    """The check's rows: the pass in float32 and bfloat16 on ``device`` against float32 on the CPU."""
    w, ids, stale, plan, slots = request(case, seed)
    ref_logits, ref_k, ref_v, cpu_ms = repair_pass(w, case, stale, plan, ids, slots, torch.device("cpu"), torch.float32)
    rows = []
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        logits, k, v, ms = repair_pass(w, case, stale, plan, ids, slots, device, dtype)
        err = max((logits - ref_logits).abs().max().item(), (k - ref_k).abs().max().item(),
                  (v - ref_v).abs().max().item())
        rows.append({"kind": "repair", "dtype": name, "n_context": case.n_context, "n_layers": case.n_layers,
                     "anchor_layers": int(sum(layout.n_rows for layout in plan.layouts)),
                     "max_abs_err": err, "ms": ms, "cpu_float32_ms": cpu_ms,
                     "ok": err <= TOLERANCE[name] and bool(torch.isfinite(logits).all())})
    return rows
