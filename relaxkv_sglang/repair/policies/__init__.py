"""The policy registry: every way a request can be prefilled, one module each (its :class:`~.base.PolicySpec`), one
line in :data:`REGISTERED`; the server, the benchmarks and the tests read it (``tests/unit/test_selection.py``
checks this table against it):

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
        return POLICY_SPECS[self.value]

    @property
    def served(self) -> bool:
        return self.spec.served

    @property
    def reuses_chunks(self) -> bool:
        return self.spec.reuses_chunks

    @property
    def repairs(self) -> bool:
        return self.spec.repairs

    @property
    def needs_query_scores(self) -> bool:
        return self.spec.needs_query_scores

    @property
    def context_mode(self) -> str:
        return self.spec.context


#: One member per registered policy (``Policy.RELAXKV == "relaxkv"``), made from the registry.
Policy = _PolicyName("Policy", [(name.upper(), name) for name in POLICY_SPECS], module=__name__)


def policy_spec(policy: "Policy | str | PolicySpec") -> PolicySpec:
    """The spec of ``policy`` (a Policy, its value, or a spec itself; ValueError for an unknown name)."""
    if isinstance(policy, PolicySpec):
        return policy
    return POLICY_SPECS[Policy(policy).value]


def served_policies() -> tuple[str, ...]:
    return tuple(name for name, s in POLICY_SPECS.items() if s.served)


def chunk_policies() -> tuple[str, ...]:
    """Served policies that reuse chunks (``pic`` and the repair policies), in registry order."""
    return tuple(name for name, s in POLICY_SPECS.items() if s.served and s.reuses_chunks)


def repair_policies(ablations: bool = True) -> tuple[str, ...]:
    """Served policies that repair, in registry order; without ``ablations``, what a benchmark compares."""
    return tuple(name for name, s in POLICY_SPECS.items()
                 if s.served and s.repairs and (ablations or s.role != "ablation"))


SERVER_POLICIES: tuple[str, ...] = served_policies()
CHUNK_POLICIES: frozenset[str] = frozenset(chunk_policies())
REPAIR_POLICIES: tuple[str, ...] = repair_policies()
# SGLang's own behaviour: the plugin changes nothing until a request (or RELAXKV_DEFAULT_POLICY) asks for reuse.
DEFAULT_POLICY = Policy.PREFIX.value
