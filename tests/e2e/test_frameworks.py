"""RAG frameworks as their users write them reuse documents with no change to the client (issue 33).

One server (tiny model, default policy ``pic``, ``--enable-cache-report``) is driven by the real
client libraries, written the way their RAG tutorials write them, with 8 retrieved documents
(HotpotQA paragraphs, one line of prose each):

* LangChain: ``ChatOpenAI`` behind a ``ChatPromptTemplate`` whose system message holds the
  documents joined by blank lines, the question as the human turn;
* LlamaIndex: ``OpenAILike`` as a chat model and as a completion model, through its response
  synthesizer (``compact``: the default text-QA template, documents between ``-----`` lines, each
  node under its ``file_path:`` metadata line);
* the OpenAI SDK: one user message holding every document as a ``[n]`` list, then the question.

Each test sends in a namespace of its own (a fresh ``cache_salt``, passed the way each client
passes extra body fields), so nothing another test sent is found: the first call finds the
documents by their structure alone and computes every one, and the second call, the same
documents reordered with another question, must reuse every one of them and nothing else (the
chunk tree's counters: hits equal to the documents sent, no insert). The cached tokens it reports
(``usage.prompt_tokens_details.cached_tokens``) must be at most the best possible and at least
:data:`MIN_SHARE` of it: the prompt's exact common prefix with the first call (what the radix
cache can serve) plus the tokens of each repeated text as the client wrote it (a LlamaIndex
node with its ``file_path:`` metadata line, which is reused with it, and its template's
instruction line, which is a chunk too). The prompts each client sent are recorded from its HTTP
client, so the bound is computed from what reached the server.

``RELAXKV_FRAMEWORK_MODEL=smollm2-135m`` runs the same tests on another prepared model (an asset
name of ``relaxkv_sglang.assets``; its server is started by the module, not prestarted).
"""

from __future__ import annotations

import json
import os
import random
import zlib

import httpx
import pytest
from conftest import TINY_POOL_TOKENS, start_server
from rag_helpers import documents, flush, relaxkv_state

from relaxkv_sglang import assets
from relaxkv_sglang.server.launch import STRICT_MEMORY_CHECK, ServerConfig

pytestmark = pytest.mark.e2e

MIN_SHARE = 0.995
N_DOCS = 8


def framework_config(model_path: str) -> ServerConfig:
    """The tiny model with ``pic`` as the server default: clients name no policy."""
    return ServerConfig(model_path=model_path, max_total_tokens=TINY_POOL_TOKENS, policy="pic", env=STRICT_MEMORY_CHECK,
                        extra_args=["--context-length", "4096", "--enable-cache-report"])


PRESTART_SERVERS = {"framework_server": start_server(framework_config)}


OTHER_MODEL = os.environ.get("RELAXKV_FRAMEWORK_MODEL")  # an asset name (module doc); None: the tiny model


@pytest.fixture(scope="module")
def model_path(tiny_model_path) -> str:
    from relaxkv_sglang import assets

    return str(assets.model_path(OTHER_MODEL)) if OTHER_MODEL else tiny_model_path


@pytest.fixture(scope="module")
def framework_server(model_path, tiny_model_path, prestart):
    if model_path != tiny_model_path:
        srv = PRESTART_SERVERS["framework_server"](model_path)
        try:
            yield srv
        finally:
            srv.stop()
        return
    with prestart.serving("framework_server", lambda: PRESTART_SERVERS["framework_server"](tiny_model_path)) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


class Recorder:
    """An ``httpx.Client`` whose requests and responses are kept (the clients take it as ``http_client``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict, dict]] = []
        self.client = httpx.Client(event_hooks={"response": [self._response]}, timeout=120)

    def _response(self, response: httpx.Response) -> None:
        response.read()
        self.calls.append((json.loads(response.request.content), response.json()))

    def last(self) -> tuple[dict, dict]:
        return self.calls[-1]


def prompt_ids(tokenizer, body: dict) -> list[int]:
    """The token ids the server prefilled for a recorded body (chat: its template, as SGLang renders it)."""
    if "messages" in body:
        return tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    return tokenizer.encode(body["prompt"], add_special_tokens=True)


def namespace(name: str) -> str:
    """A ``cache_salt`` no other request of any run has used."""
    return f"frameworks-{name}-{os.urandom(6).hex()}"


class Counters:
    """The chunk tree's counters (``/get_server_info``) around each call of a test."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.states = [relaxkv_state(url)]

    def mark(self) -> None:
        self.states.append(relaxkv_state(self.url))

    def delta(self, key: str, call: int) -> int:
        return self.states[call + 1][key] - self.states[call][key]


