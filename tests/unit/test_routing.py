"""The document-affine routing key (relaxkv_sglang/request/routing.py): stability, the spans it hashes,
and MinHash's Jaccard property measured over seeds."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest

from benchmarks import prompt_formats
from relaxkv_sglang.request import routing
from relaxkv_sglang.request.doc_index import discover_chunks

DOCS = [f"Document {i}: " + " ".join(f"word{i}_{j}" for j in range(30)) for i in range(40)]


def test_document_hash_is_stable_across_processes():
    # a fixed value: the same on every machine and process (no per-process str hash salt)
    code = "from relaxkv_sglang.request import routing; print(routing.document_hash('héllo'), routing.routing_key_of_documents(['a', 'b']))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED=str(seed))).stdout for seed in (1, 2)}
    assert len(outs) == 1
    here = f"{routing.document_hash('héllo')} {routing.routing_key_of_documents(['a', 'b'])}\n"
    assert outs == {here}
    assert 0 <= routing.document_hash("héllo") < 2 ** 64
    assert routing.document_hash("a") != routing.document_hash("b")


def test_key_ignores_order_system_prompt_and_question():
    docs = DOCS[:5]
    a_text, a_off = prompt_formats.marked_text("System A.", docs, "Question: who?")
    b_text, b_off = prompt_formats.marked_text("Another system prompt entirely.", docs[::-1], "Question: what else?")
    key = routing.routing_key(a_text, a_off)
    assert key is not None and len(key) == 16 and int(key, 16) >= 0
    assert routing.routing_key(b_text, b_off) == key
    assert routing.routing_key_of_documents(docs) == key
    # the key is the MinHash of one of the request's documents
    assert int(key, 16) == min(routing.minhash([routing.document_hash(d)]) for d in docs)
    assert routing.routing_headers(a_text, a_off) == {routing.ROUTING_HEADER: key}


def test_key_uses_the_spans_the_server_chunks():
    text, offsets = prompt_formats.marked_text("System.", DOCS[:3], "Question?")
    # unmarked: the documents the server's block rules find (what it chunks for a chunk policy)
    # (a "Document N:" header is a marker, left out of its document)
    found = [text[s:e] for s, e in discover_chunks(text, None, None)]
    assert len(found) == 3 and all(d.endswith(f) for d, f in zip(DOCS[:3], found))
    assert routing.routing_key(text) == routing.routing_key_of_documents(found)
    # marked: exactly the marked spans; one document marked is that document's key
    assert routing.routing_key(text, offsets[:2]) == routing.routing_key_of_documents([DOCS[0]])
    # no documents, empty marks, or offsets the server rejects: no key
    assert routing.routing_key("just a question") is None
    assert routing.routing_key(text, []) is None
    assert routing.routing_headers("just a question") == {}
    for bad in ([0], [5, 2], [0, 10 ** 6], [0.0, 3.0], [True, 3]):
        assert routing.routing_key(text, bad) is None


def test_chat_documents_follow_the_chat_rule():
    messages = [
        {"role": "system", "content": "You answer from documents."},
        {"role": "user", "content": [{"type": "text", "text": DOCS[0]}, {"type": "image_url", "image_url": {}},
                                     {"type": "text", "text": DOCS[1]}, {"type": "text", "text": "Question?"}]},
    ]
    assert routing.chat_documents(messages) == [DOCS[0], DOCS[1]]
    assert routing.chat_routing_key(messages) == routing.routing_key_of_documents(DOCS[:2])
    assert routing.chat_routing_key([{"role": "user", "content": "no documents"}]) is None


PROSE = [f"The river town of Alder{i} grew around a mill built in {1700 + 7 * i}, and its stone bridge was rebuilt "
         f"twice after the floods of {1800 + 3 * i}." for i in range(8)]


def _langchain_chat(docs: list[str], question: str) -> list[dict]:
    """LangChain's RAG tutorial as it reaches the server: the documents joined by blank lines in the
    system message's string content, the question as the human turn."""
    system = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
              "to answer the question. If you don't know the answer, say that you don't know.\n\n" + "\n\n".join(docs))
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def test_chat_documents_inline_in_string_content_are_discovered():
    """Issue 48 item 5: documents inside one string get the key of the documents, in any order,
    the same key the marked form (one text part per document) gets."""
    docs = PROSE[:5]
    messages = _langchain_chat(docs, "Which town is oldest?")
    assert routing.chat_documents(messages) == docs
    key = routing.chat_routing_key(messages)
    assert key is not None and key == routing.routing_key_of_documents(docs)
    rng = random.Random(5)
    for _ in range(5):
        shuffled = rng.sample(docs, len(docs))
        assert routing.chat_routing_key(_langchain_chat(shuffled, f"Question {rng.random()}?")) == key
    marked = [{"role": "system", "content": "You answer from documents."},
              {"role": "user", "content": [{"type": "text", "text": d} for d in docs] + [{"type": "text", "text": "Q?"}]}]
    assert routing.chat_routing_key(marked) == key
    # the text the server searches is each message's content (regions): a document is never found
    # across two messages, and the system prompt and the question are not documents
    split = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": docs[0]},
             {"role": "user", "content": docs[1] + "\n\nWhich?"}]
    assert routing.chat_documents(split) == [docs[0], docs[1]]
    # LlamaIndex's chat text-QA template: each node under its file_path line, between rule lines
    nodes = "\n\n".join(f"file_path: /data/{i}.txt\n\n{d}" for i, d in enumerate(docs[:3]))
    llama = [{"role": "system", "content": "You are an expert Q&A system that is trusted around the world."},
             {"role": "user", "content": "Context information is below.\n---------------------\n" + nodes
              + "\n---------------------\nGiven the context information and not prior knowledge, answer the query."
              "\nQuery: Which?\nAnswer: "}]
    found = routing.chat_documents(llama)
    assert [f for f in found if f.startswith("file_path")] == [f"file_path: /data/{i}.txt\n\n{d}"
                                                              for i, d in enumerate(docs[:3])]
    assert routing.chat_routing_key(llama) == routing.routing_key_of_documents(found)
    # no documents: no key
    assert routing.chat_routing_key([{"role": "user", "content": "What is the capital of France?"}]) is None
    assert routing.chat_routing_key([{"role": "system", "content": PROSE[0]}, {"role": "user", "content": "Q?"}]) is None


