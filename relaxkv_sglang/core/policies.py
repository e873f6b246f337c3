"""The policy registry: every way a request can be prefilled, and what each one implies.

One enum is the single list of policies. Everything else (the server's accepted values, which
policies reuse chunks, which repair, which need the query pass, which context the anchors
attend to) is a property of a member, so adding a policy is one line here plus its anchor rule
in :func:`relaxkv_sglang.core.selection.select_anchors`.

==================  ========  ============  =======  =============  ===========
policy              served    reuses chunks repairs  query scores   context
==================  ========  ============  =======  =============  ===========
full                yes       no            no       no             (causal)
prefix              yes       no            no       no             (causal)
pic                 yes       yes           no       no             (none)
epic                yes       yes           yes      no             full
cacheblend          yes       yes           yes      no             full
prophetkv           yes       yes           yes      yes            full
relaxkv             yes       yes           yes      yes            topk
relaxkv_fullctx     yes       yes           yes      yes            full
relaxkv_randctx     yes       yes           yes      yes            random
random              no        yes           yes      no             full
==================  ========  ============  =======  =============  ===========

``prefix`` is SGLang's own radix cache (the server's baseline); ``random`` is a control the
torch reference runs but the server does not accept.
"""

from __future__ import annotations

import enum

__all__ = ["Policy", "SERVER_POLICIES", "CHUNK_POLICIES", "REPAIR_POLICIES", "DEFAULT_POLICY"]


class Policy(str, enum.Enum):
    """How a request with reused chunks is prefilled.

    full             ordinary causal prefill, no reuse at all.
    prefix           SGLang's radix cache: exact prefix reuse only.
    pic              chunks' independent (re-rotated) KV, no repair.
    epic             first k tokens of each chunk, every layer, full causal context.
    cacheblend       all tokens up to a check layer, then top-r by K/V deviation, full context.
    prophetkv        top-r by layer-averaged query attention, every layer, full context.
    relaxkv          per-layer nested targets from s_l, relaxed (query-relevant) context.
    relaxkv_fullctx  relaxkv targets, full causal context (ablation).
    relaxkv_randctx  relaxkv targets, random context of the same budget (ablation).
    random           uniformly random targets, every layer, full context (reference-only control).
    """

    FULL = "full"
    PREFIX = "prefix"
    PIC = "pic"
    EPIC = "epic"
    CACHEBLEND = "cacheblend"
    PROPHETKV = "prophetkv"
    RELAXKV = "relaxkv"
    RELAXKV_FULLCTX = "relaxkv_fullctx"
    RELAXKV_RANDCTX = "relaxkv_randctx"
    RANDOM = "random"

    @property
    def served(self) -> bool:
        """Whether the server accepts it as a request's policy."""
        return self is not Policy.RANDOM

    @property
    def reuses_chunks(self) -> bool:
        """Chunk KV comes from the position-independent chunk tree."""
        return self not in (Policy.FULL, Policy.PREFIX)

    @property
    def repairs(self) -> bool:
        """Reused chunk tokens are selectively recomputed (anchors)."""
        return self.reuses_chunks and self is not Policy.PIC

    @property
    def needs_query_scores(self) -> bool:
        """True when targets (or context) are chosen from the stale query pass s_l."""
        return self in (Policy.PROPHETKV, Policy.RELAXKV, Policy.RELAXKV_FULLCTX, Policy.RELAXKV_RANDCTX)

    @property
    def context_mode(self) -> str:
        """Context of the anchors: 'full' (causal prefix), 'topk' (relaxed) or 'random'."""
        if self is Policy.RELAXKV:
            return "topk"
        if self is Policy.RELAXKV_RANDCTX:
            return "random"
        return "full"


SERVER_POLICIES: tuple[str, ...] = tuple(p.value for p in Policy if p.served)
CHUNK_POLICIES: frozenset[str] = frozenset(p.value for p in Policy if p.served and p.reuses_chunks)
REPAIR_POLICIES: tuple[str, ...] = tuple(p.value for p in Policy if p.served and p.repairs)
# What a request without a policy gets: SGLang's own behaviour, so installing the plugin
# changes nothing until a request (or RELAXKV_DEFAULT_POLICY) asks for chunk reuse.
DEFAULT_POLICY = Policy.PREFIX.value
