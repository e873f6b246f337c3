"""Stale shift (repair/stale_shift.py): the sets, the exact recovery of a shared offset, the invariants."""

import dataclasses

import pytest
import torch

from relaxkv_sglang.repair.policies import policy_spec, repair_policies
from relaxkv_sglang.repair.reference import apply_neox_rope, build_stale_kv, reference_prefill
from relaxkv_sglang.repair.repair_config import RepairConfig
from relaxkv_sglang.repair.anchor_schedule import schedule_anchors
from relaxkv_sglang.repair.stale_shift import shift_sets, stale_shift

from test_reference import GLUE_SPANS, PS, Q0, SPANS, close, full, ids, model, run  # noqa: F401 (fixtures)

INV = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))


def rotate(k, delta):
    return apply_neox_rope(k, delta, INV)


def test_shift_sets_leave_out_chunk_sinks_prefix_and_anchors():
    spans = [(0, 10), (12, 22), (22, 30)]  # the first chunk starts at 0: exact, never shifted
    anchors = torch.tensor([12, 13, 17, 23, 28])
    src, tgt = shift_sets(anchors, spans, 30, chunk_sink_tokens=2)
    assert src.tolist() == [17, 28]  # 12, 13 and 23 are chunk sinks (offsets 0, 1, 1)
    assert tgt.tolist() == [14, 15, 16, 18, 19, 20, 21, 24, 25, 26, 27, 29]


def test_a_shared_offset_is_recovered_exactly_k_before_rope():
    g = torch.Generator().manual_seed(0)
    n, hkv, d = 40, 2, 16
    pos = torch.arange(100, 100 + n)
    k_true, v_true = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    ck, cv = torch.randn(hkv, d, generator=g), torch.randn(hkv, d, generator=g)
    # Stale = true minus one offset shared by every token, K's offset before RoPE.
    k_stale_post, k_true_post = rotate(k_true - ck, pos), rotate(k_true, pos)
    v_stale = v_true - cv
    src, tgt = torch.arange(0, n, 4), torch.tensor([i for i in range(n) if i % 4])
    dk, dv = stale_shift("kv", pos[src], k_true_post[src], v_true[src], k_stale_post[src], v_stale[src], pos[tgt], rotate)
    torch.testing.assert_close(k_stale_post[tgt] + dk, k_true_post[tgt], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v_stale[tgt] + dv, v_true[tgt], atol=1e-5, rtol=1e-5)
    # A scale takes that fraction of the shift.
    dk_h, dv_h = stale_shift("kv", pos[src], k_true_post[src], v_true[src], k_stale_post[src], v_stale[src], pos[tgt],
                             rotate, scale=0.5)
    torch.testing.assert_close(dk_h, dk / 2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dv_h, dv / 2, atol=1e-6, rtol=1e-6)
    # A post-RoPE mean would not recover K (the offset rotates with the position).
    naive = (k_true_post[src] - k_stale_post[src]).mean(0)
    assert float((k_stale_post[tgt] + naive - k_true_post[tgt]).abs().max()) > 0.1
    # "v" leaves K alone, "none" shifts nothing, no source shifts nothing.
    dk_v, dv_v = stale_shift("v", pos[src], k_true_post[src], v_true[src], k_stale_post[src], v_stale[src], pos[tgt], rotate)
    assert float(dk_v.abs().max()) == 0 and torch.equal(dv_v, dv)
    for mode, s in (("none", src), ("kv", src[:0])):
        z = stale_shift(mode, pos[s], k_true_post[s], v_true[s], k_stale_post[s], v_stale[s], pos[tgt], rotate)
        assert float(z[0].abs().max()) == 0 and float(z[1].abs().max()) == 0
    with pytest.raises(ValueError, match="stale_shift"):
        stale_shift("k", pos[src], k_true_post[src], v_true[src], k_stale_post[src], v_stale[src], pos[tgt], rotate)