def test_the_httpx_hook_sets_the_key_from_the_body():
    import httpx

    docs = PROSE[2:6]
    key = routing.routing_key_of_documents(docs)
    chat = httpx.Request("POST", "http://gw/v1/chat/completions", json={"model": "m", "messages": _langchain_chat(docs, "Q?")})
    routing.add_routing_header(chat)
    assert chat.headers[routing.ROUTING_HEADER] == key
    text, offsets = prompt_formats.marked_text("System.", docs, "Question?")
    for body, want in [({"model": "m", "prompt": text, "custom_params": {"relaxkv_chunks": offsets}}, key),
                       ({"text": text, "sampling_params": {"custom_params": {"relaxkv_chunks": offsets}}}, key),
                       ({"model": "m", "prompt": text}, routing.routing_key(text)),
                       ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, None),
                       ({"input": "embed me"}, None)]:
        req = httpx.Request("POST", "http://gw/x", json=body)
        routing.add_routing_header(req)
        assert req.headers.get(routing.ROUTING_HEADER) == want, body
    kept = httpx.Request("POST", "http://gw/x", json={"model": "m", "prompt": text}, headers={routing.ROUTING_HEADER: "mine"})
    routing.add_routing_header(kept)
    assert kept.headers[routing.ROUTING_HEADER] == "mine"
    routing.add_routing_header(httpx.Request("POST", "http://gw/x", content=b"not json"))  # left alone


