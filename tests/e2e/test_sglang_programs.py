"""SGLang's own frontend programs (``sglang.test.test_programs``), stock SGLang vs the plugin.

Every program function of that module is listed in :data:`PROGRAMS`
(:func:`test_every_program_of_sglang_is_listed` keeps the list complete when
SGLang changes). Each one that can run against a ``RuntimeEndpoint`` on the
tiny CPU model is run, unmodified, once against the stock server and once
against the plugin's server (policy ``prefix``: nothing is chunked), through a
:class:`RecordingEndpoint` that

* forces greedy decoding (several programs ask for temperature 0.1-0.7) and
  caps ``max_new_tokens`` to keep the file fast (the same requests go to both
  servers, so the cap changes nothing about the comparison);
* records every ``gen`` / streamed ``gen`` / ``select`` with the text it was
  asked on and what it got back. A program's later prompts contain its earlier
  outputs, so the records are all of its outputs; they are compared as a
  multiset (forks and batches send in no fixed order).

The programs with answer checks are compared without them: the ones with a
``check_answer`` flag run with ``check_answer=False``; the others (no flag)
run as they are and the exception their check raises on the random model's
answer is recorded and must be the same on both servers. Each answer check
keeps its own case (``test_program_answer_check``), skipped because the tiny
random model cannot answer.

``test_parallel_encoding`` runs on the plugin's server with a plain
``sgl.RuntimeEndpoint``; its three statements are served as chunks
(``meta_info.relaxkv`` of the joined request and the chunk tree counters).
"""

from __future__ import annotations

import re
import threading
from typing import Callable, NamedTuple, Optional

import pytest
import sglang as sgl
import sglang.test.test_programs as tp
from rag_helpers import flush, relaxkv_state

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 12  # per gen; test_gen_min_new_tokens runs uncapped (it checks a minimum length)
PROGRAM_TIMEOUT_S = 120  # a hung program fails its test instead of the session
CANNOT_ANSWER = "tiny random model cannot answer"


class Program(NamedTuple):
    run: Optional[Callable[[], object]]  # None: cannot run here
    answer_checked: bool = False  # its unflagged assertions need a real model's answer
    checked_run: Optional[Callable[[], object]] = None  # the program with its answer check on
    cap: Optional[int] = MAX_NEW_TOKENS
    cannot_run: str = ""


PROGRAMS: dict[str, Program] = {
    "test_few_shot_qa": Program(tp.test_few_shot_qa, answer_checked=True, checked_run=tp.test_few_shot_qa),
    "test_mt_bench": Program(tp.test_mt_bench),
    "test_select": Program(lambda: tp.test_select(check_answer=False),
                           checked_run=lambda: tp.test_select(check_answer=True)),
    "test_decode_int": Program(tp.test_decode_int, answer_checked=True, checked_run=tp.test_decode_int),
    "test_decode_json_regex": Program(tp.test_decode_json_regex, answer_checked=True,
                                      checked_run=tp.test_decode_json_regex),
    "test_decode_json": Program(tp.test_decode_json, answer_checked=True, checked_run=tp.test_decode_json),
    "test_expert_answer": Program(lambda: tp.test_expert_answer(check_answer=False),
                                  checked_run=lambda: tp.test_expert_answer(check_answer=True)),
    "test_tool_use": Program(tp.test_tool_use, answer_checked=True, checked_run=tp.test_tool_use),
    "test_react": Program(tp.test_react, answer_checked=True, checked_run=tp.test_react),
    "test_parallel_decoding": Program(tp.test_parallel_decoding),
    # run on the plugin only, below: its statements become chunks, so its output is not stock's
    "test_parallel_encoding": Program(None, checked_run=lambda: tp.test_parallel_encoding(check_answer=True),
                                      cannot_run="compared in test_parallel_encoding_statements_are_chunks"),
    "test_image_qa": Program(None, cannot_run="needs a vision model and its example_image.png; "
                                              "the tiny model is text-only"),
    "test_stream": Program(tp.test_stream),
    "test_stream_logprobs": Program(tp.test_stream_logprobs),
    "test_regex": Program(tp.test_regex, answer_checked=True, checked_run=tp.test_regex),
    "test_dtype_gen": Program(tp.test_dtype_gen, answer_checked=True, checked_run=tp.test_dtype_gen),
    "test_completion_speculative": Program(
        None, cannot_run="needs sglang's OpenAI backend (it reads backend.token_usage, which RuntimeEndpoint "
                         "lacks); SGLang runs it only against OpenAI"),
    "test_chat_completion_speculative": Program(tp.test_chat_completion_speculative),
    "test_gen_min_new_tokens": Program(tp.test_gen_min_new_tokens, cap=None),
}

