"""The ways of marking chunks besides native ``relaxkv_chunks``, end to end (tiny model).

* SGLang frontend programs: ``relaxkv_sglang.lang.document`` + ``RelaxKVEndpoint``;
* OpenAI ``/v1/chat/completions``: text content parts (``request/sglang/chat.py``);
* SGLang's parallel encoding, ``forks.join(mode="concate_and_append")`` on a
  plain ``sgl.RuntimeEndpoint`` (``request/sglang/parallel_encoding.py``).

For each: the same three documents, sent again in another order after another
system prompt, are served from the cache (``cached_tokens`` covers them).
"""

from __future__ import annotations

import threading
import time

import pytest
import requests
import sglang as sgl
from rag_helpers import documents

from relaxkv_sglang.lang import DOC_END, DOC_START, RelaxKVEndpoint, document, mark_payload, split_marks, strip_marks
from relaxkv_sglang.server.launch import ServerConfig
from relaxkv_sglang.request.sglang.join_registry import JoinRegistry

pytestmark = pytest.mark.e2e

PROGRAM_TIMEOUT_S = 120  # a program whose join is answered 404 hangs; fail instead


def test_plugin_server_command_selects_the_plugin_backends(tiny_model_path):
    """The launch line of the servers these tests use (the session's ``relaxkv_server``)."""
    command = " ".join(ServerConfig(model_path=tiny_model_path, policy="prefix").command())
    assert "--radix-cache-backend relaxkv" in command and "--attention-backend relaxkv" in command, command
    assert "--disable-overlap-schedule" in command, command


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def run_with_timeout(fn, *args, **kwargs):
    """fn's result; fails the test if fn raises or does not return in time."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # reported below, in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(PROGRAM_TIMEOUT_S)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} did not finish in {PROGRAM_TIMEOUT_S} s (hung?)"
    if "error" in box:
        raise box["error"]
    return box.get("result")


# ---------------------------------------------------------------- frontend


@sgl.function
def rag_program(s, system, docs, question):
    s += system + "\n"
    for doc in docs:
        s += document(doc) + "\n"
    s += "Question: " + question + "\nAnswer:" + sgl.gen("answer", max_tokens=6, temperature=0)


def test_marks_become_offsets_of_the_text_sent():
    text = "sys\n" + document("first doc") + "\n" + document("second") + "\nQ?"
    clean, spans = split_marks(text)
    assert clean == strip_marks(text) == "sys\nfirst doc\nsecond\nQ?"
    assert [clean[s:e] for s, e in spans] == ["first doc", "second"]
    body = mark_payload({"text": [text + "a", text + "b"], "sampling_params": {"max_new_tokens": 0}}, "pic")
    assert body["text"] == [clean + "a", clean + "b"]
    assert [sp["custom_params"] for sp in body["sampling_params"]] == [
        {"relaxkv_chunks": [4, 13, 14, 20], "relaxkv_policy": "pic"}] * 2
    # lone or empty marks mark nothing and never reach the server
    assert split_marks(f"a{DOC_END}b{DOC_START}{DOC_END}c{DOC_START}") == ("abc", [])
    with pytest.raises(ValueError):
        document(DOC_START + "x")
    with pytest.raises(TypeError):
        document(3)


def test_frontend_documents_are_reused_in_another_order(relaxkv_server, tokenizer):
    docs = documents(3, seed=101)
    backend = RelaxKVEndpoint(relaxkv_server.url, policy="pic")
    first = rag_program.run(system="You answer from the documents.", docs=docs, question="What is it about?",
                            backend=backend)
    assert first.get_meta_info("answer")["relaxkv"]["chunks_seen"] == 3
    second = rag_program.run(system="Another system prompt, for another user.", docs=[docs[2], docs[0], docs[1]],
                             question="Who wrote it?", backend=backend)
    meta = second.get_meta_info("answer")
    assert meta["relaxkv"]["chunks_hit"] == 3, meta
    assert meta["cached_tokens"] >= sum(n_tokens(tokenizer, d) for d in docs), meta
    # the marks stay in the program's text
    assert second.text().count(DOC_START) == 3
    assert strip_marks(second.text()).startswith("Another system prompt, for another user.\n" + docs[2] + "\n")


@sgl.function
def rich_program(s, docs, question):
    s += "Context:\n" + "".join(document(d) + "\n" for d in docs)
    s += "Is it about startups? " + sgl.select("yes", choices=["yes", "no"]) + "\n"
    forks = s.fork(2)
    forks += lambda i: f"Idea {i}:" + sgl.gen("idea", max_tokens=3, temperature=0)
    forks.join()
    s += "Question: " + question + "\nAnswer:" + sgl.gen("answer", max_tokens=4, temperature=0)


def streamed_pieces(state, name: str, timeout_s: float = PROGRAM_TIMEOUT_S) -> list[str]:
    """The pieces ``state.text_iter(name)`` streams, once the program has declared ``name``.

    SGLang 0.5.23's ``ProgramState.text_iter`` (``lang/interpreter.py``) spins on "is the variable
    declared?" then "is the program finished?" as two separate reads: a program that declares and
    finishes the variable between them (a loaded machine starving the reading thread) yields ``""``
    only (seen once in CI). Waiting for the declaration first leaves the streaming path itself
    under test.
    """
    executor = state.stream_executor
    deadline = time.monotonic() + timeout_s
    while name not in executor.stream_var_event:
        finished = executor.is_finished  # read before the declaration's second look, so no race of our own
        assert name in executor.stream_var_event or (not finished and time.monotonic() < deadline), \
            f"the program never declared {name!r}"
        time.sleep(0.01)
    return list(state.text_iter(name))


def test_frontend_select_fork_stream_and_batch(relaxkv_server, tokenizer):
    docs = documents(2, seed=102)
    backend = RelaxKVEndpoint(relaxkv_server.url, policy="pic")
    states = rich_program.run_batch(
        [{"docs": docs, "question": "Why?"}, {"docs": docs[::-1], "question": "How?"}], backend=backend,
    )
    for state in states:
        assert state.error() is None, state.error()
        assert state["yes"] in ("yes", "no")
        assert len(state["idea"]) == 2
        assert state.get_meta_info("answer")["relaxkv"]["chunks_seen"] == 2
    # streamed, after the batch: both documents come from the chunk tree
    state = rich_program.run(docs=docs, question="When?", backend=backend, stream=True)
    pieces = streamed_pieces(state, "answer")
    assert "".join(pieces) == state["answer"] and any(pieces), pieces
    meta = state.get_meta_info("answer")
    assert meta["cached_tokens"] >= sum(n_tokens(tokenizer, d) for d in docs), meta


@sgl.function
def plain_program(s, question):
    s += "You are a careful assistant.\n"
    s += "Question: " + question + "\nIs it hard? " + sgl.select("hard", choices=["yes", "no", "maybe"]) + "\n"
    s += "Answer:" + sgl.gen("answer", max_tokens=12, temperature=0)


def test_unmarked_program_on_plain_endpoint_matches_stock_sglang(relaxkv_server, server):
    outputs = []
    for srv in (relaxkv_server, server):
        state = plain_program.run(question="How do rockets work?", backend=sgl.RuntimeEndpoint(srv.url))
        assert state.error() is None
        outputs.append((state["hard"], state["answer"], state.text()))
        assert "relaxkv" not in (state.get_meta_info("answer") or {})
    assert outputs[0] == outputs[1]


# --------------------------------------------------------------------- chat


def chat(url: str, system: str, docs: list[str], question: str, policy: str | None = "pic",
         headers: dict | None = None) -> dict:
    content = [{"type": "text", "text": d} for d in docs] + [{"type": "text", "text": question}]
    body = {
        "model": "tiny", "max_tokens": 4, "temperature": 0, "return_meta_info": True,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}],
    }
    if policy is not None:
        body["custom_params"] = {"relaxkv_policy": policy}
    r = requests.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_policy_header_marks_documents(relaxkv_server, tokenizer):
    """A request header (``extra_headers`` with the OpenAI SDK) sets the policy a body without
    ``custom_params`` gets, so the documents become chunks."""
    docs = documents(2, seed=105)
    url = relaxkv_server.url
    pic = {"X-RelaxKV-Policy": "pic"}
    chat(url, "Be brief.", docs, "Summarize.", policy=None, headers=pic)
    meta = chat(url, "Other.", docs[::-1], "Who?", policy=None, headers=pic)["choices"][0]["meta_info"]
    assert meta["relaxkv"]["policy"] == "pic" and meta["relaxkv"]["chunks_hit"] == 2, meta
    assert meta["cached_tokens"] >= sum(n_tokens(tokenizer, d) for d in docs), meta


def test_chat_content_parts_are_reused_in_another_order(relaxkv_server, tokenizer):
    docs = documents(3, seed=103)
    url = relaxkv_server.url
    first = chat(url, "You answer from the documents.", docs, "What is it about?")["choices"][0]["meta_info"]
    assert first["relaxkv"]["chunks_seen"] == 3, first
    second = chat(url, "Another system prompt.", [docs[1], docs[2], docs[0]], "Who?")["choices"][0]["meta_info"]
    assert second["relaxkv"]["chunks_hit"] == 3, second
    assert second["cached_tokens"] >= sum(n_tokens(tokenizer, d) for d in docs), second


def test_chat_without_chunk_policy_is_stock(relaxkv_server, server):
    docs = documents(2, seed=104)
    ours = chat(relaxkv_server.url, "Be brief.", docs, "Summarize.", policy=None)
    stock = chat(server.url, "Be brief.", docs, "Summarize.", policy=None)
    assert "relaxkv" not in ours["choices"][0]["meta_info"]
    assert ours["usage"]["prompt_tokens"] == stock["usage"]["prompt_tokens"]
    assert ours["choices"][0]["message"]["content"] == stock["choices"][0]["message"]["content"]


# -------------------------------------------------------- parallel encoding


@sgl.function
def parallel_encoding_copy(s, question, context_0, context_1, context_2):
    """sglang.test.test_programs.test_parallel_encoding's program, returning its state."""
    s += "USER: I will ask a question based on some statements.\n"
    s += "ASSISTANT: Sure. I will give the answer.\n"
    s += "USER: Please memorize these statements.\n"
    contexts = [context_0, context_1, context_2]
    forks = s.fork(len(contexts))
    forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
    forks.join(mode="concate_and_append")
    s += "Now, please answer the following question. Do not list options."
    s += "\nQuestion: " + question + "\n"
    s += "ASSISTANT:" + sgl.gen("answer", max_tokens=64)