def common_prefix_tokens(tokenizer, body1: dict, body2: dict, reused: list[str]) -> int:
    """The most tokens the radix cache can serve the second prompt from the first: the two prompts'
    common text (chat: as the template renders it), up to the first text of ``reused`` in the
    second (that one counts as a chunk; LlamaIndex's nodes open alike, ``file_path: /data/``),
    tokenized on its own with the tokenizer's special tokens, as the server tokenizes the text
    before a prompt's first chunk (docs/api.md sections 1 and 3: its ids can end where the whole
    prompt's do not, ``[1] `` alone ending in a space token the whole prompt merges into the next
    word; a BOS the chat template does not render, as the tiny model's, is added)."""

    def text(body: dict) -> str:
        if "messages" in body:
            return tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        return body["prompt"]

    first, second = text(body1), text(body2)
    n = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
    n = min([n] + [second.find(r) for r in reused if r in second])
    return len(tokenizer.encode(first[:n], add_special_tokens=True))


def check_reuse(tokenizer, recorder: Recorder, counters: Counters, reused: list[str], name: str) -> float:
    """Each text of ``reused`` (what the client repeats: documents as it wrote them) computed once
    by the first call and a chunk hit on the second, and nothing else; the second call's cached
    tokens over the best possible (module doc), asserted between :data:`MIN_SHARE` and 1."""
    assert len(recorder.calls) == len(counters.states) - 1 == 2, (len(recorder.calls), len(counters.states))
    (body1, _), (body2, out2) = recorder.calls
    sent = json.dumps(body2)
    assert all(json.dumps(d)[1:-1] in sent for d in reused), f"{name}: a document was not sent verbatim"
    inserts, hits = ([counters.delta(k, call) for call in (0, 1)] for k in ("chunk_inserts", "chunk_hits"))
    assert (inserts, hits) == ([len(reused), 0], [0, len(reused)]), \
        f"{name}: chunks (inserted, hit) by the first and second call: {inserts}, {hits}; sent {len(reused)}"
    best = common_prefix_tokens(tokenizer, body1, body2, reused)
    best += sum(len(tokenizer.encode(d, add_special_tokens=False)) for d in reused)
    cached = out2["usage"]["prompt_tokens_details"]["cached_tokens"]
    share = cached / best
    print(f"{name}: cached {cached} of {out2['usage']['prompt_tokens']} prompt tokens, best possible {best}: "
          f"{share:.1%}")
    assert MIN_SHARE <= share <= 1, (name, cached, best, out2["usage"])
    return share


def hotpotqa_paragraphs(n: int, seed: int) -> list[str]:
    """``n`` HotpotQA paragraphs of 200-600 characters (one line of prose each), from distinct examples."""
    data = assets.load_data("hotpotqa")
    rng = random.Random(seed)
    paragraphs: list[str] = []
    for i in rng.sample(range(len(data)), 4 * n):
        texts = ["".join(sentences).strip() for _, sentences in data[i]["context"]]
        texts = [t for t in texts if 200 <= len(t) <= 600 and t not in paragraphs]
        if texts:
            paragraphs.append(rng.choice(texts))
        if len(paragraphs) == n:
            return paragraphs
    raise AssertionError(f"fewer than {n} paragraphs of 200-600 characters")


def retrievals() -> tuple[list[str], list[str]]:
    """The first retrieval and the second: the same documents, reordered (none keeps its place)."""
    docs = hotpotqa_paragraphs(N_DOCS, seed=33)
    return docs, docs[3:] + docs[:3][::-1]


# LlamaIndex's text-QA templates (completion and chat): the line above ``Query:``, the same in every
# prompt, is a chunk of its own (the block before a ``Query:`` line).
LLAMAINDEX_INSTRUCTION = "Given the context information and not prior knowledge, answer the query."


QUESTIONS = ("What do the documents say about startups?", "Which document mentions programming languages?")


