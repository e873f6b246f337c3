"""The device check of the plugin's repair pass: the layer loop on a GPU against the same loop on the CPU.

The server's executor (:class:`~relaxkv_sglang.repair.sglang.layer_loop.LayerLoop`: anchors, glue and query,
stale shift) runs over stand-in decoder layers (:class:`~relaxkv_sglang.repair.reference.ReferenceLayerOps`
on random SmolLM2-shaped weights) and a KV pool holding one request's stale context at scattered
slots: 10 chunks, 15% anchors, 25% context, the torch planner's ``relaxkv`` plan.

**Correctness** (:func:`run_repair`): steps ``reference`` (float32, CPU), ``float32`` (torch executors
on the device) and ``bfloat16`` (anchors through FlashInfer), each in its own ``try`` (``passed``,
``failed``, ``error`` or ``not run``), each device step after an untimed warm-up (FlashInfer's JIT)
and under ``torch.cuda.set_sync_debug_mode("error")``. Measured: the last row's logits and the
repaired K/V (max abs).

**Speed** (:func:`time_repair`): the same shape at ``n_context`` tokens (random stale K/V, peaked
random scores), bfloat16, median of ``repeats`` for ``relaxkv``, ``relaxkv_fullctx`` (same anchors,
whole prefix) and ``prophetkv`` (its own anchors, whole prefix).

Where a pass runs is a :class:`Placement`: ``on(device)``, or ``under_rules(rules)`` (the CUDA-rules
harness on a CPU, :mod:`relaxkv_sglang.attention.gpu.cuda_rules`, FlashInfer replaced by its torch model).

    python -m relaxkv_sglang.gpu_check --repair-only      (part of the full and --quick checks)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
import traceback
import types
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch

from relaxkv_sglang.model.model_family import finish_layer, project_qkv
from relaxkv_sglang.repair.reference import (
    LlamaWeights, ReferenceLayerOps, StaleContext, apply_neox_rope, stale_context,
)
from relaxkv_sglang.model.reference_model import rms_norm
from relaxkv_sglang.repair.repair_config import RepairConfig
from relaxkv_sglang.repair.anchor_schedule import AnchorSchedule, schedule_anchors
from relaxkv_sglang.model.rope import RopeSpec
from relaxkv_sglang.attention.sglang.anchor_attention import AnchorAttention
from relaxkv_sglang.repair.sglang.layer_loop import LayerLoop
from relaxkv_sglang.forward.repair_stage import repair_rows

TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1}  # max |err| against the float32 reference
TIMED_PLANS = ("relaxkv", "relaxkv_fullctx", "prophetkv")  # relaxed, dense context (same anchors), ProphetKV


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


class FlashInferOnAnyDevice(AnchorAttention):
    """The server's anchor executor, taking FlashInfer's path in half precision on any device: the
    dry run on a plain CPU, where the stand-in FlashInfer (a torch model) runs the call."""

    @staticmethod
    def uses_flashinfer(*args: Any) -> bool:
        """Half precision, whatever the device: args (device, dtype), or tensors (q, k_cache)."""
        dtype = next((a for a in args if isinstance(a, torch.dtype)), None)
        return (dtype if dtype is not None else args[0].dtype) in (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a pass runs; ``put`` and ``take`` (setup and results) move tensors outside the checked pass,
    ``strict`` is the context it runs in (host syncs are errors there), ``anchors`` makes its executor."""

    device: torch.device
    put: Callable[[torch.Tensor], torch.Tensor]
    take: Callable[[torch.Tensor], torch.Tensor]
    strict: Callable[[], ContextManager]
    synchronize: Callable[[], None]
    anchors: Callable[[], AnchorAttention] = AnchorAttention

    @staticmethod
    def on(device: torch.device | str, anchors: Callable[[], AnchorAttention] = AnchorAttention) -> "Placement":
        """A real device (a GPU; the CPU for the reference and tests)."""
        device = torch.device(device)
        cuda = device.type == "cuda"
        return Placement(device, lambda x: x.to(device), lambda x: x.cpu(), lambda: _no_host_sync(device),
                         (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None), anchors)

    @staticmethod
    def under_rules(rules: Any) -> "Placement":
        """The CUDA-rules harness's stand-in device (``rules``: an entered ``CudaRules``): it raises
        on a host sync or a blocking copy anywhere, so the pass needs no extra context."""
        return Placement(torch.device("cuda"), rules.put, rules.take, contextlib.nullcontext, lambda: None)


