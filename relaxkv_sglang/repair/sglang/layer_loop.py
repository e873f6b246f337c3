"""The repair's executor: SGLang's model modules run layer by layer over rows that change per layer.

Each row runs layers ``[0, exit)``: per layer the active rows' K/V go into the pool, then an ordinary row attends
causally from its scope start, an anchor through its layer's block-sparse layout
(:class:`~relaxkv_sglang.attention.sglang.anchor_attention.AnchorAttention`). A policy's step runs before a layer's
writes; its delta lands on its body in the pool (:mod:`.shift_target`), its later layers' anchors replan the pass.
Bookkeeping stays on the host, staged in one copy; the device is read back only by a step that needs it (CacheBlend's
deviation) and the ``layout_at`` ablation (``tests/unit/test_cuda_rules.py`` checks this).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch

from relaxkv_sglang.attention.causal import ScopedCausalGroups
from relaxkv_sglang.attention.block_sparse import AttentionWork
from relaxkv_sglang.repair.policies.base import LayerEdit, MeasuredKV
from relaxkv_sglang.repair.anchor_schedule import AnchorSchedule
from relaxkv_sglang.model.rope import RopeSpec, rotate_keys
from relaxkv_sglang.attention.staging import HostStage, Staged
from relaxkv_sglang.runtime.failures import InvariantError
from relaxkv_sglang.attention.sglang.anchor_attention import AnchorAttention, PreparedAnchors
from relaxkv_sglang.model.sglang.model_layers import ModelLayers
from relaxkv_sglang.model.tensor_parallel import ONE_RANK, check_same, digest
from relaxkv_sglang.repair.sglang.shift_target import ShiftTarget

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import KVCache


@dataclasses.dataclass
class LoopRows:
    """One request's rows in a pass, on the host: ``slots`` int64 [>= max position + 1] the KV-pool slot of every
    position (its ``req_to_token`` row); ``positions`` (ascending), ``exits`` (a row takes part in layers ``[0,
    exits[i])``) and ``scope`` (the first key a non-anchor row attends to) int64 [n]; ``anchor`` bool [n]; ``work``
    the (row, key) pairs of the anchor layouts executed."""

    slots: torch.Tensor
    positions: torch.Tensor
    exits: torch.Tensor
    scope: torch.Tensor
    anchor: torch.Tensor
    anchor_schedule: Optional[AnchorSchedule] = None
    shift_target: Optional["ShiftTarget"] = None
    work: AttentionWork = dataclasses.field(default_factory=AttentionWork)

    @property
    def n_rows(self) -> int:
        """Rows of this request in the pass."""
        return int(self.positions.shape[0])


@dataclasses.dataclass
class _StepRead:
    """One request's step read at one layer (``LayerStep.reads``), staged: int64 [n_s] ``at`` (among its active
    rows), ``positions``, ``pool`` slots and ``groups`` (tags, or None)."""

    at: Staged
    positions: Staged
    pool: Staged
    groups: Optional[Staged]


@dataclasses.dataclass
class _RequestStep:
    """One request's rows at one layer, decided on the host: ``rows`` int64 host [n] (into its ``LoopRows``), their pool
    slots ``written``, the ``plain`` rows (causal from their scope) and the ``anchors``, staged."""

    rows: torch.Tensor
    written: Staged
    plain: Optional[tuple[Staged, ScopedCausalGroups]]
    anchors: Optional[tuple[Staged, torch.Tensor]]
    read: Optional[_StepRead]

    @property
    def n(self) -> int:
        """Rows of the request taking part in the layer."""
        return int(self.rows.shape[0])


@dataclasses.dataclass
class _LayerStep:
    """Every request's rows at one layer: ``active`` and ``positions`` int64 [sum n], ``going_on`` int64 [m] the active
    rows whose hidden state feeds a later layer."""

    requests: list[_RequestStep]
    active: Staged
    positions: Staged
    going_on: Staged


class _PassDecisions:
    """A pass's decisions from layer ``first`` on, made on the host, staged in one copy; rebuilt if a step replans."""

    def __init__(self, requests: list[LoopRows], first: int, n_layers: int, device: torch.device,
                 anchors: AnchorAttention, kv_dtype: torch.dtype, rope: Optional[RopeSpec], digests: bool) -> None:
        stage = HostStage(device)
        self.slots = [stage.put(r.slots) for r in requests]
        for r in requests:
            _prepare_step_target(r, stage, rope)
        self.anchor_runs = [anchors.plan(r.anchor_schedule.layouts, stage, kv_dtype)
                            if r.anchor_schedule is not None and not r.anchor_schedule.ranks_pages_in_layer else None
                            for r in requests]
        self.layers: dict[int, _LayerStep] = {}
        self.digests: dict[int, int] = {}  # per layer, what every rank must have decided alike (when checked)
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
                going_on.append((~_leaves_after(r, l, rows)).nonzero().flatten() + start)
                start += rows.numel()
            active = torch.cat([rows + off for rows, off in zip(layer_rows, offsets)])
            positions = torch.cat([r.positions[rows] for r, rows in zip(requests, layer_rows)])
            self.layers[l] = _LayerStep(steps, stage.put(active), stage.put(positions), stage.put(torch.cat(going_on)))
            if digests:
                self.digests[l] = _layer_digest(requests, l, layer_rows)
        stage.send()


