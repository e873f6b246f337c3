"""Unit tests for relaxkv_sglang.server.gate: the error measure, the tolerances, the verdict, and the
identity the gate checks (K at p == K at 0 re-rotated by p) on a small random Llama, where a
wrong rotation must fail by orders of magnitude."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from relaxkv_sglang.server.gate import (
    CheckResult,
    GateResult,
    compare_layers,
    gate_offset,
    gate_token_ids,
    judge,
    relative_error,
    tolerance_for,
)
from relaxkv_sglang.repair.reference import _causal_prefill, from_hf_state_dict
from relaxkv_sglang.model.rope import RopeSpec, rotate_keys
from relaxkv_sglang.model.rope_config import rope_spec_from_hf_config

transformers = pytest.importorskip("transformers")


def test_tolerances_per_dtype():
    assert tolerance_for(torch.float32) == 2e-3
    assert tolerance_for(torch.float16) == 64 * 2.0 ** -11 == 0.03125
    assert tolerance_for(torch.bfloat16) == 64 * 2.0 ** -8 == 0.25
    assert tolerance_for(torch.float8_e4m3fn) == 0.5


def test_relative_error_is_worst_vector_over_rms_norm():
    expected = torch.ones(2, 1, 4)  # every vector has norm 2, rms norm 2
    actual = expected.clone()
    actual[1, 0, 3] += 1.0  # one vector off by norm 1
    assert relative_error(actual, expected) == 0.5
    assert relative_error(expected, expected) == 0.0
    # [n, d] reads as one head
    assert relative_error(actual[:, 0], expected[:, 0]) == 0.5
    # rms, not mean or max: norms 3 and 4 -> rms = sqrt((9 + 16) / 2)
    y = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    x = y + torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    assert relative_error(x, y) == pytest.approx(1 / math.sqrt(12.5))


def test_relative_error_edge_cases():
    zero = torch.zeros(3, 2, 4)
    assert relative_error(zero, zero) == 0.0
    assert relative_error(torch.ones(3, 2, 4), zero) == math.inf
    bad = torch.ones(3, 2, 4)
    bad[0, 0, 0] = float("nan")
    assert math.isnan(relative_error(bad, torch.ones(3, 2, 4)))
    with pytest.raises(ValueError, match="shapes differ"):
        relative_error(torch.ones(2, 1, 4), torch.ones(3, 1, 4))


def test_compare_layers_names_the_worst_and_fails_on_nan():
    y = torch.ones(2, 1, 4)
    small, large = y + 0.001, y + 0.5
    res = compare_layers("rope_k", [("layer 0 K", small), ("layer 1 K", large)], [y, y], tolerance=0.01)
    assert (res.worst, res.passed) == ("layer 1 K", False)
    assert res.max_error == pytest.approx(0.5)
    res = compare_layers("rope_k", [("layer 0 K", small)], [y], tolerance=0.01)
    assert res.passed and res.max_error == pytest.approx(0.001, rel=1e-4)
    nan = y.clone()
    nan[0, 0, 0] = float("nan")
    res = compare_layers("pic_kv", [("layer 0 V", nan), ("layer 1 V", small)], [y, y], tolerance=1.0)
    assert not res.passed and res.worst == "layer 0 V"
    with pytest.raises(ValueError):
        compare_layers("pic_kv", [], [], 1.0)


def test_judge_and_its_record():
    ok = [CheckResult("rope_k", 1e-5, 2e-3, "layer 0 K"), CheckResult("pic_kv", 2e-5, 2e-3, "layer 1 V"),
          CheckResult("pic_logits", 3e-5, 2e-3, "query")]
    passed = judge(ok, offset=4048, n_tokens=48, dtype="float32")
    assert (passed.status, passed.reason, passed.refuses_chunks) == ("passed", "", False)
    record = passed.to_dict()
    assert record["checks"]["pic_kv"] == {"max_error": 2e-5, "tolerance": 2e-3, "worst": "layer 1 V", "passed": True}
    assert (record["offset"], record["n_tokens"], record["dtype"]) == (4048, 48, "float32")

    bad = [dataclasses.replace(ok[0], max_error=1.5, worst="layer 1 K"), ok[1], ok[2]]
    failed = judge(bad, offset=4048, n_tokens=48, dtype="float32")
    assert failed.refuses_chunks and failed.status == "failed"
    assert failed.reason.startswith("keys re-rotated by the plugin's RoPE")
    assert "rope_k FAILED: error 1.5 at layer 1 K (tolerance 0.002)" in failed.reason
    assert "pic_kv" not in failed.reason
    only_logits = judge([ok[0], ok[1], dataclasses.replace(ok[2], max_error=0.1)], offset=1, n_tokens=8,
                        dtype="float32")
    assert only_logits.reason == "pic_logits FAILED: error 0.1 at query (tolerance 0.002)"
    broken = GateResult.failure("the gate could not run: RuntimeError: boom")
    assert broken.refuses_chunks and broken.to_dict()["checks"] == {}


def test_the_negative_control_must_fail_or_the_gate_refuses():
    """The control (rope_k under a wrong rotation) must be out of tolerance: a gate that cannot
    tell a wrong rotation does not vouch for the right one."""
    ok = [CheckResult(name, 1e-5, 2e-3, "layer 0 K") for name in ("rope_k", "pic_kv", "pic_logits")]
    told = judge(ok, offset=4048, n_tokens=48, dtype="float32",
                 control=CheckResult("rope_control", 1.4, 2e-3, "layer 1 K"))
    assert told.status == "passed" and told.to_dict()["control"] == {
        "max_error": 1.4, "tolerance": 2e-3, "worst": "layer 1 K", "detected": True}
    blind = judge(ok, offset=4048, n_tokens=48, dtype="float32",
                  control=CheckResult("rope_control", 1e-4, 2e-3, "layer 1 K"))
    assert blind.refuses_chunks and blind.reason == (
        "the gate cannot tell a wrong rotation on this model: keys re-rotated with twice the RoPE theta give "
        "rope_control error 0.0001, within the tolerance 0.002")
    assert judge(ok, offset=1, n_tokens=8, dtype="float32").to_dict()["control"] is None


def test_offset_and_token_ids():
    assert gate_offset(8192, 48) == 4096
    assert gate_offset(4096, 48) == 4048
    with pytest.raises(ValueError, match="no room"):
        gate_offset(40, 48)
    assert gate_token_ids([1, 5, 7, 9, 11, 13, 15, 17, 10**9], vocab_size=100) == [1, 5, 7, 9, 11, 13, 15, 17]
    fallback = gate_token_ids(None, vocab_size=100, n_tokens=32)
    assert len(fallback) == 32 and all(0 <= t < 100 for t in fallback)
    assert fallback == gate_token_ids([1, 2], vocab_size=100, n_tokens=32)  # too short: the fixed sequence


# ------------------------------------------------------------ the identity on a model


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.1,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    return from_hf_state_dict(hf.state_dict(), cfg.to_dict()), rope_spec_from_hf_config(cfg.to_dict())


def _rope_k_check(weights, spec: RopeSpec, served: RopeSpec, n: int = 32) -> CheckResult:
    """The gate's check (a) on the torch reference: K/V of the text at p vs at 0 re-rotated by ``served``."""
    ids = torch.tensor(gate_token_ids(None, 256, n))
    p = gate_offset(8192, n)
    kv0, _ = _causal_prefill(weights, ids, torch.arange(n))
    kvp, _ = _causal_prefill(weights, ids, torch.arange(p, p + n))
    got, want = [], []
    for layer, ((k0, v0), (kp, vp)) in enumerate(zip(kv0, kvp)):
        got += [(f"layer {layer} K", rotate_keys(k0, p, served)), (f"layer {layer} V", v0)]
        want += [kp, vp]
    return compare_layers("rope_k", got, want, tolerance_for(torch.float32))


def test_identity_holds_with_the_models_rope(llama):
    weights, spec = llama
    res = _rope_k_check(weights, spec, spec)
    assert res.passed, res.describe()
    assert res.max_error < 2e-4  # measured 4.7e-5: fp32 angle rounding at p = 4096


@pytest.mark.parametrize("wrong", [
    {"base": 20000.0},  # theta misread
    {"scaling_type": "linear", "factor": 2.0},  # a scaling the model does not use
    {"is_neox_style": False},  # the other pairing
])
def test_a_wrong_rotation_fails_by_orders_of_magnitude(llama, wrong):
    weights, spec = llama
    res = _rope_k_check(weights, spec, dataclasses.replace(spec, **wrong))
    assert not res.passed
    assert res.max_error > 0.5, res.describe()  # measured 2.0-2.2: 1000x the fp32 tolerance
    assert res.worst.endswith("K")  # V does not depend on the rotation
