"""What the repair stage uses of the served model, its pool and its attention backend: built once at startup
(``server/sglang/startup.py``), so the stage reads typed fields, not attributes on SGLang's objects."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch

from relaxkv_sglang.attention.sglang.anchor_attention import AnchorAttention
from relaxkv_sglang.model.rope import RopeSpec
from relaxkv_sglang.repair.repair_config import RepairCost
from relaxkv_sglang.repair.sglang.served_calibration import ServedCalibration
from relaxkv_sglang.runtime import records

if TYPE_CHECKING:
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.mem_cache.memory_pool import KVCache


@dataclasses.dataclass(frozen=True)
class RepairServices:
    """``anchor_attention``: the attention backend's anchor executor (it shares its FlashInfer workspace); ``lm_head``:
    this rank's (a vocabulary shard under tensor parallelism), through which the auto budget reads ``pic``'s answer;
    ``vocab_size`` without SGLang's padding; ``rope`` the served RoPE (the stale shift compares K before it);
    ``calibration``: every repair's base config and the server's budget settings."""

    anchor_attention: AnchorAttention
    cost: RepairCost
    lm_head: Optional[torch.nn.Module]
    vocab_size: int
    kv_pool: "KVCache"
    rope: Optional[RopeSpec]
    calibration: ServedCalibration

    @classmethod
    def of_worker(cls, worker: "TpModelWorker", kv_pool: "KVCache", rope: Optional[RopeSpec],
                  calibration: ServedCalibration) -> "RepairServices":
        """The services of ``worker``'s model runner (its ``relaxkv`` attention backend built the anchor executor)."""
        runner = worker.model_runner
        return cls(anchor_attention=runner.attn_backend.anchor_attention,
                   cost=RepairCost.from_hf_config(runner.model_config.hf_config.to_dict(),
                                                  str(runner.device).split(":")[0]),
                   lm_head=getattr(runner.model, "lm_head", None), vocab_size=int(runner.model_config.vocab_size),
                   kv_pool=kv_pool, rope=rope, calibration=calibration)


def attach_repair_services(worker: "TpModelWorker", services: RepairServices) -> None:
    """Keep ``services`` on ``worker`` (the tree cache factory's call), for :func:`repair_services`."""
    records.attach(worker, services)


def repair_services(worker: "TpModelWorker") -> Optional[RepairServices]:
    """The repair's services of this scheduler's worker (None before startup built them)."""
    return records.record(worker, RepairServices, create=False)
