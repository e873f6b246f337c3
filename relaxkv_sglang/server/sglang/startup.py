"""The ``relaxkv`` tree cache backend: the factory SGLang calls, and how the worker finds it.

Selected with ``--radix-cache-backend relaxkv``. :func:`make_tree_cache` checks the flags, builds
the pool view, lower tiers and cache, then runs the startup gate (:mod:`.gate`) and loads the
repair calibration. The worker finds its cache through
:func:`~relaxkv_sglang.cache.sglang.relaxkv_cache.worker_cache`: no process-wide reference.

SGLang files touched: ``mem_cache/registry.py`` (the backend), ``managers/scheduler.py``
``Scheduler.get_internal_state`` (around, for /get_server_info).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from relaxkv_sglang.runtime.hooks import Hook
from relaxkv_sglang.model.rope import UnsupportedRopeError
from relaxkv_sglang.model.rope_config import rope_spec_from_hf_config
from relaxkv_sglang.runtime.settings import ServerSettings, server_settings
from relaxkv_sglang.repair.sglang.served_calibration import load_served_calibration
from relaxkv_sglang.cache.sglang.relaxkv_cache import attach_worker_cache, worker_cache
from relaxkv_sglang.cache.sglang.chunk_metrics import ChunkMetrics
from relaxkv_sglang.server.sglang.gate import gate_state, run_startup_gate, serving_rope
from relaxkv_sglang.cache.sglang.kv_identity import KVIdentity, kv_identity
from relaxkv_sglang.model.sglang.model_layers import family_line, supports_repair
from relaxkv_sglang.model.sglang.tensor_parallel import served_tensor_parallel
from relaxkv_sglang.forward.repair_stage import RepairTiming
from relaxkv_sglang.repair.sglang.services import RepairServices, attach_repair_services, repair_services
from relaxkv_sglang.runtime import records
from relaxkv_sglang.request.plan import BACKEND_NAME
from relaxkv_sglang.cache.sglang.pool_kv import PoolKV
from relaxkv_sglang.cache.sglang.tier_configs import build_tiers, tier_configs_from_env

if TYPE_CHECKING:
    from sglang.srt.managers.io_struct import GetInternalStateReq
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext
    from sglang.srt.server_args import ServerArgs

    from relaxkv_sglang.cache.sglang.tree_cache_class import RelaxKVTreeCache
    from relaxkv_sglang.cache.tiers import TieredChunkStore

logger = logging.getLogger(__name__)

def build_cache_class() -> type:
    """The cache class (``RelaxKVTreeCache``), imported on first use: it imports SGLang."""
    from relaxkv_sglang.cache.sglang.tree_cache_class import RelaxKVTreeCache

    return RelaxKVTreeCache


def _kv_identity(ctx: "TreeCacheBuildContext", pool_kv: PoolKV, hf_config: dict, fingerprint_mode: str) -> KVIdentity:
    """This scheduler's model identity (:mod:`relaxkv_sglang.cache.sglang.kv_identity`; ``fingerprint_mode``:
    how its weights are hashed), printed in one startup line."""
    server_args = ctx.server_args
    # tensor parallelism: each rank holds its own heads' KV, so the rank is part of the layout
    layout = (f"{pool_kv.layout()} first_layer={pool_kv.layers.start} page_size={ctx.params.page_size} "
              f"tp={ctx.tp_rank}/{getattr(server_args, 'tp_size', 1)}")
    identity = kv_identity(server_args, hf_config, model_dtype=ctx.model_config.dtype,
                           kv_pool_dtype=pool_kv.dtype, layout=layout, fingerprint_mode=fingerprint_mode)
    logger.info(identity.line())
    return identity


def _build_tiers(ctx: "TreeCacheBuildContext", pool_kv: PoolKV, identity: KVIdentity,
                 settings: ServerSettings) -> Optional["TieredChunkStore"]:
    """The lower tiers the server's settings ask for, or None (a malformed variable stops the server)."""
    configs = tier_configs_from_env(settings.environment)
    if not configs:
        return None
    # no chunk is longer than the context: a stored header claiming more is damaged (cache/tiers/value.py)
    tiers = build_tiers(configs, pool_kv, identity.model_identity, int(ctx.model_config.context_len))
    logger.info("relaxkv chunk tiers: %s; identity %s", ", ".join(c.summary() for c in configs), identity.digest)
    return tiers


