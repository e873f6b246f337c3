"""Every registered model family served by the real SGLang, end to end: one tiny random-weight
model per family (``relaxkv_sglang/tiny_models.py``: Qwen3, Mistral, Llama 3.x with llama3 RoPE,
Phi-3 with fused projections and partial rotary, Qwen3-MoE and Mixtral with routed experts), one
server each, prestarted beside the session's others (:data:`LONG_FAMILIES` in ``make test-long``
only). A few requests per family:

* the startup gate passed on the family's layers, and its negative control (keys re-rotated with
  twice the RoPE theta) told the wrong rotation by orders of magnitude: the gate would refuse it
  (the refusal itself, HTTP 400 for every chunk policy, is test_startup_gate.py's); the startup
  log's one line names the family, chunk reuse and repair;
* anchor ratio 1 with full context equals ``full`` (tokens, logprobs within 1e-4) and 0 anchors
  equal ``pic`` (1e-5), on chunks cached by an earlier request in another order;
* the served ``full`` and ``relaxkv`` logprobs equal the torch reference's over the checkpoint's
  weights (``repair/reference.py``): SGLang serves the family as its HF definition says, and the
  repair plans and computes as the reference does;
* a frontend program (``document()``) and a chat request (documents as text parts) are repaired.
"""

from __future__ import annotations

import pytest
import requests
import sglang as sgl
import torch
from conftest import start_server
from rag_helpers import SERVER_START_TIMEOUT_S, documents, flush, marked_prompt, part_token_ids, relaxkv_state

from relaxkv_sglang import assets
from relaxkv_sglang.lang import RelaxKVEndpoint, document
from relaxkv_sglang.server.launch import STRICT_MEMORY_CHECK, ServerConfig
from relaxkv_sglang.tiny_models import TINY_MODELS

pytestmark = pytest.mark.e2e


def family_server_config(model: str):
    """The plugin's server on the family's tiny model (whatever model path the prestart passes)."""
    def config(_tiny_llama_path: str) -> ServerConfig:
        return ServerConfig(model_path=str(assets.model_path(model)), max_total_tokens=4096, policy="prefix",
                            env=STRICT_MEMORY_CHECK, extra_args=["--context-length", "4096"],
                            startup_timeout_s=SERVER_START_TIMEOUT_S)

    return config


def _prestart_name(model: str) -> str:
    return model.replace("-", "_") + "_server"  # tiny-qwen3 -> tiny_qwen3_server


#: launched at the session's start (conftest), one per family; the marks on the fixture's params name them
PRESTART_SERVERS = {_prestart_name(m): start_server(family_server_config(m)) for m in TINY_MODELS}


#: families tested only in ``make test-long``: each server start costs ~25 s of the 2-core machine, and these
#: bring no attention or RoPE variant of their own (Qwen2 is Llama's attention with q/k/v biases, Mistral with
#: GQA; the routed-expert ones differ from Qwen3 and Mistral in the MLP only)
LONG_FAMILIES = ("tiny-qwen2", "tiny-mistral", "tiny-qwen3-moe", "tiny-mixtral")


def _family_marks(model: str) -> list:
    return [pytest.mark.prestart(_prestart_name(model)), *([pytest.mark.long] if model in LONG_FAMILIES else [])]


@pytest.fixture(scope="module", params=[pytest.param(m, id=m, marks=_family_marks(m)) for m in TINY_MODELS])
def family(request, prestart, tiny_model_path):
    """(tiny model name, its server): pytest runs one family's tests after another, so one of these
    servers is held at a time (the others are starting, or stopped)."""
    name = _prestart_name(request.param)
    with prestart.serving(name, lambda: PRESTART_SERVERS[name](tiny_model_path)) as srv:
        yield request.param, srv