@pytest.fixture
def default_backend(relaxkv_server):
    sgl.set_default_backend(sgl.RuntimeEndpoint(relaxkv_server.url))
    yield
    sgl.global_config.default_backend = None


def test_sglang_parallel_encoding_program_runs(default_backend, tokenizer):
    from sglang.test.test_programs import test_parallel_encoding

    run_with_timeout(test_parallel_encoding, check_answer=False)
    # The same program again: its statements were stored as chunks by the run above.
    state = run_with_timeout(
        parallel_encoding_copy.run, question="Who is the father of Julian?",
        context_0="Ethan is the father of Liam.", context_1="Noah is the father of Julian.",
        context_2="Oliver is the father of Carlos.", temperature=0,
    )
    meta = state.get_meta_info("answer")
    statements = ["Statement 0: Ethan is the father of Liam.\n", "Statement 1: Noah is the father of Julian.\n",
                  "Statement 2: Oliver is the father of Carlos.\n"]
    assert meta["relaxkv"]["policy"] == "pic" and meta["relaxkv"]["chunks_hit"] == 3, meta
    assert meta["cached_tokens"] >= sum(n_tokens(tokenizer, t) for t in statements), meta


@pytest.mark.skip(reason="the tiny test model has random weights: it cannot answer 'Noah'")
def test_sglang_parallel_encoding_answer(default_backend):
    from sglang.test.test_programs import test_parallel_encoding

    run_with_timeout(test_parallel_encoding, check_answer=True)


