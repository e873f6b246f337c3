"""SGLang's own frontend programs (``sglang.test.test_programs``), stock SGLang vs the plugin.

Every program function of that module is listed in :data:`PROGRAMS`
(:func:`test_every_program_of_sglang_is_listed` keeps the list complete when
SGLang changes). Each one that can run against a ``RuntimeEndpoint`` on the
tiny CPU model is run once against the stock server and once against the
plugin's server (policy ``prefix``: nothing is chunked), through a
:class:`RecordingEndpoint` that

* forces greedy decoding (several programs ask for temperature 0.1-0.7) and
  caps ``max_new_tokens`` to keep the file fast (never below a program's
  ``min_new_tokens``; the same requests go to both servers, so the cap changes
  nothing about the comparison);
* records every ``gen`` / streamed ``gen`` / ``select`` with the text it was
  asked on and what it got back. A program's later prompts contain its earlier
  outputs, so the records hold all of its outputs; they are compared as a
  multiset (forks and batches send in no fixed order). Any failed request, or
  error inside a program's executor, fails the test.

Answer checks a random-weight model cannot pass are not run in the
comparison, and are not deleted either:

* programs with a ``check_answer`` flag run with ``check_answer=False``;
* programs without one run from :data:`UNCHECKED`, the same source with each
  ``assert c, msg`` turned into the bare expression ``c`` (so they still read,
  and wait for, their results where they check them). A check that is not an
  ``assert`` (``json.loads`` of a string that never closed, ``eval`` of a
  random expression) still raises: the exception is compared between the
  servers like an output;
* ``test_program_answer_check`` runs each checked program, as SGLang writes it,
  against the plugin's server on SmolLM2-135M-Instruct (:data:`ANSWER_MODEL`,
  decoding greedily so the answers are reproducible), on demand:
  ``RELAXKV_PROGRAM_CHECKS=1`` (7 minutes on a loaded 2-core machine: the
  server's start 130 s, ``test_decode_int`` writing 2 x 128 digits 120 s,
  ``test_stream_logprobs`` 55 s, ``test_react`` 45 s, the rest 45 s; skipped
  where the model is not prepared: ``relaxkv-sglang model smollm2-135m``). Two
  pass; the other seven are strict expected failures at their answer check
  (an ``AssertionError``; a hang or a failed request is a failure), each with
  the answer SmolLM2 gives (:attr:`Program.answer_fails`), so a change in what
  the server answers shows.

``test_parallel_encoding`` runs on the plugin's server with a plain
``sgl.RuntimeEndpoint``; its three statements are served as chunks
(``meta_info.relaxkv`` of the joined request, and the chunk tree counters of
``/get_server_info``).
"""

from __future__ import annotations

import ast
import os
import re
import threading
import time
import types
import warnings
from typing import Callable, NamedTuple, Optional

import pytest
import sglang as sgl
import sglang.test.test_programs as tp
from rag_helpers import flush, relaxkv_state

from relaxkv_sglang import assets

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 8  # per gen (raised to a gen's min_new_tokens: test_gen_min_new_tokens checks its length)
PROGRAM_TIMEOUT_S = 120  # a hung program fails its test instead of the session
ANSWER_MODEL = "smollm2-135m"  # the model the answer checks run on (an asset name)
ANSWER_CHECKS = os.environ.get("RELAXKV_PROGRAM_CHECKS") == "1"
ANSWER_TIMEOUT_S = 900  # test_decode_int writes 2 x 128 digits: 80-210 s measured on a loaded 2-core machine
STREAMED_LOGPROBS = ("fails on stock SGLang 0.5.23 too: without --incremental-streaming-output a streamed "
                     "chunk's output_token_logprobs are cumulative, the program expects per-chunk ones")


class _AssertsToExpressions(ast.NodeTransformer):
    def visit_Assert(self, node: ast.Assert) -> ast.Expr:
        return ast.copy_location(ast.Expr(value=node.test), node)


def _without_asserts() -> types.ModuleType:
    """sglang.test.test_programs with each ``assert c, msg`` turned into the expression ``c``.

    The programs run as written, reading their results where their checks
    read them (which is also where they wait for them), but a check that
    does not hold no longer raises."""
    with open(tp.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read(), tp.__file__)
    tree = ast.fix_missing_locations(_AssertsToExpressions().visit(tree))
    module = types.ModuleType("sglang_test_programs_unchecked")
    module.__file__ = tp.__file__
    exec(compile(tree, tp.__file__, "exec"), module.__dict__)
    return module