def _run(url: str, prompt, policy: str, anchor: float | None = None, context: float | None = None,
         max_new_tokens: int = 6, top: int = 0):
    custom = {"relaxkv_chunks": prompt.offsets, "relaxkv_policy": policy}
    if anchor is not None:
        custom.update(relaxkv_anchor_ratio=anchor, relaxkv_context_ratio=context)
    body = {"text": prompt.text, "return_logprob": True, "top_logprobs_num": top,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "custom_params": custom}}
    response = requests.post(url + "/generate", json=body, timeout=120)
    response.raise_for_status()
    out = response.json()
    meta = out["meta_info"]
    return out["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]], meta


def test_gate_passes_and_tells_a_wrong_rotation(family):
    model, server = family
    gate = relaxkv_state(server.url)["gate"]
    assert (gate["status"], gate["reason"]) == ("passed", ""), gate
    for name, check in gate["checks"].items():
        assert check["passed"] and check["max_error"] < 5e-4, (name, check)
    control = gate["control"]
    assert control["detected"] and control["max_error"] > 0.1, control  # 200x the tolerance or more
    family = TINY_MODELS[model].family
    lines = [line for line in open(server.log_path).read().splitlines() if "model family" in line]
    assert len(lines) == 1 and lines[0].endswith(f"model family {family}: chunk reuse yes; repair yes"), lines


def test_full_repair_is_full_and_zero_anchors_are_pic(family):
    url = family[1].url
    flush(url)
    docs = documents(3, seed=41)
    _run(url, marked_prompt("You are a helpful assistant.", docs, "Question: first?"), "pic", max_new_tokens=1)
    prompt = marked_prompt("Answer from the documents.", [docs[2], docs[0], docs[1]], "Question: which?")
    full_ids, full_lp, _ = _run(url, prompt, "full")
    pic_ids, pic_lp, _ = _run(url, prompt, "pic")
    assert pic_lp != pytest.approx(full_lp, abs=1e-3)  # the repair has something to fix
    ids, lp, meta = _run(url, prompt, "relaxkv", anchor=1.0, context=1.0)
    record = meta["relaxkv"]
    assert record["repaired"] and record["chunks_hit"] == 3 and record["anchor_ratio"] == pytest.approx(1.0), record
    assert ids == full_ids and lp == pytest.approx(full_lp, abs=1e-4)
    ids, lp, meta = _run(url, prompt, "relaxkv", anchor=0.0, context=0.5)
    assert meta["relaxkv"]["repaired"] and meta["relaxkv"]["anchors_per_layer"] == 0, meta["relaxkv"]
    assert ids == pic_ids and lp == pytest.approx(pic_lp, abs=1e-5)


def _reference(model: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relaxkv_sglang.repair.reference import from_hf_state_dict

    path = assets.model_path(model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # every tiny model holds tiny-llama's tokenizer files; read by the model's own type, transformers would give
    # tiny-qwen2 its Qwen2Tokenizer, which splits them otherwise than the server does
    return (from_hf_state_dict(hf.state_dict(), hf.config.to_dict()),
            AutoTokenizer.from_pretrained(assets.model_path("tiny-llama")))


def test_served_full_and_repair_match_the_torch_reference(family):
    from relaxkv_sglang.repair.reference import reference_prefill, stale_context
    from relaxkv_sglang.repair.repair_config import RepairConfig

    model, url = family[0], family[1].url
    weights, tokenizer = _reference(model)
    flush(url)
    docs = documents(3, seed=43)
    _run(url, marked_prompt("Warm-up system prompt.", docs[::-1], "Q?", glue=False), "pic", max_new_tokens=1)
    prompt = marked_prompt("You answer questions.", docs, "Question: what?", glue=False)
    layout = part_token_ids(tokenizer, prompt)
    ids = torch.tensor(layout.input_ids)
    stale = stale_context(weights, ids, layout.chunk_spans, layout.query_start)
    for policy, anchor, context in (("full", None, None), ("relaxkv", 0.3, 0.25)):
        served_ids, _, meta = _run(url, prompt, policy, anchor, context, max_new_tokens=1, top=5)
        config = RepairConfig(anchor_ratio=anchor or 0.0, context_ratio=context or 1.0)
        result = reference_prefill(weights, ids, layout.chunk_spans, layout.query_start, policy, config, stale=stale)
        ref_lp = torch.log_softmax(result.last_logits, -1)
        assert served_ids[0] == int(ref_lp.argmax()), policy
        for logprob, token, _ in meta["output_top_logprobs"][0]:
            assert logprob == pytest.approx(float(ref_lp[token]), abs=2e-3), (policy, token)
        if policy == "relaxkv":
            assert meta["relaxkv"]["chunks_hit"] == 3
            assert meta["relaxkv"]["repair_kv_pairs"] == result.report.repair_kv_pairs > 0


@sgl.function
def rag_program(s, docs, question):
    s += "Answer from the documents.\n"
    for doc in docs:
        s += document(doc) + "\n"
    s += "Question: " + question + "\nAnswer:" + sgl.gen("answer", max_tokens=3, temperature=0)


def test_frontend_program_and_chat_are_repaired(family):
    model, url = family[0], family[1].url
    docs = documents(2, seed=45)
    state = rag_program.run(docs=docs, question="What is it about?", backend=RelaxKVEndpoint(url, policy="relaxkv"))
    assert state.error() is None, state.error()
    record = state.get_meta_info("answer")["relaxkv"]
    assert record["policy"] == "relaxkv" and record["chunks_seen"] == 2 and record["repaired"], record
    content = [{"type": "text", "text": d} for d in docs[::-1]] + [{"type": "text", "text": "Who wrote it?"}]
    body = {"model": model, "max_tokens": 3, "temperature": 0, "return_meta_info": True,
            "custom_params": {"relaxkv_policy": "relaxkv"},
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]}
    response = requests.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    record = response.json()["choices"][0]["meta_info"]["relaxkv"]
    assert record["chunks_seen"] == 2 and record["chunks_hit"] == 2 and record["repaired"], record

