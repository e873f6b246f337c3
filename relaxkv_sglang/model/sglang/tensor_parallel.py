"""The served model's tensor-parallel ranks: SGLang's TP group coordinator, the one its own layers use, behind
:class:`~relaxkv_sglang.model.tensor_parallel.TensorParallel`: the repair's collectives run on the same path
and in the same per-rank order as SGLang's.

SGLang files touched (read, none hooked): ``distributed/parallel_state.py`` (``get_tp_group``;
``GroupCoordinator.all_reduce``, ``all_gather``, ``world_size``, ``rank_in_group``) and
``runtime_context.py`` (``get_parallel().attn_tp_size``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from relaxkv_sglang.model.tensor_parallel import ONE_RANK, TensorParallel, TimedCollectives
from relaxkv_sglang.runtime.failures import InvariantError
from relaxkv_sglang.runtime.settings import server_settings

if TYPE_CHECKING:
    from sglang.srt.distributed.parallel_state import GroupCoordinator


class GroupCoordinatorRanks(TimedCollectives):
    """SGLang's ``GroupCoordinator`` (the TP group) as :class:`TensorParallel`; a tensor on another device than
    the group's (host-side scores, digests) makes the round trip, since NCCL takes device tensors only."""

    def __init__(self, group: GroupCoordinator, checks: bool) -> None:
        super().__init__(int(group.world_size), int(group.rank_in_group), checks)
        self.group = group
        self.device = torch.device(getattr(group, "device", "cpu"))

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        # in place on a CPU, a new tensor on some GPU paths
        return self.group.all_reduce(x.to(self.device)).to(x.device)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(x.to(self.device), dim=0).to(x.device)


def served_tensor_parallel() -> TensorParallel:
    """This scheduler process's TP ranks, once SGLang has set its groups up (:data:`ONE_RANK` before that, in a
    process without them, or without tensor parallelism)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        group = parallel.tp_group
    except Exception:  # no SGLang groups in this process (a unit test, the HTTP process)
        return ONE_RANK
    if group is None or int(group.world_size) == 1:
        return ONE_RANK
    attn_tp = int(getattr(parallel, "attn_tp_size", group.world_size) or group.world_size)
    if attn_tp != int(group.world_size):
        raise InvariantError(f"relaxkv: attention TP size {attn_tp} differs from the TP size {group.world_size} "
                             "(data-parallel attention): the repair sums its decisions over the TP group")
    return _ranks_of(group)


@functools.cache
def _ranks_of(group: GroupCoordinator) -> GroupCoordinatorRanks:
    """One wrapper per coordinator, so its tally counts every collective of the process."""
    return GroupCoordinatorRanks(group, checks=server_settings().tp_check)