COMPARED = [name for name, p in PROGRAMS.items() if p.run is not None]
CANNOT_RUN = [name for name, p in PROGRAMS.items() if p.run is None]
ANSWER_CHECKS = [name for name, p in PROGRAMS.items() if p.checked_run is not None]


class RecordingEndpoint(sgl.RuntimeEndpoint):
    """A RuntimeEndpoint that decodes greedily and records every output it gets."""

    def __init__(self, url: str, cap: Optional[int]):
        super().__init__(url)
        # test_gen_min_new_tokens reads ``default_backend.endpoint`` (an
        # ``sgl.Runtime`` attribute); the interpreter unwraps it the same way.
        self.endpoint = self
        self.cap = cap
        self.records: list[tuple] = []
        self.errors: list[str] = []
        self.chunk_metas: list[dict] = []  # meta_info that mentions relaxkv (there should be none)
        self._lock = threading.Lock()

    def _prepare(self, sampling_params) -> None:
        sampling_params.temperature = 0.0
        if self.cap is not None:
            sampling_params.max_new_tokens = min(sampling_params.max_new_tokens,
                                                 max(self.cap, sampling_params.min_new_tokens or 0))

    def _record(self, record: tuple, meta: Optional[dict] = None) -> None:
        with self._lock:
            self.records.append(record)
            if meta is not None and "relaxkv" in meta:
                self.chunk_metas.append(meta)

    def _failed(self, what: str, prompt: str, exc: BaseException) -> None:
        with self._lock:
            self.errors.append(f"{what} on {prompt[-80:]!r}: {exc!r}")

    def generate(self, s, sampling_params):
        prompt = s.text_
        self._prepare(sampling_params)
        try:
            text, meta = super().generate(s, sampling_params)
        except Exception as exc:
            self._failed("generate", prompt, exc)
            raise
        self._record(("gen", prompt, text, meta["completion_tokens"]), meta)
        return text, meta

    def generate_stream(self, s, sampling_params):
        prompt = s.text_
        self._prepare(sampling_params)
        pieces, meta = [], None
        try:
            for piece, meta in super().generate_stream(s, sampling_params):
                pieces.append(piece)
                yield piece, meta
        except Exception as exc:
            self._failed("generate_stream", prompt, exc)
            raise
        self._record(("stream", prompt, "".join(pieces), meta and meta["completion_tokens"]), meta)

    def select(self, s, choices, temperature, choices_method):
        prompt = s.text_
        try:
            decision = super().select(s, choices, temperature, choices_method)
        except Exception as exc:
            self._failed("select", prompt, exc)
            raise
        self._record(("select", prompt, tuple(choices), decision.decision))
        return decision


def run_with_timeout(fn: Callable[[], object], backend) -> Optional[BaseException]:
    """Run fn with ``backend`` as SGLang's default backend; the exception it raised, if any."""
    box: dict = {}

    def target():
        try:
            fn()
        except BaseException as exc:  # returned to the test's thread
            box["error"] = exc

    sgl.set_default_backend(backend)
    try:
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        thread.join(PROGRAM_TIMEOUT_S)
        assert not thread.is_alive(), f"the program did not finish in {PROGRAM_TIMEOUT_S} s (hung?)"
    finally:
        sgl.global_config.default_backend = None
    return box.get("error")