CPU = Placement.on("cpu")


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
    dtype, q/k/v in the weights' dtype. RoPE's frequencies are ``w.inv_freq``, put on the device
    once with the weights (:func:`_on`), never copied per layer."""

    def qkv_proj(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return super().qkv_proj(x.to(self.layer["q"].dtype))

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv, dtype = self.w.inv_freq, self.layer["q"].dtype
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
        self.model = types.SimpleNamespace(embed_tokens=lambda ids: w.embed.index_select(0, ids).float(),
                                           norm=lambda h: rms_norm(h, w.norm, w.rms_eps))

    def qkv(self, l: int, positions: torch.Tensor, hidden: torch.Tensor):
        return project_qkv(DeviceLayerOps(self.w, self.w.layers[l]), self.w.family, hidden, positions)

    def finish(self, l: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        return finish_layer(DeviceLayerOps(self.w, self.w.layers[l]), hidden, attn_out)

    def attention_params(self, l: int) -> tuple[int, float]:
        return l, self.w.head_dim ** -0.5


def _on(w: LlamaWeights, place: Placement, dtype: torch.dtype) -> LlamaWeights:
    """The weights on the placement's device (the matrices in ``dtype``; the embedding, norms and
    RoPE frequencies float32, as served). Setup, before the pass."""
    def put(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        return place.put(t.to(dt).contiguous())

    return dataclasses.replace(w, embed=put(w.embed, torch.float32), norm=put(w.norm, torch.float32),
                               lm_head=put(w.lm_head, torch.float32), inv_freq=put(w.rope_inv_freq(), torch.float32),
                               layers=[{k: put(t, dtype if t.dim() == 2 else torch.float32) for k, t in layer.items()}
                                       for layer in w.layers])


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


@dataclasses.dataclass
class PreparedPass:
    """One request's repair pass set up on a device: run it with :meth:`run` (any number of times;
    each run repairs the pool again)."""

    loop: LayerLoop
    rows: Any
    input_ids: torch.Tensor
    k_pool: list[torch.Tensor]
    v_pool: list[torch.Tensor]
    slots: torch.Tensor  # on the device
    lm_head: torch.Tensor
    place: Placement

    def run(self) -> tuple[torch.Tensor, float]:
        """One pass: (final-normed hidden on the device, wall ms, device included)."""
        self.place.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad(), self.place.strict():
            out = self.loop.run([self.rows], self.input_ids)
        self.place.synchronize()
        return out, (time.perf_counter() - t0) * 1e3

    def results(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(float32 [vocab] last row's logits, float32 [n_layers, n, Hkv, d] the request's K and its V
        after the pass), on the host."""
        logits = torch.nn.functional.linear(out[-1:].float(), self.lm_head.float())[0]
        k_all = torch.stack([k.index_select(0, self.slots).float() for k in self.k_pool])
        v_all = torch.stack([v.index_select(0, self.slots).float() for v in self.v_pool])
        return self.place.take(logits), self.place.take(k_all), self.place.take(v_all)


def prepare_pass(w: LlamaWeights, case: RepairCase, stale_kv: Optional[list[tuple[torch.Tensor, torch.Tensor]]],
                 schedule: AnchorSchedule, ids: torch.Tensor, slots: torch.Tensor, place: Placement, dtype: torch.dtype,
                 anchors: Optional[AnchorAttention] = None) -> PreparedPass:
    """The request's pass on ``place`` in ``dtype``: the weights, a pool holding the stale context
    at ``slots`` (``stale_kv``: per layer host (k, v) [n_context, Hkv, d]; None: random values made
    on the device, for timing), the loop.

    Args: ids int64 host [n] the request; slots int64 host [n] its pool slots; anchors: the
    executor (default ``place.anchors()``; one may be shared across passes, as a worker does)."""
    n = ids.numel()
    pool_size = int(slots.max()) + 1
    dev = place.device
    on_device = place.put(slots)
    k_pool, v_pool = [], []
    for l in range(case.n_layers):
        if stale_kv is None:  # made on the device (timing only): no host copy of a 32K-token context
            k = torch.randn(pool_size, case.n_kv_heads, case.head_dim, device=dev).to(dtype)
            v = torch.randn(pool_size, case.n_kv_heads, case.head_dim, device=dev).to(dtype)
        else:
            k = torch.zeros(pool_size, case.n_kv_heads, case.head_dim, device=dev, dtype=dtype)
            v = torch.zeros_like(k)
            sk, sv = stale_kv[l]
            k.index_copy_(0, on_device[: sk.shape[0]], place.put(sk.to(dtype)))
            v.index_copy_(0, on_device[: sv.shape[0]], place.put(sv.to(dtype)))
        k_pool.append(k)
        v_pool.append(v)
    pool = types.SimpleNamespace(get_key_buffer=lambda l: k_pool[l], get_value_buffer=lambda l: v_pool[l])
    wd = _on(w, place, dtype)
    rows = repair_rows(n, schedule, slots)
    loop = LayerLoop(DeviceLayers(wd), pool, anchors if anchors is not None else place.anchors(),
                     rope=RopeSpec(head_dim=case.head_dim, base=w.rope_theta))
    input_ids = place.put(ids[rows.positions])
    return PreparedPass(loop, rows, input_ids, k_pool, v_pool, on_device, wd.lm_head, place)


