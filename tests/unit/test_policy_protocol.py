"""A new policy with a step inside the forward is one module plus one registry line.

This module is that policy: ``halfway`` recomputes every eligible token at layers 0 and 1; its
step reads them at layer 1 and keeps the top-r by V deviation for the later layers, then at each
later layer reads those and shifts every chunk token's stale V by their mean deviation. Nothing else in the project names it: the planner,
the torch reference and the server's layer loop run it from its spec, and give the same K/V.
"""

import pytest
import torch

from relaxkv_sglang.repair.policies import REGISTERED, policy_spec, registry
from relaxkv_sglang.repair.policies.base import (AnchorInputs, LayerEdit, LayerRead, MeasuredKV, PolicySpec,
                                               ScheduleView, top_tokens)
from relaxkv_sglang.repair.reference import reference_prefill, stale_context
from relaxkv_sglang.repair.repair_config import RepairConfig
from relaxkv_sglang.repair.anchor_schedule import schedule_anchors

from test_reference import GLUE_SPANS, PS, Q0, ids, model  # noqa: F401 (fixtures)
from test_stale_shift import run_layer_loop

DECIDE_AT = 1


def first_layers(x: AnchorInputs) -> list[torch.Tensor]:
    """Every eligible token at layers 0..DECIDE_AT; the step decides the rest."""
    return [x.eligible.clone() for _ in range(min(DECIDE_AT + 1, x.n_layers))]


class HalfwayStep:
    def __init__(self, plan: ScheduleView):
        self.plan = plan
        self.body = plan.anchor_sets[0]  # every eligible token
        self.body_groups = None

    def reads(self, layer: int):
        deciding = self.plan.decided_layers < self.plan.n_layers
        return LayerRead(self.plan.anchor_sets[layer]) if (layer == DECIDE_AT) == deciding else None

    def run(self, layer: int, kv: MeasuredKV) -> LayerEdit:
        deviation = (kv.v_new.float() - kv.v_stale.float())
        if self.plan.decided_layers == self.plan.n_layers:
            return LayerEdit(body_dv=deviation.mean(dim=0, keepdim=True))
        score = torch.zeros(self.plan.n_context)
        score[kv.positions.cpu()] = deviation.flatten(1).norm(dim=1).cpu()
        x = self.plan.anchor_inputs()
        kept = torch.sort(top_tokens(score, x.eligible, x.per_layer)).values
        return LayerEdit(later_sets=[kept.clone() for _ in range(self.plan.n_layers - layer - 1)])


SPEC = PolicySpec("halfway", "all tokens to layer 1, then top-r by V deviation; V shifted by its mean", "control",
                  first_layers, layer_step=HalfwayStep, decides_mid_forward=True)


def test_registering_it_is_one_line():
    specs = registry((*REGISTERED, SPEC))
    assert list(specs)[-1] == "halfway" and specs["halfway"] is SPEC and policy_spec(SPEC) is SPEC
    with pytest.raises(ValueError, match="twice"):
        registry((*REGISTERED, REGISTERED[0]))
    with pytest.raises(ValueError, match="layer_step"):
        PolicySpec("bad", "decides with no step", "control", first_layers, decides_mid_forward=True)


def test_the_reference_runs_its_step(model, ids):  # noqa: F811
    _, w = model
    config = RepairConfig.from_knobs(anchor_ratio=0.2, context_ratio=1.0, page_size=PS)
    res = reference_prefill(w, ids, GLUE_SPANS, Q0, SPEC, config)
    stale = stale_context(w, ids, GLUE_SPANS, Q0)
    plan = schedule_anchors(SPEC, None, GLUE_SPANS, Q0, w.n_layers, config)
    every = plan.anchor_sets[0]
    assert [a.numel() for a in res.anchors[:DECIDE_AT + 1]] == [every.numel()] * (DECIDE_AT + 1)
    later = res.anchors[DECIDE_AT + 1]
    assert later.numel() == round(0.2 * every.numel()) and all(torch.equal(a, later) for a in res.anchors[2:])
    # The later layers keep the tokens whose V moved most at the decision layer...
    moved = (res.kv[DECIDE_AT][1][every] - stale.kv[DECIDE_AT][1][every]).flatten(1).norm(dim=1)
    assert set(later.tolist()) == set(every[torch.topk(moved, later.numel()).indices].tolist())
    # ... and from layer 2 every non-anchor carries its stale V plus the anchors' mean deviation.
    for l in range(DECIDE_AT + 1, w.n_layers):
        shift = (res.kv[l][1][later] - stale.kv[l][1][later]).mean(0)
        left = every[~torch.isin(every, later)]
        assert left.numel() and shift.abs().max() > 1e-3
        torch.testing.assert_close(res.kv[l][1][left] - stale.kv[l][1][left], shift.expand(left.numel(), -1, -1),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(res.kv[l][0][left], stale.kv[l][0][left])  # K untouched


@pytest.mark.parametrize("policy", [SPEC, "cacheblend"], ids=["halfway", "cacheblend"])
def test_the_server_layer_loop_runs_it_as_the_reference_does(model, ids, policy):  # noqa: F811
    """Every layer's pool K/V and the logits equal the reference's. (Both steps decide at their
    last planned layer: the anchors kept past it need that layer's hidden state, which the loop
    once dropped, so CacheBlend's later layers ran on the hidden state of the layer before.)"""
    _, w = model
    config = RepairConfig.from_knobs(anchor_ratio=0.2, context_ratio=1.0, page_size=PS)
    ref = reference_prefill(w, ids, GLUE_SPANS, Q0, policy, config)
    stale = stale_context(w, ids, GLUE_SPANS, Q0)
    plan = schedule_anchors(policy, None, GLUE_SPANS, Q0, w.n_layers, config)
    slots = torch.randperm(ids.numel() + 5, generator=torch.Generator().manual_seed(1))[:ids.numel()]
    rows, out, (k_pool, v_pool), _ = run_layer_loop(model, ids, plan, stale, slots, ids.numel() + 5)
    assert rows.anchor_schedule.decided_layers == w.n_layers  # the step replanned the pass
    assert all(torch.equal(a, b) for a, b in zip(rows.anchor_schedule.anchor_sets, ref.anchors))
    logits = torch.nn.functional.linear(out[-1], w.lm_head)
    torch.testing.assert_close(logits, ref.last_logits, atol=1e-4, rtol=1e-4)
    for l in range(w.n_layers):
        torch.testing.assert_close(k_pool[l][slots], ref.kv[l][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v_pool[l][slots], ref.kv[l][1], atol=1e-4, rtol=1e-4)