def test_config_refuses_an_unknown_shift():
    with pytest.raises(ValueError, match="stale_shift"):
        RepairConfig.from_knobs(stale_shift="kv2")
    with pytest.raises(ValueError, match="stale_shift_scale"):
        RepairConfig.from_knobs(stale_shift_scale=1.5)


@pytest.mark.parametrize("mode", ["v", "kv"])
def test_shift_keeps_the_invariants(model, ids, full, mode):  # noqa: F811
    res = run(model, ids, "relaxkv", 1.0, 1.0, stale_shift=mode)
    assert close(res.last_logits, full.last_logits)
    zero = run(model, ids, "relaxkv", 0.0, 0.5, stale_shift=mode)
    assert close(zero.last_logits, run(model, ids, "pic").last_logits, 1e-5)


def test_shift_moves_exactly_the_non_anchors_by_the_anchors_mean(model, ids):  # noqa: F811
    w = model[1]
    config = RepairConfig.from_knobs(anchor_ratio=0.3, context_ratio=0.5, page_size=PS, stale_shift="kv", chunk_sink_tokens=2,
                          stale_shift_scale=1.0)
    res = reference_prefill(w, ids, GLUE_SPANS, Q0, "relaxkv", config)
    unshifted = RepairConfig.from_knobs(anchor_ratio=0.3, context_ratio=0.5, page_size=PS, chunk_sink_tokens=2,
                                        stale_shift="none")
    plain = reference_prefill(w, ids, GLUE_SPANS, Q0, "relaxkv", unshifted)
    stale = build_stale_kv(w, ids, GLUE_SPANS, Q0)
    assert not close(res.last_logits, plain.last_logits, 1e-4)  # the shift does something
    plan = schedule_anchors("relaxkv", res.scores, GLUE_SPANS, Q0, w.n_layers, config)
    l = 2
    src, tgt = plan.layer_step.shift_sets(l)
    assert src.numel() and tgt.numel()
    for layer in range(w.n_layers):  # the plan's split by exit layers is the definition's, by anchor set
        want = shift_sets(plan.anchor_sets[layer], GLUE_SPANS, plan.n_context, chunk_sink_tokens=2)
        assert all(torch.equal(a, b) for a, b in zip(plan.layer_step.shift_sets(layer), want)), layer
    anchors = plan.anchor_sets[l]
    # The prefix and the chunk sinks that are not anchors keep their stale K/V.
    sinks = torch.tensor([s + i for s, _ in GLUE_SPANS for i in range(2)])
    kept = torch.cat([torch.arange(GLUE_SPANS[0][0]), sinks[~torch.isin(sinks, anchors)]])
    assert torch.equal(res.kv[l][1][kept], stale[l][1][kept]) and torch.equal(res.kv[l][0][kept], stale[l][0][kept])
    # Every shifted token moved by the same V offset: the anchors' mean deviation.
    dv = res.kv[l][1][tgt] - stale[l][1][tgt]
    expected = (res.kv[l][1][src] - stale[l][1][src]).mean(0)
    torch.testing.assert_close(dv, expected.expand_as(dv), atol=1e-5, rtol=1e-5)
    # K: the same offset before RoPE.
    inv = w.rope_inv_freq()
    dk_pre = apply_neox_rope(res.kv[l][0][tgt] - stale[l][0][tgt], -tgt, inv)
    exp_k = apply_neox_rope(res.kv[l][0][src] - stale[l][0][src], -src, inv).mean(0)
    torch.testing.assert_close(dk_pre, exp_k.expand_as(dk_pre), atol=1e-4, rtol=1e-4)


def test_the_default_shifts_kv_by_half():
    assert (RepairConfig().relaxkv.stale_shift, RepairConfig().relaxkv.stale_shift_scale) == ("kv", 0.5)


@pytest.mark.parametrize("policy", [p for p in repair_policies() if policy_spec(p).layer_step is None])
def test_peers_never_shift(model, ids, policy):  # noqa: F811
    a = run(model, ids, policy, 0.3, stale_shift="kv")
    b = run(model, ids, policy, 0.3, stale_shift="none")
    assert torch.equal(a.last_logits, b.last_logits)