def test_minhash_collision_probability_is_the_jaccard_similarity():
    """Over 2000 seeds, P[key(A) = key(B)] matches J(A, B) within 4 standard errors, for several overlaps."""
    rng = random.Random(0)
    seeds = 2000
    for shared, only_a, only_b in ((5, 0, 0), (4, 1, 1), (3, 2, 2), (2, 3, 3), (1, 4, 4), (0, 5, 5), (3, 0, 6)):
        pool = rng.sample(range(len(DOCS)), shared + only_a + only_b)
        a = pool[:shared + only_a]
        b = pool[:shared] + pool[shared + only_a:]
        j = routing.jaccard(a, b)
        assert j == pytest.approx(shared / (shared + only_a + only_b))
        ha = [routing.document_hash(DOCS[i]) for i in a]
        hb = [routing.document_hash(DOCS[i]) for i in b]
        equal = sum(routing.minhash(ha, s) == routing.minhash(hb, s) for s in range(seeds)) / seeds
        stderr = math.sqrt(max(j * (1 - j), 1e-9) / seeds)
        assert abs(equal - j) <= 4 * stderr + 1e-12, (shared, only_a, only_b, equal, j)
    # the seed is a different permutation: the same set's key changes with it
    assert len({routing.routing_key_of_documents(DOCS[:5], seed=s) for s in range(20)}) > 1


def test_keys_spread_requests_with_disjoint_documents():
    """Disjoint document sets get distinct keys (their minima are distinct 64-bit values)."""
    keys = {routing.routing_key_of_documents(DOCS[i:i + 4]) for i in range(0, 40, 4)}
    assert len(keys) == 10


def test_bad_seed():
    with pytest.raises(ValueError, match="seed"):
        routing.minhash([1], seed=-1)
    assert routing.minhash([]) is None
    assert routing.jaccard([], []) == 1.0


# --- the clients send the key -----------------------------------------------------------------