UNCHECKED = _without_asserts()


class Program(NamedTuple):
    run: Optional[Callable[[], object]] = None  # for the comparison; None: cannot run here
    checked: Optional[Callable[[], object]] = None  # the program with its checks, as SGLang runs it
    answer_fails: str = ""  # why ``checked`` fails on ANSWER_MODEL (what it answers; measured, greedy); "" passes
    may_raise: bool = False  # a check that is not an assert fails on the model's output (same on both)
    cap: Optional[int] = MAX_NEW_TOKENS
    cannot_run: str = ""


PROGRAMS: dict[str, Program] = {
    "test_few_shot_qa": Program(UNCHECKED.test_few_shot_qa, tp.test_few_shot_qa,
                                answer_fails="the capital of the United States: ' New York'"),
    "test_mt_bench": Program(tp.test_mt_bench),
    "test_select": Program(lambda: tp.test_select(check_answer=False), lambda: tp.test_select(check_answer=True),
                           answer_fails="'The capital of Germany is Berlin.': False"),
    "test_decode_int": Program(UNCHECKED.test_decode_int, tp.test_decode_int,
                               answer_fails="the hours in a day: 24 then 126 zeros (its int runs to 128 tokens)"),
    # its strings must close before the gen's end: uncapped, they do
    "test_decode_json_regex": Program(tp.test_decode_json_regex, cap=None),
    # on the tiny model its strings run to max_new_tokens=64 without a closing quote: json.loads fails
    "test_decode_json": Program(UNCHECKED.test_decode_json, tp.test_decode_json, may_raise=True),
    "test_expert_answer": Program(lambda: tp.test_expert_answer(check_answer=False),
                                  lambda: tp.test_expert_answer(check_answer=True),
                                  answer_fails="'1000 is the capital of France'"),
    # on the tiny model its expression is not Python: eval fails
    "test_tool_use": Program(UNCHECKED.test_tool_use, tp.test_tool_use, may_raise=True),
    "test_react": Program(UNCHECKED.test_react, tp.test_react,
                          answer_fails="it searches for the creator of Linux again and again, never Finland"),
    "test_parallel_decoding": Program(tp.test_parallel_decoding),
    # on the plugin only: its statements become chunks, so its output is not stock's
    "test_parallel_encoding": Program(checked=lambda: tp.test_parallel_encoding(check_answer=True),
                                      answer_fails="the father of Julian: '' (an empty answer)",
                                      cannot_run="run in test_parallel_encoding_statements_are_chunks"),
    "test_image_qa": Program(cannot_run="needs a vision model and its example_image.png; the tiny model is "
                                        "text-only"),
    "test_stream": Program(tp.test_stream),
    "test_stream_logprobs": Program(UNCHECKED.test_stream_logprobs, tp.test_stream_logprobs,
                                    answer_fails=STREAMED_LOGPROBS),
    "test_regex": Program(tp.test_regex, cap=None),
    "test_dtype_gen": Program(tp.test_dtype_gen),
    "test_completion_speculative": Program(
        cannot_run="needs sglang's OpenAI backend: it reads backend.token_usage, which RuntimeEndpoint lacks "
                   "(SGLang runs it only against OpenAI)"),
    "test_chat_completion_speculative": Program(
        cannot_run="needs sglang's OpenAI backend: with num_api_spec_tokens the interpreter reads "
                   "backend.is_chat_model, which RuntimeEndpoint lacks (SGLang runs it only against OpenAI)"),
    "test_gen_min_new_tokens": Program(tp.test_gen_min_new_tokens),
}

COMPARED = [name for name, p in PROGRAMS.items() if p.run is not None]
CANNOT_RUN = [name for name, p in PROGRAMS.items() if p.run is None]


def _answer_model_problem() -> str:
    """Why the answer checks do not run here ("" when they do); never prepares the model."""
    if not ANSWER_CHECKS:
        return f"answer checks run on demand: RELAXKV_PROGRAM_CHECKS=1 (on {ANSWER_MODEL}, about 7 minutes)"
    folder = assets.cache_root() / "models" / ANSWER_MODEL
    if not folder.is_dir() or assets.manifest_problem(folder) is not None:
        return f"{ANSWER_MODEL} is not prepared here (relaxkv-sglang model {ANSWER_MODEL})"
    return ""


