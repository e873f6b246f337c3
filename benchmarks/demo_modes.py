"""The demo's cache modes: the RAG request as a frontend program, and how one request is served.

A mode (:class:`Mode`) is one table row of ``make demo`` (:mod:`benchmarks.demo`): an
``@sgl.function`` program and the frontend backend it runs against. The plain program is what
an unmodified SGLang user writes; the marked one wraps each document in ``document(doc)`` and
runs against :class:`~relaxkv_sglang.lang.RelaxKVEndpoint`, which sends exactly the same text
with each document as one ``relaxkv_chunks`` pair. :data:`MODES` pins each row's policy in the
request itself, so every row means the same whatever default the server was started with.

:class:`ModeBackend` wraps the frontend backend to add a mode's ``custom_params`` and to time
each streamed answer at the server-sent events (the frontend's own text stream skips an empty
first chunk); :func:`serve_one` runs one request and returns its record.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Any, Callable

import sglang as sgl
from sglang.lang.ir import SglSamplingParams

from benchmarks import metrics
from benchmarks.prompt_formats import SEPARATOR
from benchmarks.rag_documents import RagRequest, prompt_parts
from relaxkv_sglang.lang import RelaxKVEndpoint, document
from relaxkv_sglang.request.schema import ANCHOR_RATIO, CONTEXT_RATIO

# The frontend's worker thread reports a failed request as a warning with a
# full traceback before recording it; the demo reports it itself, in one line.
warnings.filterwarnings("ignore", message="Error in stream_executor")


class DemoError(RuntimeError):
    """A failure the user can act on; the message is one line."""



# ----------------------------------------------------------------------- modes


@sgl.function
def plain_rag_program(s, system, documents, question):
    """The RAG request as plain text: what an unmodified SGLang user writes.

    Produces exactly :func:`rag_documents.render_prompt`'s text (the unit tests
    check it); the answer is greedy and stops at the end of the line. Its
    length cap comes from ``run(max_new_tokens=...)`` (a program argument of
    that name would be swallowed by ``run``'s own sampling keyword).
    """
    s += system
    for doc in documents:
        s += SEPARATOR + doc
    s += SEPARATOR + question
    s += sgl.gen("answer", temperature=0, stop="\n")


@sgl.function
def marked_rag_program(s, system, documents, question):
    """:func:`plain_rag_program` with each document marked by ``document(doc)``.

    Run against :class:`~relaxkv_sglang.lang.RelaxKVEndpoint`, the text sent is
    exactly :func:`plain_rag_program`'s and each document becomes one
    ``relaxkv_chunks`` pair (the separators stay outside the chunks, as in
    :func:`prompt_formats.marked_text`).
    """
    s += system
    for doc in documents:
        s += SEPARATOR + document(doc)
    s += SEPARATOR + question
    s += sgl.gen("answer", temperature=0, stop="\n")


def runtime_endpoint(url: str):
    """The stock frontend backend: ``sgl.RuntimeEndpoint``."""
    return sgl.RuntimeEndpoint(url)


def relaxkv_endpoint(url: str, *, policy: str, custom_params: dict | None = None):
    """The plugin's frontend backend: ``RelaxKVEndpoint(url, policy=..., custom_params=...)``."""
    return RelaxKVEndpoint(url, policy=policy, custom_params=custom_params)


@dataclasses.dataclass(frozen=True)
class Mode:
    """One row of the table: a name and how its requests are sent.

    ``program`` is an ``@sgl.function`` taking ``(s, system, documents,
    question)`` (the pieces of :func:`rag_documents.prompt_parts`) that generates
    into a variable named ``answer`` (its length cap is passed to ``run``); a
    mode that reuses document chunks marks them there (``document(text)``).
    ``custom_params`` are added to every generation request's
    ``sampling_params.custom_params`` (the stock frontend cannot send them):
    this is where a plain-program mode names its ``relaxkv_policy``.
    ``make_backend`` builds the frontend backend from the server URL (a
    marking mode's ``RelaxKVEndpoint``, which sends its policy and repair
    knobs itself). ``needs_plugin``: the mode only means something on a
    server started with the relaxkv plugin's cache and attention backend.
    """

    name: str
    description: str
    program: Any
    custom_params: dict | None = None
    make_backend: Callable[[str], Any] = runtime_endpoint
    needs_plugin: bool = False


# The repair knobs of the relaxkv row: the defaults, spelled out so the row says what it ran.
RELAXKV_PARAMS = {ANCHOR_RATIO.name: ANCHOR_RATIO.default, CONTEXT_RATIO.name: CONTEXT_RATIO.default}

# The mode every other row's "fidelity to full" is measured against.
REFERENCE_MODE = "full"

MODES: dict[str, Mode] = {
    # Policies are pinned rather than left to the server's default, so each
    # row means the same whatever default the server was started with.
    "full": Mode("full", "plain SGLang program, relaxkv_policy=full: no reuse (the fidelity reference)",
                 plain_rag_program, custom_params={"relaxkv_policy": "full"}, needs_plugin=True),
    "prefix": Mode("prefix", "plain SGLang program, relaxkv_policy=prefix: only the radix prefix cache can hit",
                   plain_rag_program, custom_params={"relaxkv_policy": "prefix"}),
    "pic": Mode("pic", "documents marked with document(), RelaxKVEndpoint(policy='pic'): chunk reuse, no repair",
                marked_rag_program, make_backend=functools.partial(relaxkv_endpoint, policy="pic"),
                needs_plugin=True),
    "relaxkv": Mode("relaxkv", "documents marked with document(), RelaxKVEndpoint(policy='relaxkv', "
                    f"anchor ratio {ANCHOR_RATIO.default}, context ratio {CONTEXT_RATIO.default}): "
                    "chunk reuse with RelaxKV repair",
                    marked_rag_program,
                    make_backend=functools.partial(relaxkv_endpoint, policy="relaxkv", custom_params=RELAXKV_PARAMS),
                    needs_plugin=True),
}


# --------------------------------------------------------------- the requests


@dataclasses.dataclass
class _SamplingParamsWithCustom(SglSamplingParams):
    """The frontend's sampling params plus ``custom_params``, which ``to_srt_kwargs`` then sends."""

    custom_params: dict | None = None

    def to_srt_kwargs(self):
        out = super().to_srt_kwargs()
        if self.custom_params:
            out["custom_params"] = dict(self.custom_params)
        return out


def with_custom_params(sampling_params: SglSamplingParams, custom_params: dict | None) -> SglSamplingParams:
    """A copy of ``sampling_params`` whose request also carries ``custom_params`` (unchanged if none)."""
    if not custom_params:
        return sampling_params
    fields = {f.name: getattr(sampling_params, f.name) for f in dataclasses.fields(SglSamplingParams)}
    return _SamplingParamsWithCustom(**fields, custom_params=dict(custom_params))


class ModeBackend:
    """Wraps a frontend backend for one mode: adds its custom params and times each streamed answer.

    Timing: the frontend's own streaming API (``state.text_iter``) only yields
    non-empty text, so an answer whose first token decodes to nothing (EOS, a
    stop string, a partial UTF-8 byte) would have no "first chunk". Timing at
    the backend's ``generate_stream`` instead sees every server-sent event:
    the first one carries the first generated token, whatever its text.

    Times are ``time.perf_counter()`` values keyed by the stream executor's
    ``sid``: ``sent`` (just before the HTTP request), ``first_chunk``,
    ``done`` (stream ended). One ``gen`` per program is assumed; ``select``
    is passed through untouched (no custom params). Everything else is
    delegated to the wrapped backend.
    """

    def __init__(self, inner, custom_params: dict | None = None):
        self._inner = inner
        self.custom_params = dict(custom_params or {})
        self.times: dict[str, dict[str, float]] = {}

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def generate(self, s, sampling_params):
        return self._inner.generate(s, with_custom_params(sampling_params, self.custom_params))

    def generate_stream(self, s, sampling_params):
        rec = self.times.setdefault(s.sid, {})
        rec["sent"] = time.perf_counter()
        for text, meta in self._inner.generate_stream(s, with_custom_params(sampling_params, self.custom_params)):
            rec.setdefault("first_chunk", time.perf_counter())
            yield text, meta
        rec["done"] = time.perf_counter()


def serve_one(mode: Mode, backend: ModeBackend, req: RagRequest, max_new_tokens: int) -> dict:
    """Run one request as ``mode``'s program with streaming; return its record.

    ``ttft_s`` is measured on the client, from the call to ``program.run``
    to the arrival of the first streamed event of the answer (the first
    generated token). It therefore includes the frontend's own work
    (microseconds), the HTTP round trip, tokenization, *waiting in the server
    queue behind the other clients' requests*, prefill of the uncached part of
    the prompt, the first decode step, detokenization and streaming. It does
    not include this client's earlier requests. ``latency_s`` runs to the end
    of the stream.
    """
    system, documents, question = prompt_parts(req)
    t0 = time.perf_counter()
    state = mode.program.run(
        system=system, documents=documents, question=question,
        max_new_tokens=max_new_tokens, temperature=0, stream=True, backend=backend,
    )
    # With stream=True, run() returns before the program has even submitted
    # its gen, so get_meta_info() right away could find no "answer" yet and
    # return None. Draining the answer's own text stream waits for the gen to
    # be submitted and to finish (or for the program to fail).
    for _ in state.text_iter("answer"):
        pass
    meta = state.get_meta_info("answer")
    error = state.error()
    if error is not None:
        raise error
    times = backend.times.pop(state.stream_executor.sid, {})
    if meta is None:
        # The program itself raised (in the frontend's thread, which prints
        # the traceback but records nothing) before its gen ran.
        raise DemoError("the mode's program produced no 'answer' (see the traceback above)")
    if "first_chunk" not in times:
        raise DemoError("the server streamed no tokens for a request")
    answer = state["answer"]
    return {
        "prompt_tokens": int(meta["prompt_tokens"]),
        "cached_tokens": int(meta.get("cached_tokens", 0)),
        "completion_tokens": int(meta.get("completion_tokens", 0)),
        "finish_reason": meta.get("finish_reason"),
        "ttft_s": times["first_chunk"] - t0,
        "latency_s": times.get("done", time.perf_counter()) - t0,
        "client_overhead_s": times["sent"] - t0,
        "answer": answer,
        "f1": metrics.qa_f1(answer, req.answers),
        "exact_match": metrics.exact_agreement(answer, req.answers),
        # The plugin's per-request report (policy, chunks hit, repair figures); None on a stock server.
        "relaxkv": meta.get("relaxkv"),
    }

