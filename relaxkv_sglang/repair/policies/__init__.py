"""The policy registry: every way a request can be prefilled, one module each, one line here.

A policy is a module of this package holding its :class:`~.base.PolicySpec` (what it reuses,
whether it repairs, what it needs, its anchor rule, its anchors' context, its options and its
optional step inside the forward: :class:`~.base.LayerStep`). :data:`REGISTERED` lists them; the
server, the benchmarks and the tests read the registry, so adding a policy is its module plus
its line in :data:`REGISTERED` (``tests/unit/test_selection.py`` adds one with a mid-forward step).

Checked against the registry by ``tests/unit/test_selection.py``:

===============  ======  =============  =======  ============  ============  ========  ========
policy           served  reuses chunks  repairs  query scores  forward step  context   role
===============  ======  =============  =======  ============  ============  ========  ========
full             yes     no             no       no            no            (causal)  baseline
prefix           yes     no             no       no            no            (causal)  baseline
pic              yes     yes            no       no            no            (none)    baseline
epic             yes     yes            yes      no            no            full      peer
cacheblend       yes     yes            yes      no            decides       full      peer
prophetkv        yes     yes            yes      yes           no            full      peer
relaxkv          yes     yes            yes      yes           step          topk      method
relaxkv_fullctx  yes     yes            yes      yes           step          full      ablation
relaxkv_randctx  yes     yes            yes      yes           step          random    ablation
random           no      yes            yes      no            no            full      control
===============  ======  =============  =======  ============  ============  ========  ========

``prefix`` is SGLang's radix cache; ``random`` runs in the torch reference only. Knobs every
repair shares are in ``repair_config.RepairConfig``; a policy's own in its options object.
"""

from __future__ import annotations

import enum
import types
from typing import Iterable, Mapping

from relaxkv_sglang.repair.policies import cacheblend, epic, full, pic, prefix, prophetkv, random_control, relaxkv
from relaxkv_sglang.repair.policies.base import OptionGroup, PolicySpec
from relaxkv_sglang.repair.policies.cacheblend import CacheBlendOptions
from relaxkv_sglang.repair.policies.relaxkv import RelaxKVOptions

__all__ = ["Policy", "PolicySpec", "OptionGroup", "REGISTERED", "registry", "POLICY_SPECS", "OPTION_GROUPS",
           "policy_spec", "served_policies", "chunk_policies", "repair_policies", "RelaxKVOptions",
           "CacheBlendOptions", "SERVER_POLICIES", "CHUNK_POLICIES", "REPAIR_POLICIES", "DEFAULT_POLICY"]

REGISTERED: tuple[PolicySpec, ...] = (
    full.SPEC,
    prefix.SPEC,
    pic.SPEC,
    epic.SPEC,
    cacheblend.SPEC,
    prophetkv.SPEC,
    *relaxkv.SPECS,
    random_control.SPEC,
)


def registry(specs: Iterable[PolicySpec]) -> Mapping[str, PolicySpec]:
    """Name -> spec, in order; ValueError for a name given twice."""
    by_name: dict[str, PolicySpec] = {}
    for spec in specs:
        if spec.name in by_name:
            raise ValueError(f"policy {spec.name!r} is registered twice")
        by_name[spec.name] = spec
    return types.MappingProxyType(by_name)


POLICY_SPECS: Mapping[str, PolicySpec] = registry(REGISTERED)
#: Every policy's options, once each, in registry order (``RepairConfig`` holds one of each).
OPTION_GROUPS: tuple[OptionGroup, ...] = tuple(dict.fromkeys(s.options for s in REGISTERED if s.options))


class _PolicyName(str, enum.Enum):
    """A policy's name: the string clients send (``relaxkv_policy``); its spec says what it does."""

    @property
    def spec(self) -> PolicySpec:
        """Its entry in :data:`POLICY_SPECS`."""
        return POLICY_SPECS[self.value]

    @property
    def served(self) -> bool:
        """Whether the server accepts it as a request's policy."""
        return self.spec.served

    @property
    def reuses_chunks(self) -> bool:
        """Chunk KV comes from the position-independent chunk tree."""
        return self.spec.reuses_chunks

    @property
    def repairs(self) -> bool:
        """Reused chunk tokens are selectively recomputed (anchors)."""
        return self.spec.repairs

    @property
    def needs_query_scores(self) -> bool:
        """True when targets (or context) are chosen from the stale query pass s_l."""
        return self.spec.needs_query_scores

    @property
    def context_mode(self) -> str:
        """Context of the anchors: 'full' (causal prefix), 'topk' (relaxed) or 'random'."""
        return self.spec.context


#: One member per registered policy (``Policy.RELAXKV == "relaxkv"``), made from the registry.
Policy = _PolicyName("Policy", [(name.upper(), name) for name in POLICY_SPECS], module=__name__)


def policy_spec(policy: "Policy | str | PolicySpec") -> PolicySpec:
    """The spec of ``policy`` (a Policy, its value, or a spec itself; ValueError for an unknown name)."""
    if isinstance(policy, PolicySpec):
        return policy
    return POLICY_SPECS[Policy(policy).value]


def served_policies() -> tuple[str, ...]:
    """The values the server accepts, in registry order."""
    return tuple(name for name, s in POLICY_SPECS.items() if s.served)


def chunk_policies() -> tuple[str, ...]:
    """Served policies that reuse chunks (``pic`` and the repair policies), in registry order."""
    return tuple(name for name, s in POLICY_SPECS.items() if s.served and s.reuses_chunks)


def repair_policies(ablations: bool = True) -> tuple[str, ...]:
    """Served policies that repair, in registry order; without ``ablations`` only the peers and
    the method (what a benchmark compares)."""
    return tuple(name for name, s in POLICY_SPECS.items()
                 if s.served and s.repairs and (ablations or s.role != "ablation"))


SERVER_POLICIES: tuple[str, ...] = served_policies()
CHUNK_POLICIES: frozenset[str] = frozenset(chunk_policies())
REPAIR_POLICIES: tuple[str, ...] = repair_policies()
# What a request without a policy gets: SGLang's own behaviour, so installing the plugin
# changes nothing until a request (or RELAXKV_DEFAULT_POLICY) asks for chunk reuse.
DEFAULT_POLICY = Policy.PREFIX.value