def _check_marks(program: Program) -> list:
    if _answer_model_problem():
        return [pytest.mark.skip(reason=_answer_model_problem())]
    if program.answer_fails:
        return [pytest.mark.xfail(raises=AssertionError, strict=True,
                                  reason=f"{ANSWER_MODEL} fails the check: {program.answer_fails}")]
    return []


CHECKS = [pytest.param(name, marks=_check_marks(p)) for name, p in PROGRAMS.items() if p.checked is not None]


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
        self.executors: list = []
        self._lock = threading.Lock()

    def end_program(self, s):
        super().end_program(s)
        with self._lock:
            self.executors.extend(s if isinstance(s, list) else [s])

    def wait_idle(self, timeout_s: float) -> None:
        """Wait for the programs that ended to finish running: a program that
        never reads its results (test_expert_answer(check_answer=False))
        returns while its gens are still being sent."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                workers = [getattr(ex, "worker", None) for ex in self.executors]
            workers = [w for w in workers if w is not None and w.is_alive()]
            if not workers:
                return
            workers[0].join(max(0.0, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                return

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


def run_with_timeout(fn: Callable[[], object], backend,
                     timeout_s: float = PROGRAM_TIMEOUT_S) -> Optional[BaseException]:
    """Run fn with ``backend`` as SGLang's default backend; the exception it raised, if any.

    Fails if fn hangs, or if a program's executor thread hit an error (the
    interpreter only warns about those, and some programs never look)."""
    box: dict = {}

    def target():
        try:
            fn()
        except BaseException as exc:  # returned to the test's thread
            box["error"] = exc
        if isinstance(backend, RecordingEndpoint):
            backend.wait_idle(timeout_s)

    sgl.set_default_backend(backend)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            thread.join(timeout_s)
        assert not thread.is_alive(), f"the program did not finish in {timeout_s} s (hung?)"
    finally:
        sgl.global_config.default_backend = None
    executor_errors = [str(w.message) for w in caught if "Error in stream_executor" in str(w.message)]
    assert not executor_errors, executor_errors[0]
    return box.get("error")


def outcome(exc: Optional[BaseException]) -> Optional[str]:
    """The exception as comparable text (pytest's rewritten asserts add object addresses)."""
    return None if exc is None else re.sub(r" at 0x[0-9a-f]+", "", f"{type(exc).__name__}: {exc}")


def run_on(srv, program: Program) -> tuple[list[tuple], Optional[str], RecordingEndpoint]:
    flush(srv.url)  # both servers start each program from an empty cache
    backend = RecordingEndpoint(srv.url, program.cap)
    exc = run_with_timeout(program.run, backend)
    assert not backend.errors, f"{srv.url}: requests failed: {backend.errors}"
    if exc is not None and not program.may_raise:
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
    assert ours_outcome == stock_outcome  # a check on the model's output (if any) fails the same way
    assert ours_records == stock_records


@pytest.mark.parametrize("name", CANNOT_RUN)
def test_program_cannot_run_here(name):
    pytest.skip(PROGRAMS[name].cannot_run)


@pytest.fixture(scope="module")
def answer_server():
    """The plugin's server (policy ``prefix``, as ``relaxkv_server``) on :data:`ANSWER_MODEL`."""
    from conftest import relaxkv_server_config, start_server

    srv = start_server(relaxkv_server_config)(str(assets.cache_root() / "models" / ANSWER_MODEL))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize("name", CHECKS)
def test_program_answer_check(name, answer_server):
    """The program with its checks, as SGLang writes them, decoding greedily (several programs
    sample at temperature 0.1-1.0) with no cap on its tokens. Only the program's own check may fail
    (an expected failure, module doc): a hang or a failed request is another error."""
    backend = RecordingEndpoint(answer_server.url, None)
    try:
        exc = run_with_timeout(PROGRAMS[name].checked, backend, ANSWER_TIMEOUT_S)
    except AssertionError as hang:
        raise RuntimeError(f"the program did not run to its check: {hang}") from None
    if backend.errors:
        raise RuntimeError(f"requests failed: {backend.errors}")
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