def test_langchain_chat_documents_in_the_system_message(framework_server, tokenizer):
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    flush(framework_server.url)
    recorder, counters = Recorder(), Counters(framework_server.url)
    llm = ChatOpenAI(model="tiny", base_url=framework_server.url + "/v1", api_key="none", max_tokens=4,
                     temperature=0, http_client=recorder.client, extra_body={"cache_salt": namespace("langchain")})
    system = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
              "to answer the question. If you don't know the answer, say that you don't know. Use three sentences "
              "maximum and keep the answer concise.\n\n{context}")
    chain = ChatPromptTemplate.from_messages([("system", system), ("human", "{input}")]) | llm
    for retrieved, question in zip(retrievals(), QUESTIONS):
        docs = [Document(page_content=d) for d in retrieved]
        chain.invoke({"context": "\n\n".join(doc.page_content for doc in docs), "input": question})
        counters.mark()
    check_reuse(tokenizer, recorder, counters, retrievals()[1], "LangChain chat")


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_llamaindex_text_qa_template(framework_server, tokenizer, chat):
    from llama_index.core import get_response_synthesizer
    from llama_index.core.schema import NodeWithScore, TextNode
    from llama_index.llms.openai_like import OpenAILike

    flush(framework_server.url)
    recorder, counters = Recorder(), Counters(framework_server.url)
    llm = OpenAILike(model="tiny", api_base=framework_server.url + "/v1", api_key="none", is_chat_model=chat,
                     context_window=4096, max_tokens=4, temperature=0, http_client=recorder.client,
                     additional_kwargs={"extra_body": {"cache_salt": namespace(f"llamaindex-{chat}")}})
    synthesizer = get_response_synthesizer(llm=llm, response_mode="compact")

    def path(doc: str) -> str:
        return f"/data/hotpotqa/{zlib.crc32(doc.encode())}.txt"

    for retrieved, question in zip(retrievals(), QUESTIONS):
        nodes = [NodeWithScore(node=TextNode(text=d, metadata={"file_path": path(d)}), score=1.0) for d in retrieved]
        synthesizer.synthesize(question, nodes=nodes)
        counters.mark()
    reused = [f"file_path: {path(d)}\n\n{d}" for d in retrievals()[1]] + [LLAMAINDEX_INSTRUCTION]
    check_reuse(tokenizer, recorder, counters, reused, f"LlamaIndex {'chat' if chat else 'completion'}")


def test_openai_sdk_documents_in_one_string(framework_server, tokenizer):
    from openai import OpenAI

    flush(framework_server.url)
    recorder, counters = Recorder(), Counters(framework_server.url)
    client = OpenAI(base_url=framework_server.url + "/v1", api_key="none", http_client=recorder.client)
    salt = namespace("openai")
    for retrieved, question in zip(retrievals(), QUESTIONS):
        listing = "\n".join(f"[{i + 1}] {d}" for i, d in enumerate(retrieved))
        client.chat.completions.create(model="tiny", max_tokens=4, temperature=0, extra_body={"cache_salt": salt}, messages=[
            {"role": "system", "content": "Answer the question from the numbered documents."},
            {"role": "user", "content": f"Documents:\n{listing}\n\nQuestion: {question}"}])
        counters.mark()
    check_reuse(tokenizer, recorder, counters, retrievals()[1], "OpenAI SDK")


def test_a_chat_without_documents_is_served_as_sglang_builds_it(framework_server, tokenizer):
    """Nothing to reuse: the prompt SGLang rendered is prefilled as is (no BOS added, no chunk)."""
    messages = [{"role": "user", "content": "Hello there, how are you today?"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0, "return_meta_info": True}
    out = httpx.post(framework_server.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert out["usage"]["prompt_tokens"] == len(prompt_ids(tokenizer, body))
    assert (out["choices"][0]["meta_info"].get("relaxkv") or {}).get("chunks_seen", 0) == 0


def test_a_prompt_chunks_the_same_whatever_was_sent_before(framework_server):
    """Discovery is a function of the prompt (issue 46; the opt-in document index, which finds
    documents sent before, is tested in test_discovery_invariant.py): documents this tenant sent
    structured are not split out of a prompt that glues them on one line."""
    docs = [" ".join(d.split()) for d in documents(3, seed=34)]  # one line each
    glued = "Sys: " + " ".join(docs) + " Q?"  # one line: no structure to cut at
    url = framework_server.url + "/generate"

    def send(text: str, salt: str) -> dict:
        body = {"text": text, "cache_salt": salt, "sampling_params": {"max_new_tokens": 1}}
        return httpx.post(url, json=body, timeout=120).json()["meta_info"]["relaxkv"]

    tenant = os.urandom(4).hex()
    assert send("Sys.\n\n" + "\n\n".join(docs) + "\n\nQ?", tenant)["chunks_seen"] == 3
    assert send(glued, tenant)["chunks_seen"] == 0
    assert send(glued, "another-tenant")["chunks_seen"] == 0