def repair_pass(w: LlamaWeights, case: RepairCase, stale: StaleContext, schedule: AnchorSchedule, ids: torch.Tensor,
                slots: torch.Tensor, place: Placement, dtype: torch.dtype,
                warmup: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
    """After an untimed pass if ``warmup``: (float32 [vocab] last row's logits, float32 [n_layers, n, Hkv, d]
    the request's K and V after the pass, on the CPU, the pass's wall ms, the warm-up's s (0: none))."""
    warmup_s = 0.0
    anchors = place.anchors()
    if warmup:  # its own pool: the compared pass starts from the stale context
        t0 = time.perf_counter()
        prepare_pass(w, case, stale.kv, schedule, ids, slots, place, dtype, anchors).run()
        warmup_s = time.perf_counter() - t0
    prepared = prepare_pass(w, case, stale.kv, schedule, ids, slots, place, dtype, anchors)
    out, ms = prepared.run()
    logits, k, v = prepared.results(out)
    return logits, k, v, ms, warmup_s


def _spans(case: RepairCase, n_context: int) -> list[tuple[int, int]]:
    bounds = torch.linspace(8, n_context, case.n_chunks + 1).long().tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _config() -> RepairConfig:
    return RepairConfig.from_knobs(anchor_ratio=0.15, context_ratio=0.25, stale_shift="kv")


def request(case: RepairCase, seed: int):
    """The case's request: random ids, 8 prefix tokens, ``n_chunks`` equal chunks, the query; its
    stale context and ``relaxkv`` plan from the torch reference; scattered pool slots."""
    g = torch.Generator().manual_seed(seed)
    w = random_weights(case, seed)
    n = case.n_context + case.query
    ids = torch.randint(0, case.vocab, (n,), generator=g)
    spans = _spans(case, case.n_context)
    stale = stale_context(w, ids, spans, case.n_context)
    schedule = schedule_anchors("relaxkv", stale.scores, spans, case.n_context, case.n_layers, _config())
    slots = torch.randperm(2 * n, generator=g)[:n]
    return w, ids, stale, schedule, slots


def error_line(exc: BaseException) -> str:
    """One line naming an exception and where it was raised (the innermost frame of this project
    outside the CUDA-rules harness, else the innermost)."""
    tb = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in tb if "relaxkv_sglang" in f.filename and not f.filename.endswith("cuda_rules.py")]
    frame = (ours or tb)[-1] if tb else None
    where = ""
    if frame is not None:
        path = frame.filename.replace("\\", "/")
        where = (f" at {path.split('relaxkv_sglang/', 1)[-1] if 'relaxkv_sglang/' in path else os.path.basename(path)}"
                 f":{frame.lineno}")
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}{where}: {message}"[:400]