def outcome(exc: Optional[BaseException]) -> Optional[str]:
    """The exception as comparable text (pytest's rewritten asserts add object addresses)."""
    return None if exc is None else re.sub(r" at 0x[0-9a-f]+", "", f"{type(exc).__name__}: {exc}")


def run_on(srv, program: Program) -> tuple[list[tuple], Optional[str], RecordingEndpoint]:
    flush(srv.url)  # both servers start each program from an empty cache
    backend = RecordingEndpoint(srv.url, program.cap)
    exc = run_with_timeout(program.run, backend)
    assert not backend.errors, f"{srv.url}: requests failed: {backend.errors}"
    if exc is not None and not program.answer_checked:
        raise exc
    return sorted(backend.records, key=repr), outcome(exc), backend


def test_every_program_of_sglang_is_listed():
    functions = {name for name in dir(tp) if name.startswith("test_") and callable(getattr(tp, name))}
    assert functions == set(PROGRAMS)


@pytest.mark.parametrize("name", COMPARED)
def test_program_matches_stock_sglang(name, server, relaxkv_server):
    program = PROGRAMS[name]
    stock_records, stock_outcome, _ = run_on(server, program)
    ours_records, ours_outcome, ours = run_on(relaxkv_server, program)
    assert stock_records, "the program sent nothing"
    assert not ours.chunk_metas, f"no chunk is involved, yet the plugin served chunks: {ours.chunk_metas[:1]}"
    assert ours_outcome == stock_outcome  # the answer check (if any) fails the same way
    assert ours_records == stock_records


@pytest.mark.parametrize("name", CANNOT_RUN)
def test_program_cannot_run_here(name):
    pytest.skip(PROGRAMS[name].cannot_run)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.skip(reason=CANNOT_ANSWER)) for n in ANSWER_CHECKS])
def test_program_answer_check(name, relaxkv_server):
    """The program with its answer check, as SGLang runs it; needs a model that knows the answers."""
    exc = run_with_timeout(PROGRAMS[name].checked_run, sgl.RuntimeEndpoint(relaxkv_server.url))
    if exc is not None:
        raise exc


# -------------------------------------------------------- parallel encoding


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


STATEMENTS = ["Statement 0: Ethan is the father of Liam.\n", "Statement 1: Noah is the father of Julian.\n",
              "Statement 2: Oliver is the father of Carlos.\n"]  # test_parallel_encoding's branches


def test_parallel_encoding_statements_are_chunks(relaxkv_server, tokenizer):
    url = relaxkv_server.url
    flush(url)
    backend = sgl.RuntimeEndpoint(url)
    metas: list[dict] = []
    plain_generate = backend.generate

    def generate(s, sampling_params):  # on the instance: the class stays sgl.RuntimeEndpoint
        text, meta = plain_generate(s, sampling_params)
        metas.append(meta)
        return text, meta

    backend.generate = generate
    counters = [relaxkv_state(url)]
    for _ in range(2):
        exc = run_with_timeout(lambda: tp.test_parallel_encoding(check_answer=False), backend)
        if exc is not None:
            raise exc
        counters.append(relaxkv_state(url))

    assert len(metas) == 2, metas  # the one gen of each run: the joined request
    first, second = (m["relaxkv"] for m in metas)
    assert first["policy"] == second["policy"] == "pic", metas
    assert first["chunks_seen"] == 3 and first["chunks_hit"] == 0, first
    assert second["chunks_seen"] == 3 and second["chunks_hit"] == 3, second
    statement_tokens = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in STATEMENTS)
    assert metas[1]["cached_tokens"] >= statement_tokens, metas[1]

    def delta(key, i):
        return counters[i + 1][key] - counters[i][key]

    assert delta("chunk_inserts", 0) == 3 and delta("chunk_hits", 0) == 0, counters
    assert delta("chunk_hits", 1) == 3 and delta("chunk_inserts", 1) == 0, counters
    assert delta("chunk_hit_tokens", 1) >= statement_tokens, counters