def make_tree_cache(ctx: "TreeCacheBuildContext") -> Any:
    """Factory for ``register_radix_cache_backend('relaxkv', ...)``."""
    server_args = ctx.server_args
    if server_args.attention_backend != BACKEND_NAME:
        raise SystemExit(
            "relaxkv-sglang: --radix-cache-backend relaxkv needs --attention-backend relaxkv "
            f"(got {server_args.attention_backend!r})"
        )
    if ctx.params.page_size != 1:
        raise SystemExit(f"relaxkv-sglang: chunk reuse needs --page-size 1 (got {ctx.params.page_size})")
    if ctx.enable_hierarchical_cache or ctx.is_hybrid_swa or ctx.is_hybrid_ssm:
        raise SystemExit("relaxkv-sglang: hierarchical, sliding-window and hybrid caches are not supported")
    model = getattr(getattr(ctx.tp_worker, "model_runner", None), "model", None)
    hf_config = ctx.model_config.hf_config.to_dict()
    try:
        rope = rope_spec_from_hf_config(hf_config, is_neox_style=_is_neox_style(model))
    except UnsupportedRopeError as exc:
        raise SystemExit(f"relaxkv-sglang: {exc}") from exc
    settings = server_settings()
    rope = serving_rope(rope, settings.rope_override)  # the rope unless a test swaps it
    pool_kv = PoolKV(ctx.params.token_to_kv_pool_allocator.get_kvcache(), rope)
    metrics = ChunkMetrics({"model_name": served_model_name(server_args)}) if server_args.enable_metrics else None
    identity = _kv_identity(ctx, pool_kv, hf_config, settings.weights_fingerprint)
    tiers = _build_tiers(ctx, pool_kv, identity, settings)
    cache = build_cache_class()(ctx.params, pool_kv, metrics, tiers, admission_hold=settings.admission_hold,
                                kv_identity=identity)
    attach_worker_cache(ctx.tp_worker, cache)
    served = load_served_calibration(server_args.model_path, hf_config, settings, log=ctx.tp_rank == 0)
    attach_repair_services(ctx.tp_worker, RepairServices.of_worker(ctx.tp_worker, pool_kv.kv_pool, rope, served))
    gate = run_startup_gate(ctx.tp_worker, cache, int(ctx.model_config.context_len), tp_rank=ctx.tp_rank,
                            enable_metrics=bool(server_args.enable_metrics))
    if ctx.tp_rank == 0:  # one line: the model's family, whether chunks are reused and whether it repairs
        log = logger.info if model is not None and supports_repair(model) else logger.warning
        log(family_line(model, chunk_reuse=not gate.refuses_chunks))
    logger.info("relaxkv tree cache ready: rope=%s", rope)
    return cache


def served_model_name(server_args: "ServerArgs") -> str:
    """The ``model_name`` label SGLang's own ``sglang:*`` series carry: the served model name,
    which sglang 0.5.23 keeps in its runtime context (not on ``ServerArgs``), else the model path."""
    from sglang.srt.runtime_context import get_serving

    name = getattr(get_serving(), "served_model_name", None) or getattr(server_args, "served_model_name", None)
    return str(name or server_args.model_path)


def around_get_internal_state(original: Callable[..., Any], scheduler: "Scheduler",
                              recv_req: "GetInternalStateReq") -> Any:
    """Hook on ``Scheduler.get_internal_state``: add ``relaxkv`` to /get_server_info."""
    output = original(scheduler, recv_req)
    cache = worker_cache(scheduler.tp_worker)
    if cache is not None:
        services = repair_services(scheduler.tp_worker)
        state = dict(cache.stats(), kv_total_tokens=int(scheduler.max_total_num_tokens), gate=gate_state(cache),
                     calibration=services.calibration.state() if services is not None else None,
                     **repair_timing(cache))
        if cache.kv_identity is not None:
            state["kv_identity"] = cache.kv_identity.describe()
        output.internal_state["relaxkv"] = state
    return output


def repair_timing(cache: "RelaxKVTreeCache") -> dict:
    """The repair stages' count and wall time on this rank, and its tensor-parallel group with the collectives run."""
    held = records.record(cache, RepairTiming, create=False) or RepairTiming()
    ranks = served_tensor_parallel()
    return {"repair_stages": held.stages, "repair_seconds": round(held.seconds, 6),
            "tensor_parallel": {"size": ranks.size, "rank": ranks.rank, "checks": ranks.checks,
                                "collectives": ranks.tally.to_json()}}


def _is_neox_style(model: Optional[torch.nn.Module]) -> bool:
    """Llama/Qwen/Mistral in SGLang use the neox rotation; read it off the model if exposed."""
    for module in (model.modules() if model is not None else ()):
        if hasattr(module, "is_neox_style") and hasattr(module, "cos_sin_cache"):
            return bool(module.is_neox_style)
    return True


#: the SGLang functions this module wraps (registered by ``server/sglang/plugin.py``)
HOOKS = (
    Hook("sglang.srt.managers.scheduler.Scheduler.get_internal_state",
         around_get_internal_state, ("self", "recv_req")),
)
