"""The repair's executor: SGLang's model modules run layer by layer over rows that change per layer.

:class:`LayerLoop` runs the embedding, every decoder layer and the final norm of the served model
(reached through :class:`~.model_layers.ModelLayers`) over rows, each in layers ``[0, exit)``. Per
layer it writes the active rows' K/V into the pool, then attends: an ordinary row to its causal
prefix from its scope start (:func:`~relaxkv_sglang.core.attention.scoped_causal_attention`), an
anchor through its layer's block-sparse layout (:class:`~.anchor_attention.AnchorAttention`). At an
anchor's last layer only its K/V matter, so o_proj and the MLP skip it. With the stale shift
(``RepairConfig.stale_shift``) the anchors' mean K/V deviation is added to the request's own
copies of its non-anchor chunk tokens (:mod:`.shift_target`).

Host and device: a pass's bookkeeping (:class:`LoopRows`) is on the host; every layer's rows and
executor plans are decided up front and sent in one
:class:`~relaxkv_sglang.core.staging.HostStage` copy, and the device is never read back, except at
CacheBlend's check layer and for the ``layout_at`` ablation (``tests/unit/test_cuda_rules.py``
checks this on the CPU). It executes decisions and makes none: they come from :mod:`.repair`
over :mod:`relaxkv_sglang.core.repair_plan`; it is called by :class:`~.repair.RepairStage`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch

from relaxkv_sglang.core.attention import ScopedCausalPlan
from relaxkv_sglang.core.block_sparse import AttentionWork
from relaxkv_sglang.core.repair_plan import AnchorPlan
from relaxkv_sglang.core.rope import RopeSpec
from relaxkv_sglang.core.stale_shift import shift_deltas
from relaxkv_sglang.core.staging import HostStage, Staged, to_device
from relaxkv_sglang.srt.failures import InvariantError
from relaxkv_sglang.srt.forward.anchor_attention import AnchorAttention, AnchorPlanRun
from relaxkv_sglang.srt.forward.model_layers import ModelLayers
from relaxkv_sglang.srt.forward.shift_target import ShiftTarget

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import KVCache


@dataclasses.dataclass
class LoopRows:
    """One request's rows in a pass of the layer loop.

    Every tensor lives on the host (CPU); :class:`LayerLoop` copies what the device needs.

    Attributes:
        slots: int64 [>= max position + 1] KV-pool slot of every position (the
            request's ``req_to_token`` row, read once).
        positions: int64 [n] position of each row, ascending.
        exits: int64 [n] a row takes part in layers ``[0, exits[i])``.
        scope: int64 [n] first key position a non-anchor row attends to
            (0: its causal prefix; a chunk's start: that chunk only).
        anchor: bool [n] repair targets: they attend through ``anchor_plan.layouts``.
        anchor_plan: the planner's decisions (None: no anchors in this pass).
        shift_target: the stale shift's body in the pool (:class:`~.shift_target.ShiftTarget`), built when
            the pass starts (a relaxkv plan is fixed for the pass; only CacheBlend's changes,
            and it never shifts).
        work: the (row, key) pairs of the anchor layouts executed in this pass (the report's).
    """

    slots: torch.Tensor
    positions: torch.Tensor
    exits: torch.Tensor
    scope: torch.Tensor
    anchor: torch.Tensor
    anchor_plan: Optional[AnchorPlan] = None
    shift_target: Optional["ShiftTarget"] = None
    work: AttentionWork = dataclasses.field(default_factory=AttentionWork)

    @property
    def n_rows(self) -> int:
        """Rows of this request in the pass."""
        return int(self.positions.shape[0])


@dataclasses.dataclass
class _ShiftStep:
    """One request's stale shift at one layer: its sources among the layer's rows (staged).

    Attributes: at: int64 [n_s] the sources among the request's active rows; sources: int64 [n_s]
    their positions; pool: int64 [n_s] their pool slots; groups: int64 [n_s] their shift groups
    (None: one group)."""

    at: Staged
    sources: Staged
    pool: Staged
    groups: Optional[Staged]


@dataclasses.dataclass
class _RequestStep:
    """One request's rows at one layer, decided on the host; the device's indices on the stage.

    Attributes:
        rows: int64 host [n] the request's rows taking part (indices into its ``LoopRows``).
        written: int64 [n] their pool slots (staged).
        plain: the rows among them attending causally from their scope (staged) and the plan.
        anchors: the anchors among them (staged), and their positions (host: checked against
            the layout).
        shift: the layer's stale shift, if any.
    """

    rows: torch.Tensor
    written: Staged
    plain: Optional[tuple[Staged, ScopedCausalPlan]]
    anchors: Optional[tuple[Staged, torch.Tensor]]
    shift: Optional[_ShiftStep]

    @property
    def n(self) -> int:
        """Rows of the request taking part in the layer."""
        return int(self.rows.shape[0])


@dataclasses.dataclass
class _LayerStep:
    """Every request's rows at one layer: ``active`` int64 [sum n] the rows of the pass taking
    part, ``positions`` int64 [sum n] theirs, ``going_on`` int64 [m] those (among the active) whose
    hidden state feeds a later layer."""

    requests: list[_RequestStep]
    active: Staged
    positions: Staged
    going_on: Staged


class _PassPlan:
    """A pass's decisions from layer ``first`` on, made on the host and staged in one copy
    (``stage.send``): every layer's rows, scopes, anchors and shift, the anchors' executor plans,
    each request's pool slots and stale-shift target. Rebuilt from the next layer when CacheBlend's
    check layer changes a plan."""

    def __init__(self, requests: list[LoopRows], first: int, n_layers: int, device: torch.device,
                 anchors: AnchorAttention, kv_dtype: torch.dtype, rope: Optional[RopeSpec]) -> None:
        stage = HostStage(device)
        self.slots = [stage.put(r.slots) for r in requests]
        for r in requests:
            _prepare_shift(r, stage, rope)
        self.anchor_runs = [anchors.plan(r.anchor_plan.layouts, stage, kv_dtype)
                            if r.anchor_plan is not None and not r.anchor_plan.ranks_pages_in_layer else None
                            for r in requests]
        self.layers: dict[int, _LayerStep] = {}
        offsets = [0]
        for r in requests:
            offsets.append(offsets[-1] + r.n_rows)
        for l in range(first, n_layers):
            layer_rows = [(r.exits > l).nonzero().flatten() for r in requests]
            if not any(rows.numel() for rows in layer_rows):
                break
            steps, going_on, start = [], [], 0
            for r, rows in zip(requests, layer_rows):
                steps.append(_request_step(r, l, rows, stage))
                going_on.append((~(r.anchor[rows] & (r.exits[rows] <= l + 1))).nonzero().flatten() + start)
                start += rows.numel()
            active = torch.cat([rows + off for rows, off in zip(layer_rows, offsets)])
            positions = torch.cat([r.positions[rows] for r, rows in zip(requests, layer_rows)])
            self.layers[l] = _LayerStep(steps, stage.put(active), stage.put(positions), stage.put(torch.cat(going_on)))
        stage.send()


def _request_step(r: LoopRows, l: int, rows: torch.Tensor, stage: HostStage) -> _RequestStep:
    """One request's rows at layer l (rows: host int64, its rows taking part)."""
    pos, scope, anchor = r.positions[rows], r.scope[rows], r.anchor[rows]
    plain_rows = (~anchor).nonzero().flatten()
    plain = ((stage.put(plain_rows), ScopedCausalPlan(pos[plain_rows], scope[plain_rows], stage))
             if plain_rows.numel() else None)
    anchor_rows = anchor.nonzero().flatten()
    anchors = (stage.put(anchor_rows), pos[anchor_rows]) if anchor_rows.numel() else None
    return _RequestStep(rows, stage.put(r.slots[pos]), plain, anchors, _shift_step(r, l, pos, stage))


def _shift_step(r: LoopRows, l: int, pos: torch.Tensor, stage: HostStage) -> Optional[_ShiftStep]:
    """The stale shift's sources at layer l among the request's active rows (pos: their positions)."""
    plan = r.anchor_plan
    if r.shift_target is None or pos.numel() == 0:
        return None
    sources = plan.shift_sources(l)  # host, as the plan
    if sources.numel() == 0:
        return None
    at = torch.searchsorted(pos, sources)
    if not torch.equal(pos[at.clamp(max=pos.shape[0] - 1)], sources):
        raise InvariantError("relaxkv: the stale shift's anchors are not the layer's rows")
    groups = stage.put(plan.shift_group_of[sources]) if plan.n_shift_groups > 1 else None
    return _ShiftStep(stage.put(at), stage.put(sources), stage.put(r.slots[sources]), groups)


class LayerLoop:
    """Runs the model layer by layer over rows that may leave at any layer."""

    def __init__(self, layers: ModelLayers, kv_pool: "KVCache", anchor_attention: AnchorAttention,
                 rope: Optional[RopeSpec] = None) -> None:
        self.layers = layers
        self.kv_pool = kv_pool
        self.anchor_attention = anchor_attention
        self.rope = rope  # the served RoPE: the stale shift compares K before it (core/stale_shift.py)

    def run(self, requests: list[LoopRows], input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [sum n_rows] (requests' rows in order, on the model's device) ->
        final-normed hidden [sum n_rows, hidden] (module doc: host and device)."""
        for r in requests:
            _check_on_host(r)
        model = self.layers.model
        n_layers = self.layers.n_layers
        kv_dtype = self.kv_pool.get_key_buffer(self.layers.attention_params(0)[0]).dtype if n_layers else None
        plan = self._plan(requests, 0, input_ids.device, kv_dtype)
        hidden = model.embed_tokens(input_ids)
        for l in range(n_layers):
            step = plan.layers.get(l)
            if step is None:
                break
            active = step.active.get()
            h = hidden.index_select(0, active)
            q, k, v = self.layers.qkv(l, step.positions.get(), h)
            layer_id, scale = self.layers.attention_params(l)
            k_cache = self.kv_pool.get_key_buffer(layer_id)
            v_cache = self.kv_pool.get_value_buffer(layer_id)
            out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
            # Write every active row's K/V first: rows attend to each other's new KV.
            spans, start, decided = [], 0, False
            for i, (r, s) in enumerate(zip(requests, step.requests)):
                spans.append((start, start + s.n))
                if s.n:
                    k_r, v_r = k[start:start + s.n], v[start:start + s.n]
                    decided |= _decide_after_check_layer(r, l, s, plan.slots[i].get(), k_r, v_r, k_cache, v_cache)
                    # The shift reads the anchors' stale K/V and lands before the rows' writes.
                    _stale_shift(r, l, s, k_r, v_r, k_cache, v_cache)
                    written = s.written.get()
                    k_cache[written] = k_r.to(k_cache.dtype)
                    v_cache[written] = v_r.to(v_cache.dtype)
                start += s.n
            for i, (r, s, (s0, s1)) in enumerate(zip(requests, step.requests, spans)):
                if s1 > s0:
                    out[s0:s1] = self._attend(r, l, s, plan.slots[i].get(), plan.anchor_runs[i], q[s0:s1], k_cache,
                                              v_cache, scale)
            # An anchor's hidden state after its last layer feeds nothing (only its K/V of the
            # layers it took part in are kept): o_proj and the MLP run for the other rows only.
            going_on = step.going_on.get()
            hidden[active.index_select(0, going_on)] = self.layers.finish(l, h.index_select(0, going_on),
                                                                         out.index_select(0, going_on))
            if decided:  # CacheBlend chose the later layers: decide them again
                plan = self._plan(requests, l + 1, input_ids.device, kv_dtype)
        return model.norm(hidden)

    def _plan(self, requests: list[LoopRows], first: int, device: torch.device,
              kv_dtype: Optional[torch.dtype]) -> _PassPlan:
        return _PassPlan(requests, first, self.layers.n_layers, device, self.anchor_attention, kv_dtype, self.rope)

    def _attend(self, r: LoopRows, l: int, s: _RequestStep, slots: torch.Tensor, anchors: Optional[AnchorPlanRun],
                q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """One request's active rows at layer l (``s``), slots int64 [>= positions] on the device,
        q [n, H, d] -> [n, H, dv]."""
        out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=q.dtype, device=q.device)
        if s.plain is not None:
            at, scoped = s.plain[0].get(), s.plain[1]
            out[at] = scoped.run(q.index_select(0, at), k_cache, v_cache, slots, scale)
        if s.anchors is not None:
            at, anchor_pos = s.anchors[0].get(), s.anchors[1]
            plan = r.anchor_plan
            q_anchors = q.index_select(0, at)
            if plan.ranks_pages_in_layer:  # the ablation: the layer's queries rank the pages (reads the device)
                layout = plan.layout_at(l, q_anchors, k_cache[slots[:plan.n_context]])
            else:
                layout = plan.layouts[l]
            if not torch.equal(layout.q_pos, anchor_pos):
                raise InvariantError("relaxkv: layout rows do not match the layer's anchors")
            if anchors is None:
                out[at] = self.anchor_attention(q_anchors, k_cache, v_cache, layout, scale, slots, r.work)
            else:
                out[at] = anchors.run(l, q_anchors, k_cache, v_cache, slots, scale, r.work)
        return out


def _check_on_host(r: LoopRows) -> None:
    """The pass's bookkeeping stays on the host (module doc); a device tensor here would make
    every layer read it back."""
    for name in ("slots", "positions", "exits", "scope", "anchor"):
        if getattr(r, name).device.type != "cpu":
            raise InvariantError(f"relaxkv: the repair pass's {name} must be a host tensor, got {getattr(r, name).device}")


def _prepare_shift(r: LoopRows, stage: HostStage, rope: Optional[RopeSpec]) -> None:
    """Build the request's stale-shift body once, when its pass is planned (its device indices on stage)."""
    plan = r.anchor_plan
    if r.shift_target is not None or plan is None or plan.stale_shift == "none" or plan.shift_body.numel() == 0:
        return
    if rope is None:
        raise InvariantError("relaxkv: the stale shift needs the served RoPE (LayerLoop(rope=...))")
    r.shift_target = ShiftTarget(r.slots, plan.shift_body, rope, r.positions, r.exits, stage,
                                 groups=plan.shift_group_of[plan.shift_body] if plan.n_shift_groups > 1 else None)


def _decide_after_check_layer(r: LoopRows, l: int, s: _RequestStep, slots: torch.Tensor, k_new: torch.Tensor,
                              v_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """CacheBlend: at the check layer, before its K/V are written, hand the recomputed and the
    cached K/V to the plan, which chooses the later layers (slots: device). Whether it did.

    The one read of the device in a pass (its deviation decides on the host), and the one copy to
    it outside the pass's stage (the check layer's anchors)."""
    plan = r.anchor_plan
    if plan is None or not plan.decides_at(l):
        return False
    sel = r.anchor[s.rows].nonzero().flatten()
    pos = r.positions[s.rows][sel]
    at, pool = to_device(sel, k_new.device), slots[to_device(pos, slots.device)]
    r.anchor_plan = plan.after_check_layer(pos, k_new.index_select(0, at), v_new.index_select(0, at), k_cache[pool],
                                           v_cache[pool])
    r.exits[r.anchor] = r.anchor_plan.exit_layers()[r.positions[r.anchor]]
    return True


def _stale_shift(r: LoopRows, l: int, s: _RequestStep, k_new: torch.Tensor, v_new: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Add the plan's stale shift at layer l (core/stale_shift.py) to the pool, before the layer's
    writes. It goes to the whole shift body, this layer's anchors included: their new K/V are
    written next and replace it, which leaves exactly T_l shifted without splitting the body
    every layer.

    k_new, v_new: [n_active, Hkv, d] the request's active rows' new K/V, rows in position order.
    """
    plan, target, shift = r.anchor_plan, r.shift_target, s.shift
    if target is None or shift is None:
        return
    at, pool = shift.at.get(), shift.pool.get()
    groups = shift.groups.get() if shift.groups is not None else None
    dk, dv = shift_deltas(plan.stale_shift, shift.sources.get(), k_new.index_select(0, at), v_new.index_select(0, at),
                          k_cache[pool], v_cache[pool], target.rotate_by, plan.stale_shift_scale, groups,
                          plan.n_shift_groups, plan.stale_shift_prior)
    target.add(l, k_cache, v_cache, dk if plan.stale_shift == "kv" else None, dv)