def _layer_digest(requests: list[LoopRows], l: int, layer_rows: list[torch.Tensor]) -> int:
    """A digest of layer l's rows (positions, anchors, scopes) and anchor layouts, over the pass's requests."""
    parts: list = [l]
    for r, rows in zip(requests, layer_rows):
        parts += [r.positions[rows], r.anchor[rows], r.scope[rows]]
        schedule = r.anchor_schedule
        if schedule is not None and l < len(schedule.layouts):
            layout = schedule.layouts[l]
            parts += [layout.q_pos, layout.row_indptr, layout.indptr, layout.indices, layout.page_size, layout.n_keys]
    return digest(*parts)


def _leaves_after(r: LoopRows, l: int, rows: torch.Tensor) -> torch.Tensor:
    """bool [n]: which rows (host int64 [n]) are anchors at their last layer l, whose hidden state feeds nothing;
    not at a plan's last decided layer, since an anchor a step keeps past it needs that hidden state."""
    leaves = r.anchor[rows] & (r.exits[rows] <= l + 1)
    schedule = r.anchor_schedule
    if schedule is not None and schedule.decided_layers < schedule.n_layers:
        leaves &= r.exits[rows] < schedule.decided_layers
    return leaves


def _request_step(r: LoopRows, l: int, rows: torch.Tensor, stage: HostStage) -> _RequestStep:
    """One request's rows at layer l (rows: host int64, its rows taking part)."""
    pos, scope, anchor = r.positions[rows], r.scope[rows], r.anchor[rows]
    plain_rows = (~anchor).nonzero().flatten()
    plain = ((stage.put(plain_rows), ScopedCausalGroups(pos[plain_rows], scope[plain_rows], stage))
             if plain_rows.numel() else None)
    anchor_rows = anchor.nonzero().flatten()
    anchors = (stage.put(anchor_rows), pos[anchor_rows]) if anchor_rows.numel() else None
    return _RequestStep(rows, stage.put(r.slots[pos]), plain, anchors, _step_read(r, l, pos, stage))


def _step_read(r: LoopRows, l: int, pos: torch.Tensor, stage: HostStage) -> Optional[_StepRead]:
    """What the plan's step reads at layer l among the request's active rows (pos: their positions)."""
    step = r.anchor_schedule.layer_step if r.anchor_schedule is not None else None
    read = step.reads(l) if step is not None and pos.numel() else None
    if read is None or read.positions.numel() == 0:
        return None
    at = torch.searchsorted(pos, read.positions)
    if not torch.equal(pos[at.clamp(max=pos.shape[0] - 1)], read.positions):
        raise InvariantError("relaxkv: a layer step reads positions that are not the layer's rows")
    groups = stage.put(read.groups) if read.groups is not None else None
    return _StepRead(stage.put(at), stage.put(read.positions), stage.put(r.slots[read.positions]), groups)