@sgl.function
def parallel_rag(s, system, docs, question):
    s += system + "\n"
    forks = s.fork(len(docs))
    forks += lambda i: docs[i] + "\n"
    forks.join(mode="concate_and_append")
    s += "Question: " + question + "\nAnswer:" + sgl.gen("answer", max_tokens=6, temperature=0)


def test_parallel_encoding_branches_are_reused_in_another_order(default_backend, tokenizer):
    docs = documents(3, seed=105)
    first = run_with_timeout(parallel_rag.run, system="You answer from the documents.", docs=docs, question="What?")
    assert first.get_meta_info("answer")["relaxkv"]["chunks_seen"] == 3
    second = run_with_timeout(parallel_rag.run, system="Another system prompt, for another user.",
                              docs=[docs[2], docs[0], docs[1]], question="Who?")
    meta = second.get_meta_info("answer")
    assert meta["relaxkv"]["chunks_hit"] == 3, meta
    assert meta["cached_tokens"] >= sum(n_tokens(tokenizer, d) for d in docs), meta


# ------------------------------------------------ join registry (no server)


P = "USER: memorize these.\n"


def test_join_matches_by_content_between_concurrent_programs():
    reg = JoinRegistry()
    a = ["A0 first statement\n", "A1 second statement\n"]
    b = ["B0 other statement\n", "B1 more statements\n"]
    for x, y in zip(a, b):  # interleaved commits of two programs with the same fork point
        reg.commit(P + x)
        reg.commit(P + y)
    reg.join(2)
    reg.join(2)
    tb = P + b[1] + b[0] + "Question?"
    ta = P + a[0] + a[1] + "Question?"
    assert [tb[s:e] for s, e in reg.spans_for(tb)] == [b[1], b[0]]
    assert [ta[s:e] for s, e in reg.spans_for(ta)] == a
    assert reg.stats()["pending_joins"] == 0
    # later requests of the same programs keep their marks
    assert reg.spans_for(ta + " more") == reg.spans_for(ta)