class _Recorder:
    """A local HTTP server answering like SGLang's /generate and /get_model_info; records headers."""

    def __init__(self):
        import http.server
        import json
        import threading

        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, body: dict):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._reply({"model_path": "tiny"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
                seen.append((self.path, self.headers.get(routing.ROUTING_HEADER), body))
                if self.path == "/v1/completions":
                    self._reply({"choices": [{"text": "y"}], "usage": {
                        "prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 4}}})
                else:
                    self._reply({"text": "x", "meta_info": {"prompt_tokens": 1, "cached_tokens": 0}})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorder():
    rec = _Recorder()
    yield rec
    rec.close()


def test_server_client_sends_the_routing_key(recorder):
    from relaxkv_sglang.client import ServerClient

    text, offsets = prompt_formats.marked_text("System.", DOCS[:4], "Question?")
    ServerClient(recorder.url).generate(text, offsets, "pic", max_new_tokens=1)
    ServerClient(recorder.url).generate("no documents here", None, "pic", max_new_tokens=1)
    ServerClient(recorder.url, routing=False).generate(text, offsets, "pic", max_new_tokens=1)
    keys = [key for _, key, _ in recorder.seen]
    assert keys == [routing.routing_key_of_documents(DOCS[:4]), None, None]


def test_relaxkv_endpoint_sends_the_routing_key(recorder):
    lang = pytest.importorskip("relaxkv_sglang.lang")
    endpoint = lang.RelaxKVEndpoint(recorder.url, policy="pic")
    text = "System.\n\n" + "\n\n".join(lang.document(d) for d in DOCS[2:5]) + "\n\nQuestion?"
    out = endpoint._http_request(endpoint.base_url + "/generate", json={"text": text, "sampling_params": {}})
    assert out.status_code == 200 and out.json()["text"] == "x"
    path, key, body = recorder.seen[-1]
    assert path == "/generate" and key == routing.routing_key_of_documents(DOCS[2:5])
    assert body["sampling_params"]["custom_params"]["relaxkv_chunks"]  # the marks became offsets
    # a batch (select): the MinHash of all items' documents
    batch = {"text": [lang.document(DOCS[0]) + "a", lang.document(DOCS[1]) + "b"], "sampling_params": {}}
    endpoint._http_request(endpoint.base_url + "/generate", json=batch)
    assert recorder.seen[-1][1] == routing.routing_key_of_documents(DOCS[:2])
    # routing off, or no documents: no header
    lang.RelaxKVEndpoint(recorder.url, policy="pic", routing=False)._http_request(
        endpoint.base_url + "/generate", json={"text": text, "sampling_params": {}})
    endpoint._http_request(endpoint.base_url + "/generate", json={"text": "plain", "sampling_params": {}})
    assert [key for _, key, _ in recorder.seen[-2:]] == [None, None]


def test_hot_key_splitter_spreads_only_hot_keys():
    hot, cold = DOCS[:5], [DOCS[10 + i:15 + i] for i in range(20)]
    splitter = routing.HotKeySplitter(replicas=8, window=100, max_load=0.5, seed=0)
    base = routing.routing_key_of_documents(hot)
    keys = []
    for i in range(200):  # the hot set is half the traffic: p = 0.5, r = ceil(0.5 * 8 / 0.5) = 8
        keys.append(splitter.key(hot) if i % 2 == 0 else splitter.key(cold[i % 20]))
    assert splitter.splits(base) == 8
    late_hot = {k for k in keys[100::2]}
    assert {k.split("/")[0] for k in late_hot} == {base} and len(late_hot) == 8
    # a cold key (1 in 20 of the other half: p = 0.025, r = ceil(0.4) = 1) stays whole
    assert splitter.key(cold[0]) == routing.routing_key_of_documents(cold[0])
    assert splitter.key([]) is None
    with pytest.raises(ValueError):
        routing.HotKeySplitter(0)


def test_hot_key_splitter_is_shared_safely_by_client_threads():
    from concurrent.futures import ThreadPoolExecutor

    splitter = routing.HotKeySplitter(replicas=4, window=50, seed=0)
    sets = [DOCS[i:i + 5] for i in range(10)]
    with ThreadPoolExecutor(8) as pool:
        keys = list(pool.map(lambda i: splitter.key(sets[i % 10]), range(4000)))
    assert len(keys) == 4000 and all(keys)
    # the window's bookkeeping stayed whole: one count per remembered request
    assert len(splitter._recent) == 50 and sum(splitter._counts.values()) == 50


def test_server_client_uses_the_splitter(recorder):
    from relaxkv_sglang.client import ServerClient

    text, offsets = prompt_formats.marked_text("System.", DOCS[:4], "Question?")
    client = ServerClient(recorder.url, splitter=routing.HotKeySplitter(replicas=4, window=4, seed=1))
    for _ in range(6):
        client.generate(text, offsets, "pic", max_new_tokens=1)
    base = routing.routing_key_of_documents(DOCS[:4])
    keys = [key for _, key, _ in recorder.seen]
    assert keys[0] == f"{base}/{keys[0].split('/')[1]}" if "/" in keys[0] else keys[0] == base
    assert all(k.split("/")[0] == base for k in keys) and any("/" in k for k in keys)


# --- serve --replicas: the command lines, and bad input in one line --------------------------


def test_router_command_lines():
    from relaxkv_sglang.server.cluster import ROUTER_DEFAULTS, RouterConfig, replica_configs
    from relaxkv_sglang.server.launch import ServerConfig

    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    cmd = RouterConfig(worker_urls=urls, routing="document", port=5, extra_args=["--cache-threshold", "0.5"]).command()
    assert cmd[1:3] == ["-m", "smg.launch_router"]
    at = cmd.index("--worker-urls")
    assert cmd[at + 1:at + 3] == urls
    # sticky keys, a new key placed by the round-robin turn (the balance guarantee, docs/scaling.md)
    routing = ["--policy", "round_robin", "--routing-key-override", "--assignment-mode", "delegate",
               "--routing-key-headers", "x-smg-routing-key"]
    assert cmd[at + 3:at + 3 + len(routing)] == routing
    at += 3 + len(routing)
    assert cmd[at:at + len(ROUTER_DEFAULTS)] == ROUTER_DEFAULTS
    assert cmd[-2:] == ["--cache-threshold", "0.5"] and "--prometheus-port" in cmd  # user flags last, a free port
    assert "--policy" in RouterConfig(worker_urls=urls, routing="round_robin").command()
    base = ServerConfig(model_path="/m", port=30000, log_path="/tmp/x.log", extra_args=["--context-length", "64"])
    configs = replica_configs(base, 3)
    assert [c.port for c in configs] == [0, 0, 0] and base.port == 30000
    assert [c.log_path for c in configs] == ["/tmp/x.log.replica0", "/tmp/x.log.replica1", "/tmp/x.log.replica2"]
    assert configs[0].extra_args == ["--context-length", "64", "--enable-metrics", "--enable-cache-report"]


def test_cpu_replicas_wait_passively_unless_told_otherwise(monkeypatch):
    """Replicas sharing one machine's cores must not spin against each other (cluster.SHARED_CORES_ENV)."""
    from relaxkv_sglang.server.cluster import replica_configs
    from relaxkv_sglang.server.launch import ServerConfig

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert all(c.env["OMP_WAIT_POLICY"] == "PASSIVE" for c in replica_configs(ServerConfig(model_path="/m"), 2))
    mine = replica_configs(ServerConfig(model_path="/m", env={"OMP_WAIT_POLICY": "ACTIVE"}), 2)
    assert [c.env["OMP_WAIT_POLICY"] for c in mine] == ["ACTIVE", "ACTIVE"]
    assert "OMP_WAIT_POLICY" not in replica_configs(ServerConfig(model_path="/m", device="cuda"), 2)[0].env
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's environment reaches the replicas as it is
    assert "OMP_WAIT_POLICY" not in replica_configs(ServerConfig(model_path="/m"), 2)[0].env


@pytest.mark.parametrize("argv, message", [
    (["serve", "--routing", "document"], "--routing needs --replicas N with N >= 2"),
    (["serve", "--replicas", "0"], "--replicas 0: must be >= 1"),
    (["serve", "--", "--x", "--", "--y"], "gateway flags (after a second --) need --replicas N with N >= 2"),
])
def test_serve_replicas_bad_input_is_one_line(argv, message, capsys):
    from relaxkv_sglang import cli

    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"relaxkv-sglang: error: {message}"]


def test_serve_replicas_refuses_a_busy_port_before_starting_anything(capsys):
    import socket

    from relaxkv_sglang import cli

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert cli.main(["serve", "--replicas", "2", "--model", "tiny-llama", "--port", str(port)]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"relaxkv-sglang: error: port {port} on 127.0.0.1 is in use; pick another with --port")


@pytest.mark.parametrize("url", ["10.0.0.2:30000", "http://10.0.0.2", "ftp://10.0.0.2:30000"])
def test_gateway_refuses_a_worker_that_is_not_a_url_in_one_line(url, capsys):
    from relaxkv_sglang import cli

    assert cli.main(["gateway", "--model", "tiny-llama", "--worker-urls", "http://10.0.0.3:30000", url]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"relaxkv-sglang: error: --worker-urls {url}: not a replica URL (http://HOST:PORT)"]


def test_gateway_refuses_a_busy_port(capsys):
    import socket

    from relaxkv_sglang import cli

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert cli.main(["gateway", "--model", "tiny-llama", "--port", str(port),
                         "--worker-urls", "http://127.0.0.1:9"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"relaxkv-sglang: error: port {port} on 127.0.0.1 is in use; pick another with --port")