# --- the server's executor (repair/sglang/layer_loop.py) on the CPU, over the reference's model pieces ---


class _RefLayers:
    """ModelLayers' surface over the reference's weights (what LayerLoop calls)."""

    def __init__(self, w):
        from types import SimpleNamespace

        from relaxkv_sglang.repair import reference as R

        self.w, self.R = w, R
        self.model = SimpleNamespace(embed_tokens=lambda i: w.embed[i].float(),
                                     norm=lambda h: R._rms_norm(h, w.norm, w.rms_eps))
        self.n_layers = w.n_layers

    def qkv(self, l, positions, hidden):
        return self.R._project_qkv(self.w, self.w.layers[l], hidden, positions)

    def finish(self, l, hidden, attn_out):
        return self.R._finish_layer(self.w, self.w.layers[l], hidden, attn_out)

    def attention_params(self, l):
        return l, self.w.head_dim ** -0.5


def run_layer_loop(model, ids, plan, stale, slots, n_slots):
    """The server's LayerLoop over one request on the CPU: a pool of ``n_slots`` holding the stale
    context at ``slots`` (as reused). Returns (its LoopRows, the final hidden, (K, V) per layer, the pool)."""
    from types import SimpleNamespace

    from relaxkv_sglang.model.rope_config import rope_spec_from_hf_config
    from relaxkv_sglang.attention.sglang.anchor_attention import AnchorAttention
    from relaxkv_sglang.repair.sglang.layer_loop import LayerLoop
    from relaxkv_sglang.forward.repair_stage import repair_rows

    hf, w = model
    k_pool = [torch.zeros(n_slots, w.n_kv_heads, w.head_dim) for _ in range(w.n_layers)]
    v_pool = [torch.zeros(n_slots, w.n_kv_heads, w.head_dim) for _ in range(w.n_layers)]
    for l in range(w.n_layers):
        k_pool[l][slots[:plan.n_context]], v_pool[l][slots[:plan.n_context]] = stale.kv[l]
    pool = SimpleNamespace(get_key_buffer=lambda l: k_pool[l], get_value_buffer=lambda l: v_pool[l])
    rows = repair_rows(ids.numel(), plan, slots)
    rope = rope_spec_from_hf_config(hf.config.to_dict())
    out = LayerLoop(_RefLayers(w), pool, AnchorAttention(), rope=rope).run([rows], ids[rows.positions])
    return rows, out, (k_pool, v_pool), pool


@pytest.mark.parametrize("mode,slot_layout", [("none", "scattered"), ("kv", "scattered"), ("kv", "two ranges"),
                                              ("kv", "index add"), ("kv", "one range"),
                                              ("kv", "one range, sinks capped"), ("kv", "one range, per chunk"),
                                              ("kv", "index add, per chunk")])