class LayerLoop:
    """Runs the model layer by layer over rows that may leave at any layer."""

    def __init__(self, layers: ModelLayers, kv_pool: "KVCache", anchor_attention: AnchorAttention,
                 rope: Optional[RopeSpec] = None) -> None:
        self.layers = layers
        self.kv_pool = kv_pool
        self.anchor_attention = anchor_attention
        self.rope = rope  # the served RoPE: the stale shift compares K before it (repair/stale_shift.py)
        self.ranks = getattr(layers, "ranks", ONE_RANK)  # layers of one rank's own (a test's, the GPU check's)

    def run(self, requests: list[LoopRows], input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [sum n_rows] (requests' rows in order, on the model's device) ->
        final-normed hidden [sum n_rows, hidden] (module doc: host and device)."""
        for r in requests:
            _check_on_host(r)
        model = self.layers.model
        n_layers = self.layers.n_layers
        kv_dtype = self.kv_pool.get_key_buffer(self.layers.attention_params(0)[0]).dtype if n_layers else None
        decisions = self._decide(requests, 0, input_ids.device, kv_dtype)
        hidden = model.embed_tokens(input_ids)
        for l in range(n_layers):
            step = decisions.layers.get(l)
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
            spans, start, replanned = [], 0, False
            for r, s in zip(requests, step.requests):
                spans.append((start, start + s.n))
                if s.n:
                    k_r, v_r = k[start:start + s.n], v[start:start + s.n]
                    # The step reads the anchors' pooled K/V and its delta lands before the rows' writes.
                    replanned |= self._layer_step(r, l, s, k_r, v_r, k_cache, v_cache)
                    written = s.written.get()
                    k_cache[written] = k_r.to(k_cache.dtype)
                    v_cache[written] = v_r.to(v_cache.dtype)
                start += s.n
            for i, (r, s, (s0, s1)) in enumerate(zip(requests, step.requests, spans)):
                if s1 > s0:
                    out[s0:s1] = self._attend(r, l, s, decisions.slots[i].get(), decisions.anchor_runs[i], q[s0:s1],
                                              k_cache, v_cache, scale)
            # An anchor's hidden state after its last layer feeds nothing: o_proj and the MLP skip it.
            going_on = step.going_on.get()
            hidden[active.index_select(0, going_on)] = self.layers.finish(l, h.index_select(0, going_on),
                                                                         out.index_select(0, going_on))
            if replanned:
                decisions = self._decide(requests, l + 1, input_ids.device, kv_dtype)
        return model.norm(hidden)

    def _decide(self, requests: list[LoopRows], first: int, device: torch.device,
                kv_dtype: Optional[torch.dtype]) -> _PassDecisions:
        """The pass's decisions from layer ``first``; under tensor parallelism with checks on, compared across
        ranks first (one gather: a disagreement raises naming the layer, before any collective of the pass)."""
        ranks = self.ranks
        checked = ranks.size > 1 and ranks.checks
        decisions = _PassDecisions(requests, first, self.layers.n_layers, device, self.anchor_attention, kv_dtype,
                                   self.rope, digests=checked)
        layers = range(self.layers.n_layers)  # one entry per layer, so every rank gathers as many
        check_same(ranks, [decisions.digests.get(l, 0) for l in layers], [f"layer {l}" for l in layers],
                   "the repair pass's rows and anchors")
        return decisions

    def _layer_step(self, r: LoopRows, l: int, s: _RequestStep, k_new: torch.Tensor, v_new: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Run the plan's step at layer l before its writes (k_new, v_new [n_active, Hkv, d]: the active rows' new
        K/V, in position order): its delta added to its body, its later layers planned. Whether it replanned."""
        read = s.read
        if read is None:
            return False
        schedule, target = r.anchor_schedule, r.shift_target
        at, pool = read.at.get(), read.pool.get()
        rotate = target.rotate_by if target is not None else self._rotate
        edit: LayerEdit = schedule.layer_step.run(l, MeasuredKV(
            read.positions.get(), read.groups.get() if read.groups is not None else None, k_new.index_select(0, at),
            v_new.index_select(0, at), k_cache[pool], v_cache[pool], rotate, self.ranks))
        if edit.body_dv is not None or edit.body_dk is not None:
            if target is None:
                raise InvariantError("relaxkv: a layer step returned a delta but declares no body")
            dv = edit.body_dv if edit.body_dv is not None else torch.zeros_like(edit.body_dk)
            target.add(l, k_cache, v_cache, edit.body_dk, dv)
        if edit.later_sets is None:
            return False
        r.anchor_schedule = schedule.with_later_layers(edit.later_sets)
        r.exits[r.anchor] = r.anchor_schedule.exit_layers()[r.positions[r.anchor]]
        r.shift_target = None  # the new plan's step, if any, has its own body
        return True

    def _rotate(self, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``MeasuredKV.rotate`` of a step without a body: the served RoPE's re-rotation."""
        if self.rope is None:
            raise InvariantError("relaxkv: a layer step needs the served RoPE (LayerLoop(rope=...))")
        return rotate_keys(k, delta, self.rope)

    def _attend(self, r: LoopRows, l: int, s: _RequestStep, slots: torch.Tensor, anchors: Optional[PreparedAnchors],
                q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """One request's active rows ``s`` at layer l: q [n, H, d] -> [n, H, dv]; slots int64 on the device."""
        out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=q.dtype, device=q.device)
        if s.plain is not None:
            at, scoped = s.plain[0].get(), s.plain[1]
            out[at] = scoped.run(q.index_select(0, at), k_cache, v_cache, slots, scale)
        if s.anchors is not None:
            at, anchor_pos = s.anchors[0].get(), s.anchors[1]
            schedule = r.anchor_schedule
            q_anchors = q.index_select(0, at)
            if schedule.ranks_pages_in_layer:  # the ablation: the layer's queries rank the pages (reads the device)
                layout = schedule.layout_at(l, q_anchors, k_cache[slots[:schedule.n_context]])
            else:
                layout = schedule.layouts[l]
            if not torch.equal(layout.q_pos, anchor_pos):
                raise InvariantError("relaxkv: layout rows do not match the layer's anchors")
            if anchors is None:
                out[at] = self.anchor_attention(q_anchors, k_cache, v_cache, layout, scale, slots, r.work)
            else:
                out[at] = anchors.run(l, q_anchors, k_cache, v_cache, slots, scale, r.work)
        return out


def _check_on_host(r: LoopRows) -> None:
    """The pass's bookkeeping stays on the host: a device tensor here would make every layer read it back."""
    for name in ("slots", "positions", "exits", "scope", "anchor"):
        if getattr(r, name).device.type != "cpu":
            raise InvariantError(f"relaxkv: the repair pass's {name} must be a host tensor, "
                                 f"got {getattr(r, name).device}")


def _prepare_step_target(r: LoopRows, stage: HostStage, rope: Optional[RopeSpec]) -> None:
    """Build where the plan's step's body lies in the pool, once per plan (its device indices on stage)."""
    schedule = r.anchor_schedule
    step = schedule.layer_step if schedule is not None else None
    if r.shift_target is not None or step is None or step.body is None or step.body.numel() == 0:
        return
    if rope is None:
        raise InvariantError("relaxkv: a layer step with a body needs the served RoPE (LayerLoop(rope=...))")
    r.shift_target = ShiftTarget(r.slots, step.body, rope, r.positions, r.exits, stage, groups=step.body_groups)
