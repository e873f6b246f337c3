"""Where one request's stale shift (:mod:`relaxkv_sglang.repair.stale_shift`: V += dv, K += R(t) dk, dk before RoPE)
lands in the KV pool, built once per repair pass."""

from __future__ import annotations

from typing import Optional

import torch

from relaxkv_sglang.model.rope import RopeSpec, RotationTable
from relaxkv_sglang.attention.staging import HostStage


class ShiftTarget:
    """The pool slots of one request's shift body (chunk tokens less each chunk's sinks), and R(t) over its span.

    While the positions the span leaves out are rows of the pass (layer < ``span_until``: their writes replace what
    lands on them) and its slots are consecutive, a float32 pool takes the span as two in-place adds; else one add
    per run of consecutive slots (at most ``MAX_RUNS``); else, or for a lower-precision pool, an index add of the
    materialised delta (rounded once, as the reference does). ``slots`` int64 host [>= max position + 1]; ``body``
    int64 host [n_body >= 1] ascending; ``row_*`` int64 host [n_rows]; ``groups`` int64 host [n_body] or None."""

    MAX_RUNS = 64

    def __init__(self, slots: torch.Tensor, body: torch.Tensor, rope: RopeSpec, row_positions: torch.Tensor,
                 row_exits: torch.Tensor, stage: Optional[HostStage] = None,
                 groups: Optional[torch.Tensor] = None) -> None:
        own_stage = stage is None
        stage = HostStage(slots.device) if stage is None else stage
        device = stage.device
        groups = torch.zeros_like(body) if groups is None else groups
        self.grouped = bool((groups != groups[0]).any())  # else every token takes group ``group0``
        self.group0, self._groups = int(groups[0]), stage.put(groups)
        self.first = int(body[0])
        span = int(body[-1]) + 1 - self.first
        # Table row i: position first + i (made on the device).
        self.rotation = RotationTable(torch.arange(self.first, self.first + span, device=device), rope)
        rows = body - self.first
        body_slots = slots[body]
        self._rows, self._slots = stage.put(rows), stage.put(body_slots)
        self.span_slot, self.span = int(slots[self.first]), span
        self.span_until = 0
        if not self.grouped and bool((slots[self.first:self.first + span].diff() == 1).all()):
            # Exit layer per span position (0: no row; body excluded): the min is the first missing a left-out write.
            exit_at = torch.zeros(span, dtype=torch.long)
            inside = (row_positions >= self.first) & (row_positions < self.first + span)
            exit_at[row_positions[inside] - self.first] = row_exits[inside]
            exit_at[rows] = torch.iinfo(torch.int64).max
            self.span_until = int(exit_at.min())
        # Runs over consecutive slots and positions in one group: (first slot, table row, length, group).
        step = (body_slots.diff() != 1) | (body.diff() != 1) | (groups.diff() != 0)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), step.nonzero().flatten() + 1]).tolist()
        ends = starts[1:] + [int(body.numel())]
        self.runs = ([(int(body_slots[a]), int(rows[a]), b - a, int(groups[a])) for a, b in zip(starts, ends)]
                     if len(starts) <= self.MAX_RUNS else None)
        if own_stage:
            stage.send()

    @property
    def groups(self) -> torch.Tensor:
        """int64 [n_body] each body token's shift group, on the device."""
        return self._groups.get()

    @property
    def rows(self) -> torch.Tensor:
        """int64 [n_body] each body token's row of the rotation table, on the device."""
        return self._rows.get()

    @property
    def slots(self) -> torch.Tensor:
        """int64 [n_body] each body token's pool slot, on the device."""
        return self._slots.get()

    def rotate_by(self, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``stale_shift.Rotate`` from the table: k [n, Hkv, d] rotated by ``delta = -p`` (int64
        [n], p inside the body's span) -> float32 [n, Hkv, d]."""
        return self.rotation.rotate(k, rows=-delta - self.first, inverse=True)

    def add(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, dk: Optional[torch.Tensor],
            dv: torch.Tensor) -> None:
        """Add the layer's shift to the body: K += R(t) dk_g (dk float32 [n_groups, Hkv, d] before
        RoPE, None: K unchanged), V += dv_g (float32 [n_groups, Hkv, d]), g each token's group."""
        if k_cache.dtype == v_cache.dtype == torch.float32:
            pieces = [(self.span_slot, 0, self.span, self.group0)] if layer < self.span_until else self.runs
            if pieces is not None:
                for slot, row, n, group in pieces:
                    if dk is not None:
                        self.rotation.add_rotated_(k_cache[slot:slot + n], dk[group], row)
                    v_cache[slot:slot + n].add_(dv[group])
                return
        if dk is not None:
            _add_rows(k_cache, self.slots,
                      self.rotation.rotate(dk[self.groups] if self.grouped else dk[self.group0][None], rows=self.rows))
        # Materialised: index_add_ from an expanded view is slower.
        delta_v = dv[self.groups] if self.grouped else dv[self.group0].expand(self.slots.shape[0], -1, -1)
        _add_rows(v_cache, self.slots, delta_v.contiguous())


def _add_rows(cache: torch.Tensor, slots: torch.Tensor, delta: torch.Tensor) -> None:
    """cache[slots] += delta (slots distinct; delta float32 [n, Hkv, d]); a lower-precision pool rounds once."""
    if cache.dtype == delta.dtype:
        cache.index_add_(0, slots, delta)
    else:
        cache[slots] = (cache[slots].float() + delta).to(cache.dtype)