def test_layer_loop_shifts_as_the_reference_does(model, ids, mode, slot_layout, monkeypatch):  # noqa: F811
    """The pool's slots scattered (a fragmented body: the index-add path), in two ranges (the
    shift added over the body's runs), the index-add path forced, or in one range: the shift
    added over the body's whole span, sinks and glue included, as they are rows of every layer
    (sinks capped: some are not, and the runs are used); per chunk: each chunk's own shift, over
    its runs or by the index add."""
    from relaxkv_sglang.repair.reference import stale_context
    from relaxkv_sglang.attention.sglang.anchor_attention import AnchorAttention
    from relaxkv_sglang.repair.sglang.layer_loop import LayerLoop
    from relaxkv_sglang.forward.repair_stage import repair_rows
    from relaxkv_sglang.repair.sglang.shift_target import ShiftTarget

    _, w = model
    n = ids.numel()
    config = RepairConfig.from_knobs(anchor_ratio=0.3, context_ratio=0.5, page_size=PS, stale_shift=mode, chunk_sink_tokens=2,
                          stale_shift_scale=0.5, chunk_sink_share=0.1 if "capped" in slot_layout else 1.0,
                          stale_shift_group="chunk" if "per chunk" in slot_layout else "request")
    ref = reference_prefill(w, ids, GLUE_SPANS, Q0, "relaxkv", config)
    stale = stale_context(w, ids, GLUE_SPANS, Q0)
    plan = schedule_anchors("relaxkv", stale.scores, GLUE_SPANS, Q0, w.n_layers, config)
    # A pool with the request's slots scattered in it, holding the stale context (as reused).
    slots = torch.randperm(n + 7, generator=torch.Generator().manual_seed(3))[:n]
    if slot_layout == "two ranges":
        slots = torch.cat([torch.arange(n // 2), torch.arange(n // 2 + 7, n + 7)])
    if slot_layout.startswith("one range"):
        slots = torch.arange(n) + 5
    if slot_layout.startswith("index add"):
        monkeypatch.setattr(ShiftTarget, "MAX_RUNS", 0)
    rows, out, (k_pool, v_pool), pool = run_layer_loop(model, ids, plan, stale, slots, n + 7)
    if mode == "kv":
        runs = rows.shift_target.runs
        if slot_layout == "two ranges":  # slices: the ranges' split and the chunk sinks' gaps
            assert runs is not None and len(runs) <= 4
        if slot_layout.startswith("index add"):
            assert runs is None
        if slot_layout == "one range, per chunk":  # a run per chunk body, each with its chunk's delta
            assert rows.shift_target.grouped and runs is not None
            assert sorted({g for *_, g in runs}) == list(range(len(GLUE_SPANS)))
        span_until = rows.shift_target.span_until
        if slot_layout == "one range":  # every sink an anchor to the last layer, the glue rows throughout
            assert span_until >= w.n_layers
        else:  # capped: a sink outside the budget is no row, so the runs
            assert span_until == 0
    logits = torch.nn.functional.linear(out[-1], w.lm_head)
    torch.testing.assert_close(logits, ref.last_logits, atol=1e-4, rtol=1e-4)
    for l in range(w.n_layers):
        torch.testing.assert_close(k_pool[l][slots], ref.kv[l][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v_pool[l][slots], ref.kv[l][1], atol=1e-4, rtol=1e-4)
    if "per chunk" in slot_layout:  # and differs from the request's one shift
        request_wide = config.with_options(relaxkv=dataclasses.replace(config.relaxkv, stale_shift_group="request"))
        one = reference_prefill(w, ids, GLUE_SPANS, Q0, "relaxkv", request_wide)
        assert not torch.allclose(one.kv[2][1], ref.kv[2][1], atol=1e-4)
    if mode == "kv":  # and the shift is not vacuous here
        targets = plan.layer_step.shift_sets(2)[1]
        assert targets.numel() and not torch.allclose(ref.kv[2][1][targets], stale.kv[2][1][targets], atol=1e-3)
        with pytest.raises(RuntimeError, match="RoPE"):
            LayerLoop(_RefLayers(w), pool, AnchorAttention()).run([repair_rows(n, plan, slots)],
                                                                  ids[rows.positions])


def test_shift_span_covers_left_out_rows_only_while_they_are_written():
    """The body's span takes the shift in one slice while every position it leaves out is a row
    of the layer (its write replaces the shift); from the layer one of them leaves, the runs."""
    from relaxkv_sglang.model.rope import RopeSpec, RotationTable, rotate_keys
    from relaxkv_sglang.repair.sglang.shift_target import ShiftTarget

    spec = RopeSpec(head_dim=16)
    body = torch.tensor([4, 5, 6, 9, 10, 11, 12])  # 7, 8 left out: a sink and glue
    rows = torch.tensor([0, 1, 7, 8, 11, 20])  # rows of the pass (11: an anchor in the body)
    exits = torch.tensor([3, 3, 2, 3, 1, 3])  # position 7 leaves after layer 1
    slots = torch.arange(30) + 100
    target = ShiftTarget(slots, body, spec, rows, exits)
    assert target.span_until == 2 and len(target.runs) == 2
    dk, dv = torch.randn(2, 16), torch.randn(2, 16)
    want_k = RotationTable(body, spec).rotate(dk[None])
    for layer in (0, 2):
        k, v = torch.randn(200, 2, 16), torch.randn(200, 2, 16)
        k0, v0 = k.clone(), v.clone()
        target.add(layer, k, v, dk[None], dv[None])
        torch.testing.assert_close(k[slots[body]] - k0[slots[body]], want_k)
        torch.testing.assert_close(v[slots[body]] - v0[slots[body]], dv.expand(7, -1, -1))
        others = torch.ones(200, dtype=torch.bool)
        others[slots[body]] = False
        if layer < 2:  # only the left-out rows besides the body, and they are written next
            others[slots[torch.tensor([7, 8])]] = False
        assert torch.equal(k[others], k0[others]) and torch.equal(v[others], v0[others])
        assert layer < 2 or not torch.equal(k, k0) and torch.equal(k[slots[7]], k0[slots[7]])
    # A position left out that is no row of the pass: never the span.
    assert ShiftTarget(slots, body, spec, torch.tensor([0, 7, 20]), torch.tensor([3, 3, 3])).span_until == 0
    # Deltas through the table: R(-p) equals the rotation by -p.
    x = torch.randn(3, 2, 16)
    p = torch.tensor([4, 9, 12])
    torch.testing.assert_close(target.rotate_by(x, -p), rotate_keys(x, -p, spec))


def test_group_means_shrink_each_chunk_toward_the_request_mean():
    from relaxkv_sglang.repair.stale_shift import group_means

    rows = torch.tensor([[1.0], [3.0], [10.0], [0.0]])
    groups = torch.tensor([0, 0, 1, 1])
    mean = rows.mean()  # 3.5
    # prior 0: each group's own mean; a group without rows (2) takes the request's
    torch.testing.assert_close(group_means(rows, groups, 3, 0.0), torch.tensor([[2.0], [5.0], [3.5]]))
    # prior 2: (sum + 2 * mean) / (n + 2)
    torch.testing.assert_close(group_means(rows, groups, 3, 2.0),
                               torch.stack([(4 + 2 * mean) / 4, (10 + 2 * mean) / 4, mean])[:, None])
    # one group: the request's mean, whatever the prior
    torch.testing.assert_close(group_means(rows, None, 1, 5.0), torch.tensor([[3.5]]))


def test_per_chunk_shift_recovers_a_chunk_offset_exactly():
    """Each chunk's stale K/V off by its own offset: the chunk means (prior 0) recover every
    chunk's; the request's mean recovers none."""
    g = torch.Generator().manual_seed(1)
    n, hkv, d = 40, 2, 16
    pos = torch.arange(n)
    chunk = (pos >= 20).long()
    k_true, v_true = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    ck, cv = torch.randn(2, hkv, d, generator=g), torch.randn(2, hkv, d, generator=g)
    k_stale_post, k_true_post = rotate(k_true - ck[chunk], pos), rotate(k_true, pos)
    v_stale = v_true - cv[chunk]
    src, tgt = pos[pos % 4 == 0], pos[pos % 4 != 0]
    args = (pos[src], k_true_post[src], v_true[src], k_stale_post[src], v_stale[src], pos[tgt], rotate)
    dk, dv = stale_shift("kv", *args, groups=chunk[src], target_groups=chunk[tgt], n_groups=2, prior=0.0)
    torch.testing.assert_close(k_stale_post[tgt] + dk, k_true_post[tgt], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v_stale[tgt] + dv, v_true[tgt], atol=1e-5, rtol=1e-5)
    dk1, dv1 = stale_shift("kv", *args)
    assert float((v_stale[tgt] + dv1 - v_true[tgt]).abs().max()) > 0.1