def run_repair(place: Placement | torch.device | str, seed: int = 0, case: RepairCase = RepairCase(),
               log: Callable[[str], None] = lambda line: None) -> list[dict]:
    """The check's rows: the pass in float32 and bfloat16 on ``place`` against float32 on the CPU,
    each step in its own ``try`` (module doc). Row keys: ``step``, ``status`` (passed / failed /
    error / not run), ``error`` (one line), ``s`` (the step's wall time), ``warmup_s``, ``ms``
    (the compared pass), ``max_abs_err``, ``ok``."""
    place = place if isinstance(place, Placement) else Placement.on(place)
    base = {"kind": "repair", "n_context": case.n_context, "n_layers": case.n_layers}
    t0 = time.perf_counter()
    try:
        w, ids, stale, schedule, slots = request(case, seed)
        ref_logits, ref_k, ref_v, cpu_ms, _ = repair_pass(w, case, stale, schedule, ids, slots, CPU, torch.float32)
        reference_error = None
    except Exception as exc:  # noqa: BLE001 (the row says what broke)
        traceback.print_exc()
        reference_error = f"reference: {error_line(exc)}"
    log(f"repair reference (CPU float32, {case.n_context} tokens, {case.n_layers} layers): "
        f"{'done' if reference_error is None else reference_error} in {time.perf_counter() - t0:.1f} s")
    rows = []
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        row = {**base, "step": f"repair {name}", "dtype": name, "ok": False}
        rows.append(row)
        if reference_error is not None:
            row.update(status="not run", error=reference_error)
            continue
        t1 = time.perf_counter()
        try:
            logits, k, v, ms, warmup_s = repair_pass(w, case, stale, schedule, ids, slots, place, dtype, warmup=True)
            err = max((logits - ref_logits).abs().max().item(), (k - ref_k).abs().max().item(),
                      (v - ref_v).abs().max().item())
            ok = err <= TOLERANCE[name] and bool(torch.isfinite(logits).all())
            row.update(status="passed" if ok else "failed", ok=ok, max_abs_err=err, ms=ms, warmup_s=warmup_s,
                       cpu_float32_ms=cpu_ms, anchor_layers=int(sum(layout.n_rows for layout in schedule.layouts)))
            if not ok:
                row["error"] = f"max |err| {err:.3g} > {TOLERANCE[name]}"
        except Exception as exc:  # noqa: BLE001 (the next dtype still runs)
            traceback.print_exc()
            row.update(status="error", error=error_line(exc))
        row["s"] = time.perf_counter() - t1
        log(f"repair {name}: {row['status']} in {row['s']:.1f} s"
            + (f" (warm-up {row['warmup_s']:.1f} s)" if "warmup_s" in row else "")
            + (f": {row['error']}" if "error" in row else ""))
    return rows


def timing_request(case: RepairCase, seed: int, policy: str):
    """Without a reference (``time_repair``): peaked random query scores, like a query's attention."""
    g = torch.Generator().manual_seed(seed)
    w = random_weights(case, seed)
    n = case.n_context + case.query
    ids = torch.randint(0, case.vocab, (n,), generator=g)
    scores = torch.rand(case.n_layers, case.n_context, generator=g) ** 4
    schedule = schedule_anchors(policy, scores, _spans(case, case.n_context), case.n_context, case.n_layers, _config())
    slots = torch.randperm(2 * n, generator=g)[:n]
    return w, ids, schedule, slots


def time_repair(place: Placement, case: RepairCase, seed: int = 0, repeats: int = 5,
                plans: tuple[str, ...] = TIMED_PLANS, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The pass's time for each plan of ``plans`` on one request of ``case``'s shape (module doc):
    median wall ms of ``repeats`` passes after one untimed pass, one anchor executor throughout (as
    a worker). Returns a row: ``<plan>_ms``, ``<plan>_pairs`` (the anchors' attended pairs over the
    layers), ``dense_over_relaxkv`` and ``prophetkv_over_relaxkv`` (time ratios), ``warmup_s``."""
    row: dict = {"kind": "repair_timing", "step": f"repair timing {case.n_context}", "n_context": case.n_context,
                 "n_layers": case.n_layers, "dtype": str(dtype).removeprefix("torch."), "repeats": repeats}
    anchors = place.anchors()
    warmup_s = 0.0
    for policy in plans:
        w, ids, schedule, slots = timing_request(case, seed, policy)
        prepared = prepare_pass(w, case, None, schedule, ids, slots, place, dtype, anchors)
        t0 = time.perf_counter()
        prepared.run()  # untimed: JIT or lazy init, if not done yet
        warmup_s += time.perf_counter() - t0
        times = [prepared.run()[1] for _ in range(repeats)]
        row[f"{policy}_ms"] = statistics.median(times)
        row[f"{policy}_pairs"] = int(sum(layout.kv_pairs() for layout in schedule.layouts))
        row[f"{policy}_anchor_layers"] = int(sum(layout.n_rows for layout in schedule.layouts))
    row["warmup_s"] = warmup_s
    if "relaxkv_ms" in row:
        for other, key in (("relaxkv_fullctx", "dense_over_relaxkv"), ("prophetkv", "prophetkv_over_relaxkv")):
            if f"{other}_ms" in row:
                row[key] = row[f"{other}_ms"] / row["relaxkv_ms"]
    return row