def test_join_fork_point_is_inferred_when_branches_share_a_beginning():
    reg = JoinRegistry()
    branches = [f"Statement {i}: fact number {i}.\n" for i in range(3)]
    for br in branches:
        reg.commit(P + br)  # no commit of P itself (the interpreter often skips it)
    reg.join(3)
    text = P + "".join(branches) + "Now answer."
    assert [text[s:e] for s, e in reg.spans_for(text)] == branches


def test_join_state_is_bounded_and_stale_joins_expire():
    now = [0.0]
    reg = JoinRegistry(max_commits=8, max_commit_chars=10_000, max_pending=4, pending_ttl_s=10,
                       max_joined=2, clock=lambda: now[0])
    reg.commit(P)  # the fork point: a join of one branch needs it
    for i in range(100):
        reg.commit(f"{P}branch {i}\n")
        reg.join(1)
    stats = reg.stats()
    assert stats["commits"] == 8 and stats["pending_joins"] == 4
    marked = [reg.spans_for(f"{P}branch {i}\nmore") for i in range(99, 95, -1)]  # each takes its own join
    assert marked == [[(len(P), len(P) + len(f"branch {i}\n"))] for i in range(99, 95, -1)]
    assert reg.stats()["joined_prefixes"] == 2 and reg.stats()["pending_joins"] == 0
    now[0] = 100.0
    reg.commit(P + "late\n")
    assert reg.spans_for(P + "late\nmore") == []  # no pending join left, none made after this commit
    assert reg.stats()["pending_joins"] == 0
    # a join only takes branches committed before it
    reg.join(1)
    reg.commit("X")
    assert reg.spans_for("X and more") == []
