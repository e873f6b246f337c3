"""Soak driver: many concurrent RAG clients against a real relaxkv server, with aborts.

A server with the plugin serves the tiny model with a KV pool far smaller than
the working set (the shared documents alone are more than twice the pool), and
SGLang's strict idle memory check on (a leaked or double-freed KV slot stops
the server). ``clients`` threads send requests built from one shared set of
documents: a random subset in random order behind a random system prompt,
marked with ``relaxkv_chunks``, each under a random policy with random repair
ratios, some streamed. Mixed in:

* **aborts**: streamed requests (long, ``ignore_eos``) whose client closes the
  connection after the first event or after a short random delay. SGLang
  0.5.23 aborts a streamed request when its client disconnects (Starlette
  cancels the stream on ``http.disconnect``; the tokenizer manager sends an
  ``AbortReq``) and counts it in ``sglang:num_aborted_requests_total``, which
  the driver reads (the server runs with ``--enable-metrics``);
* **invalid requests**: a bad field, expected to be answered 400 ``invalid
  FIELD: ...``;
* **probes**: one fixed prompt under a few policies, greedy, whose answer must
  be the one the idle server gave before the load (see :data:`PROBES`);
* **split prompts**: chunked prefill is a fraction of the pool, so longer
  prompts (and prompts that share a prefill batch) are prefilled in several
  windows; a repair policy's request must still report ``repaired: true``;
* **retraction** (``--retract``, :data:`RETRACT`): a pool of 1,536 tokens,
  decodes of 48 tokens with EOS ignored, a scheduler that reserves little room
  for them, and SGLang's own test switch (``SGLANG_TEST_RETRACT``: retract a
  running request every 12th forward, besides those retracted when the pool is
  full; on two CPU cores decodes are too slow for memory pressure alone to
  retract often). SGLang prefills a retracted request again with its generated
  tokens; the reports must show it (``prefills`` > 1, a repair policy's
  ``repairs`` equal to it).

Expected outcomes are exactly: a 200 with a consistent ``meta_info.relaxkv``
record, a 400 for an invalid request, and a connection the client closed
itself. Anything else is an error, counted by kind: another HTTP status (SGLang
0.5.23 has no queue limit unless ``--max-queued-requests`` is set, so a 503
is not expected either), an error event in a stream, a timeout (a request
that did not end within ``request_timeout_s``), a connection error, an
inconsistent record, a probe whose answer changed.

At the end (after the load): ``/flush_cache`` must leave the KV pool entirely
free and the chunk tree empty (no leaked slot, no lock left), the server
process must be alive, answer ``/health_generate``, and give every probe its
first answer again.

Run: ``python -m tests.e2e.soak --quick`` (120 requests, 8 clients; about a
minute), ``--long`` (16 clients for 5 minutes), ``--retract`` (40 requests that
force retractions), or ``--requests N --clients C --seconds S``; ``--url`` uses
a running server instead of starting one.
It prints a summary and one JSON line of figures, and exits 1 if a check
failed. ``tests/e2e/test_soak.py`` runs the quick size in ``make test``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import sys
import threading
import time
from collections import Counter

import requests

from relaxkv_sglang import assets
from relaxkv_sglang.client import ServerClient
from benchmarks.metrics import latency_summary
from relaxkv_sglang.server.launch import STRICT_MEMORY_CHECK, SGLangServer, ServerConfig
from relaxkv_sglang.repair.policies import CHUNK_POLICIES, REPAIR_POLICIES, SERVER_POLICIES
from benchmarks.prompt_formats import SYSTEM_PROMPTS

if __package__:  # python -m tests.e2e.soak
    from .rag_helpers import SERVER_START_TIMEOUT_S, MarkedPrompt, essay_paragraphs, marked_prompt
else:  # imported by the tests, which run with tests/e2e on sys.path
    from rag_helpers import SERVER_START_TIMEOUT_S, MarkedPrompt, essay_paragraphs, marked_prompt



@dataclasses.dataclass(frozen=True)
class SoakSize:
    """How much load, and of what mix.

    Attributes:
        requests: requests to send (None: until ``seconds`` have passed).
        clients: concurrent client threads.
        seconds: stop sending new requests after this long (None: no limit).
        abort_share / invalid_share: share of requests aborted by their client / sent invalid.
        probe_every: one request in this many is a probe.
        pool_tokens: the server's KV pool (``--max-total-tokens``).
        shared_documents: the documents the requests draw from.
        max_new_tokens: output length of ordinary requests.
        abort_new_tokens: output length asked by requests that will be aborted (still running when closed).
        request_timeout_s: a request that does not end within this is an error (the no-hang bound).
        seed: the workload's seed (request ``i`` is the same in every run).
        chunked_prefill_tokens: the server's ``--chunked-prefill-size`` (prompts longer than
            this, or sharing a prefill batch, are split across windows).
        ignore_eos: ordinary requests decode all ``max_new_tokens``.
        schedule_conservativeness: the server's ``--schedule-conservativeness`` (None: SGLang's
            default, 1.0); near 0 the scheduler reserves almost no room for decodes, and retracts.
        retract_every: forwards between the retractions SGLang's test switch forces
            (``SGLANG_TEST_RETRACT_INTERVAL``); None: only those memory pressure causes.
        expect_retractions: the run must retract requests and report their prefills again.
    """

    requests: int | None = 120
    clients: int = 8
    seconds: float | None = None
    abort_share: float = 0.15
    invalid_share: float = 0.03
    probe_every: int = 10
    pool_tokens: int = 6144
    shared_documents: int = 120
    max_new_tokens: int = 8
    abort_new_tokens: int = 256
    request_timeout_s: float = 120.0
    seed: int = 0
    chunked_prefill_tokens: int = 512
    ignore_eos: bool = False
    schedule_conservativeness: float | None = None
    retract_every: int | None = None
    expect_retractions: bool = False


# SGLang's test switch retracts a running request every 10th forward: the quick run sees retractions too.
# The no-hang bound is 300 s, as for the other sizes: on a loaded 2-core machine (load average 16)
# the slowest of the 120 requests took 32 s (p99 26 s), and a request's latency grows with the load.
QUICK = SoakSize(requests=120, clients=8, retract_every=10, expect_retractions=True, request_timeout_s=300.0)
# Five minutes of 16 clients, however many requests that is on the machine (1,000 to 4,000 on 2 CPU cores).
LONG = SoakSize(requests=None, clients=16, seconds=300.0, request_timeout_s=300.0)
# Forced retraction: a 1,536-token pool, 48-token decodes to the end, little reserved for them,
# and one retraction every 12 forwards. One request in 6 a probe, so the 32 requests hold each probe.
RETRACT = SoakSize(requests=32, clients=6, probe_every=6, pool_tokens=1536, max_new_tokens=48, ignore_eos=True,
                   schedule_conservativeness=0.1, retract_every=12, abort_share=0.1, invalid_share=0.08,
                   request_timeout_s=300.0, expect_retractions=True)


@dataclasses.dataclass(frozen=True)
class Probe:
    """A fixed request whose greedy answer must not depend on what the cache holds."""

    name: str
    policy: str
    max_new_tokens: int
    anchor_ratio: float | None = None
    context_ratio: float | None = None


# By design every policy's output is a function of the prompt alone: a chunk hit
# is the same position-independent KV that a miss computes, and the repair's
# anchors are chosen from that KV with fixed seeds. That holds wherever SGLang's
# chunked prefill splits the prompt (a chunk is looked up in the window after it,
# computed position-independently until then; the repair runs in the last window
# over the whole prompt, forward/fold.py and forward/repair_stage.py), and the soak's server
# splits prompts (server_config). What keeps it from being exact, and the probes avoid:
# * a hit on a chunk cached at another position is re-rotated (fp rounding). The
#   probe's documents appear in no other request, so its hits are always at
#   delta 0, an exact copy (core.rope.rotate_keys);
# * a request retracted under memory pressure is prefilled again with its
#   generated tokens and repaired again, but its chunks may now be hits where they
#   were misses (re-rotation rounding), and generated tokens computed in one prefill
#   instead of decode steps. The repair policies' probes ask for one token, which
#   leaves no decode step to retract. Each probe also compares the first token's
#   top-5 alternatives, so a one-token probe still checks more than an argmax.
PROBES = (
    Probe("full", "full", 8),
    Probe("prefix", "prefix", 8),
    Probe("pic", "pic", 8),
    Probe("relaxkv-1tok", "relaxkv", 1, anchor_ratio=0.15, context_ratio=0.25),
    Probe("epic-1tok", "epic", 1, anchor_ratio=0.2),
)
INVALID = (  # (custom_params entry, the message's expected start)
    ({"relaxkv_anchor_ratio": 1.5}, "invalid relaxkv_anchor_ratio"),
    ({"relaxkv_policy": "no-such-policy"}, "invalid relaxkv_policy"),
    ({"relaxkv_chunks": [0, 10 ** 6]}, "invalid relaxkv_chunks"),
)


@dataclasses.dataclass
class Job:
    """One request of the workload (request ``index`` is the same in every run)."""

    index: int
    kind: str  # "normal", "abort", "invalid", "probe"
    prompt: MarkedPrompt
    policy: str
    max_new_tokens: int
    anchor_ratio: float | None = None
    context_ratio: float | None = None
    stream: bool = False
    abort_after: str | float | None = None  # "first" event, or seconds after the response started
    invalid: tuple[dict, str] | None = None
    probe: Probe | None = None
    ignore_eos: bool = False

    def body(self) -> dict:
        body = ServerClient._body(self.prompt.text, self.prompt.offsets, self.policy,
                                  max_new_tokens=self.max_new_tokens, anchor_ratio=self.anchor_ratio,
                                  context_ratio=self.context_ratio, top_logprobs=5 if self.probe else 0)
        if self.invalid is not None:
            body["sampling_params"]["custom_params"].update(self.invalid[0])
        if self.kind == "abort" or self.ignore_eos:
            body["sampling_params"]["ignore_eos"] = True  # still running when the client leaves
        if self.stream:
            body["stream"] = True
        return body


@dataclasses.dataclass
class Outcome:
    """What happened to one job: ``error`` is None for an expected outcome, else its kind."""

    job: Job
    latency_s: float
    error: str | None = None
    detail: str = ""
    output_ids: list[int] | None = None
    top_ids: list[int] | None = None  # first output token's top-5 ids (probes)
    chunks_hit: int = 0
    prompt_tokens: int = 0
    prefills: int = 0  # meta_info.relaxkv.prefills: > 1 for a request retracted and prefilled again
    repaired: bool = False


class Workload:
    """The shared documents, the probe's private documents, and request ``i``."""

    def __init__(self, size: SoakSize):
        self.size = size
        paragraphs = list(essay_paragraphs())
        random.Random(size.seed).shuffle(paragraphs)
        if len(paragraphs) < size.shared_documents + 3:
            raise ValueError(f"only {len(paragraphs)} essay paragraphs; asked for {size.shared_documents} + 3")
        self.shared = paragraphs[: size.shared_documents]
        # Used by the probes only, so their chunk hits are exact copies (see PROBES).
        private = paragraphs[size.shared_documents: size.shared_documents + 3]
        self.probe_prompt = marked_prompt(SYSTEM_PROMPTS[0], private,
                                          "Question: what do these passages have in common?\nAnswer:")

    def _draw(self, rng: random.Random, k: int) -> list[str]:
        """k distinct documents, Zipf-popular (weight 1/rank), in random order.

        As in RAG traffic a few documents are hot: they stay in the chunk tree
        and hit, while the long tail keeps evicting.
        """
        keys = [rng.random() ** (rank + 1) for rank in range(len(self.shared))]  # u^(1/w), w = 1/(rank+1)
        chosen = sorted(range(len(self.shared)), key=keys.__getitem__, reverse=True)[:k]
        rng.shuffle(chosen)
        return [self.shared[j] for j in chosen]

    def probe_job(self, index: int, probe: Probe) -> Job:
        return Job(index, "probe", self.probe_prompt, probe.policy, probe.max_new_tokens, probe.anchor_ratio,
                   probe.context_ratio, probe=probe)

    def job(self, i: int) -> Job:
        size = self.size
        rng = random.Random(size.seed * 1_000_003 + i)
        if i % size.probe_every == size.probe_every // 2:
            return self.probe_job(i, PROBES[(i // size.probe_every) % len(PROBES)])
        docs = self._draw(rng, rng.randint(3, 6))
        # Mostly the fixed system prompts (their KV is shared through the radix cache), sometimes a fresh one.
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.8 else f"Request {i}. Answer from the documents."
        prompt = marked_prompt(system, docs, f"Question {i}: which document mentions money?\nAnswer:")
        policy = rng.choice(SERVER_POLICIES)
        anchor = rng.choice([0.0, 1.0, round(rng.uniform(0.01, 0.5), 3), round(rng.uniform(0.01, 0.5), 3)])
        context = rng.choice([0.0, 1.0, round(rng.uniform(0.05, 1.0), 3), round(rng.uniform(0.05, 1.0), 3)])
        job = Job(i, "normal", prompt, policy, size.max_new_tokens, anchor, context, stream=rng.random() < 0.3,
                  ignore_eos=size.ignore_eos)
        roll = rng.random()
        if roll < size.abort_share:
            job.kind, job.stream, job.max_new_tokens = "abort", True, size.abort_new_tokens
            job.abort_after = "first" if rng.random() < 0.5 else round(rng.uniform(0.0, 0.3), 3)
        elif roll < size.abort_share + size.invalid_share:
            job.kind, job.invalid = "invalid", rng.choice(INVALID)
        return job


# ------------------------------------------------------------------ one request


def run_job(url: str, job: Job, timeout_s: float) -> Outcome:
    """Send one job and classify what came back; never raises for a server-side problem."""
    start = time.perf_counter()
    with requests.Session() as session:  # its own connection: closing it is what a leaving client does
        try:
            if job.kind == "abort":
                outcome = _abort(session, url, job, timeout_s)
            elif job.stream:
                outcome = _check(job, _streamed(session, url, job, timeout_s))
            else:
                outcome = _check(job, _plain(session, url, job, timeout_s))
        except requests.Timeout as exc:
            outcome = Outcome(job, 0.0, "timeout", str(exc)[:200])
        except requests.ConnectionError as exc:
            outcome = Outcome(job, 0.0, "connection", str(exc)[:200])
        except (requests.RequestException, ValueError) as exc:  # a broken stream, an unparsable event
            outcome = Outcome(job, 0.0, "broken_response", f"{type(exc).__name__}: {str(exc)[:200]}")
    outcome.latency_s = time.perf_counter() - start
    return outcome


def _plain(session, url: str, job: Job, timeout_s: float) -> tuple[int, dict | str]:
    response = session.post(url + "/generate", json=job.body(), timeout=timeout_s)
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text[:300]


def _streamed(session, url: str, job: Job, timeout_s: float) -> tuple[int, dict | str]:
    """The last event of a stream (SGLang's events carry the whole output so far), or an error event."""
    with session.post(url + "/generate", json=job.body(), timeout=timeout_s, stream=True) as response:
        if response.status_code != 200:
            return response.status_code, response.text[:300]
        last = None
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            last = json.loads(line[len(b"data: "):])
            if "error" in last:
                return 200, last
    return 200, last if last is not None else "stream ended without an event"


def _abort(session, url: str, job: Job, timeout_s: float) -> Outcome:
    """Start a streamed request and leave: after its first event, or after a short delay."""
    with session.post(url + "/generate", json=job.body(), timeout=timeout_s, stream=True) as response:
        if response.status_code != 200:
            return Outcome(job, 0.0, f"http_{response.status_code}", response.text[:200])
        if job.abort_after == "first":
            for line in response.iter_lines():
                if line.startswith(b"data: "):
                    event = json.loads(line[len(b"data: "):])
                    if "error" in event:
                        return Outcome(job, 0.0, "stream_error", json.dumps(event)[:200])
                    break
        else:
            time.sleep(float(job.abort_after))
    return Outcome(job, 0.0)  # leaving the block closes the connection mid-stream


def _check(job: Job, result: tuple[int, dict | str]) -> Outcome:
    """Is this the expected answer for the job? Checks the values, not just the status."""
    status, body = result
    if job.kind == "invalid":
        error = body.get("error", {}) if isinstance(body, dict) else {}
        # Plain: HTTP 400. Streamed: HTTP 200 and the error as the first event, with code 400 (docs/api.md).
        rejected = status == 400 or (job.stream and status == 200 and error.get("code") == 400)
        if rejected and error.get("message", "").startswith(job.invalid[1]):
            return Outcome(job, 0.0)
        return Outcome(job, 0.0, "invalid_not_rejected", f"HTTP {status}: {str(body)[:200]}")
    if status != 200:
        return Outcome(job, 0.0, f"http_{status}", str(body)[:200])
    if not isinstance(body, dict) or "error" in body:
        return Outcome(job, 0.0, "stream_error" if job.stream else "bad_body", str(body)[:200])
    output_ids = body.get("output_ids") or []
    record = body.get("meta_info", {}).get("relaxkv")
    problem = _record_problem(job, record, output_ids)
    if problem:
        return Outcome(job, 0.0, "bad_record", problem)
    top = body["meta_info"].get("output_top_logprobs") or [[]]
    return Outcome(job, 0.0, output_ids=list(output_ids), top_ids=[t[1] for t in top[0]],
                   chunks_hit=record["chunks_hit"], prompt_tokens=body["meta_info"].get("prompt_tokens", 0),
                   prefills=record["prefills"], repaired=record["repaired"])


def _record_problem(job: Job, record: dict | None, output_ids: list[int]) -> str | None:
    n_chunks = len(job.prompt.offsets) // 2
    if not 1 <= len(output_ids) <= job.max_new_tokens:
        return f"{len(output_ids)} output tokens for max_new_tokens {job.max_new_tokens}"
    if record is None:
        return "no meta_info.relaxkv on a request with chunks"
    if record["policy"] != job.policy:
        return f"ran under {record['policy']!r}, asked {job.policy!r}"
    if not 0 <= record["chunks_hit"] <= record["chunks_seen"]:
        return f"chunks_hit {record['chunks_hit']} outside 0..chunks_seen {record['chunks_seen']}"
    if job.policy in CHUNK_POLICIES and record["chunks_seen"] < n_chunks:
        return f"{record['chunks_seen']} chunks looked up of {n_chunks}"
    if job.policy not in CHUNK_POLICIES and record["chunks_seen"] != 0:
        return f"{job.policy} looked up {record['chunks_seen']} chunks"
    if job.policy not in REPAIR_POLICIES and record["repaired"]:
        return f"{job.policy} reports a repair"
    if record["prefills"] < 1:
        return f"prefills {record['prefills']}: the prompt's last token was never prefilled"
    # A repair policy is repaired whether its prompt was split across prefill windows or
    # retracted and prefilled again (then once per prefill).
    if job.policy in REPAIR_POLICIES and not (record["repaired"] and record["repairs"] == record["prefills"]):
        return (f"{job.policy}: repaired {record['repaired']}, repairs {record['repairs']} of "
                f"{record['prefills']} prefills ({record.get('not_repaired_reason')})")
    return None


# ---------------------------------------------------------------- the server


def _metric(url: str, name: str) -> float | None:
    """Sum of a Prometheus metric's samples over its labels; None without ``--enable-metrics``.

    A labelled counter appears only once incremented, so an absent one is 0.
    """
    try:
        response = requests.get(url + "/metrics", timeout=30)
    except requests.RequestException:
        return None
    if response.status_code != 200:
        return None
    total = 0.0
    for line in response.text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def server_config(model_path: str, size: SoakSize) -> ServerConfig:
    """The soak's server: small pool, strict memory check, metrics (for the abort and
    retraction counters).

    Chunked prefill is a fraction of the pool, so prompts are split across prefill
    windows, at boundaries that depend on how requests happened to be batched; the
    answers must not (see :data:`PROBES`).
    """
    extra = ["--context-length", "2048", "--enable-metrics", "--chunked-prefill-size", str(size.chunked_prefill_tokens)]
    if size.schedule_conservativeness is not None:
        extra += ["--schedule-conservativeness", str(size.schedule_conservativeness)]
    env = dict(STRICT_MEMORY_CHECK)
    if size.retract_every is not None:
        env.update(SGLANG_TEST_RETRACT="1", SGLANG_TEST_RETRACT_INTERVAL=str(size.retract_every))
    return ServerConfig(model_path=model_path, max_total_tokens=size.pool_tokens, policy="pic",
                        env=env, extra_args=extra, startup_timeout_s=SERVER_START_TIMEOUT_S)


def working_set_tokens(model_path: str, workload: Workload) -> int:
    """Tokens of the shared documents alone (each document is tokenized on its own, as the server does)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return sum(len(tokenizer.encode(d, add_special_tokens=False)) for d in workload.shared)


# ------------------------------------------------------------------- the run


@dataclasses.dataclass
class SoakResult:
    """The figures of a soak run; :meth:`problems` lists the failed checks."""

    figures: dict
    outcomes: list[Outcome]

    def problems(self) -> list[str]:
        f, out = self.figures, []
        if f["errors"]:
            out.append(f"unexpected outcomes: {f['errors']} (first: {f['first_errors']})")
        if f["max_latency_s"] is not None and f["max_latency_s"] > f["request_timeout_s"]:
            out.append(f"a request took {f['max_latency_s']:.1f} s, over the {f['request_timeout_s']} s bound")
        if f["slots_leaked"] != 0 or f["chunk_tokens_held_after_flush"] != 0:
            out.append(f"after /flush_cache: {f['slots_leaked']} KV slots not free, "
                       f"{f['chunk_tokens_held_after_flush']} chunk tokens held")
        if not f["server_alive"]:
            out.append("the server is not alive after the run")
        if f["final_probe_mismatches"]:
            out.append(f"{f['final_probe_mismatches']} probes answered differently on the idle server after the run")
        if f["chunk_locked_tokens_after_flush"] != 0:
            out.append(f"{f['chunk_locked_tokens_after_flush']} chunk tokens still locked after the run")
        if f.get("chunk_pins_dropped_at_flush"):
            out.append(f"{f['chunk_pins_dropped_at_flush']} requests' chunk pins leaked (dropped by the flush)")
        # Surely aborted: requests left after their first event (running, 256 tokens to go, EOS
        # ignored). One left after a short delay may have gone before SGLang dispatched it.
        observed = f["aborts_observed"]
        if observed is not None and not f["aborts_after_first_event"] <= observed <= f["aborts"]:
            out.append(f"the server aborted {observed} requests; clients left {f['aborts']}, "
                       f"{f['aborts_after_first_event']} of them after the first event")
        if f["seconds"] is None and f["requests"] < f["requests_planned"]:
            out.append(f"only {f['requests']} of {f['requests_planned']} requests ran")
        if f["split_prompts"] == 0:
            out.append(f"no prompt was longer than the chunked-prefill size {f['chunked_prefill_tokens']}")
        if f["expect_retractions"] and not 0 < f["reprefilled"] <= (f["retractions"] or 0):
            out.append(f"{f['retractions']} retractions, {f['reprefilled']} answered requests prefilled again")
        return out


def run_soak(size: SoakSize, *, model_path: str | None = None, url: str | None = None,
             log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> SoakResult:
    """Start a server (or use ``url``), run the load, check the end state."""
    model_path = model_path or str(assets.model_path("tiny-llama"))
    workload = Workload(size)
    server = None
    if url is None:
        server = SGLangServer(server_config(model_path, size))
        t0 = time.perf_counter()
        server.start()
        url = server.url
        log(f"soak: server ready in {time.perf_counter() - t0:.1f} s at {url} (log {server.log_path})")
    try:
        return _run(size, workload, url, server, model_path, log)
    finally:
        if server is not None:
            server.stop()


def _run(size: SoakSize, workload: Workload, url: str, server: SGLangServer | None, model_path: str, log) -> SoakResult:
    client = ServerClient(url, timeout=size.request_timeout_s)
    client.flush()
    # Reference answers: each probe once, on the idle server with an empty cache.
    references = {}
    for probe in PROBES:
        ref = run_job(url, workload.probe_job(-1, probe), size.request_timeout_s)
        if ref.error:
            raise RuntimeError(f"probe {probe.name} failed on the idle server: {ref.error} {ref.detail}")
        references[probe.name] = (ref.output_ids, ref.top_ids)
    before = client.relaxkv_state()
    aborted_before = _metric(url, "sglang:num_aborted_requests_total")
    retracted_before = _metric(url, "sglang:num_retracted_requests_total")

    outcomes: list[Outcome] = []
    lock = threading.Lock()
    counter = itertools.count()
    start = time.perf_counter()
    deadline = start + size.seconds if size.seconds else None

    def client_loop() -> None:
        while True:
            with lock:
                i = next(counter)
            if (size.requests is not None and i >= size.requests) or (deadline and time.perf_counter() > deadline):
                return
            outcome = run_job(url, workload.job(i), size.request_timeout_s)
            with lock:
                outcomes.append(outcome)
                done = len(outcomes)
            if done % 100 == 0:
                log(f"soak: {done} requests, {time.perf_counter() - start:.0f} s")

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(size.clients)]
    for t in threads:
        t.start()
    # A loose bound (every request of a thread taking its whole timeout): past it a client is hung.
    per_thread = -(-size.requests // size.clients) if size.requests is not None else 1
    join_until = (deadline or start) + size.request_timeout_s * per_thread + 60
    for t in threads:
        t.join(timeout=max(0.0, join_until - time.perf_counter()))
    duration = time.perf_counter() - start
    hung_threads = sum(t.is_alive() for t in threads)

    for o in outcomes:  # probes: the same answer as on the idle server
        if o.job.kind == "probe" and o.error is None and (o.output_ids, o.top_ids) != references[o.job.probe.name]:
            o.error = "probe_mismatch"
            o.detail = f"{o.job.probe.name}: {o.output_ids} {o.top_ids} != {references[o.job.probe.name]}"

    loaded = client.relaxkv_state()
    aborted_after = _metric(url, "sglang:num_aborted_requests_total")
    retracted_after = _metric(url, "sglang:num_retracted_requests_total")
    client.flush(wait_s=120)  # waits for requests still running (aborted ones included)
    flushed = client.relaxkv_state()
    final_mismatches = 0
    for probe in PROBES:
        again = run_job(url, workload.probe_job(-1, probe), size.request_timeout_s)
        final_mismatches += again.error is not None or (again.output_ids, again.top_ids) != references[probe.name]
    alive = (server is None or server.proc.poll() is None) and _healthy(url)

    errors = Counter(o.error for o in outcomes if o.error)
    if hung_threads:
        errors["client_thread_hung"] += hung_threads
    completed = [o.latency_s for o in outcomes if o.error is None and o.job.kind in ("normal", "probe")]
    lat = latency_summary(completed)
    kinds = Counter(o.job.kind for o in outcomes)
    figures = {
        "requests": len(outcomes),
        "requests_planned": size.requests if size.requests is not None else len(outcomes),
        "clients": size.clients,
        "seconds": size.seconds,
        "duration_s": round(duration, 1),
        "requests_per_s": round(len(outcomes) / duration, 2) if duration else None,
        "completed": len(completed),
        "aborts": kinds["abort"],
        "aborts_after_first_event": sum(o.job.abort_after == "first" for o in outcomes),
        "aborts_observed": None if aborted_after is None else int(aborted_after - (aborted_before or 0)),
        "invalid": kinds["invalid"],
        "probes": kinds["probe"],
        "probe_mismatches": errors.get("probe_mismatch", 0),
        "policies": dict(Counter(o.job.policy for o in outcomes if o.job.kind == "normal")),
        "errors": dict(errors),
        "first_errors": [f"#{o.job.index} {o.job.kind}/{o.job.policy}: {o.error} {o.detail}"
                         for o in outcomes if o.error][:3],
        "latency_p50_s": _round(lat["p50"]),
        "latency_p99_s": _round(lat["p99"]),
        "max_latency_s": _round(max((o.latency_s for o in outcomes), default=None)),
        "request_timeout_s": size.request_timeout_s,
        "chunk_hits": sum(o.chunks_hit for o in outcomes),
        "chunk_lookups": loaded["chunk_lookups"] - before["chunk_lookups"],
        "chunk_evictions": loaded["chunk_evictions"] - before["chunk_evictions"],
        "retractions": None if retracted_after is None else int(retracted_after - (retracted_before or 0)),
        "expect_retractions": size.expect_retractions,
        # Answered requests prefilled again after a retraction (their reports were checked:
        # a repair policy's repaired once per prefill), and those under a repair policy.
        "reprefilled": sum(o.prefills > 1 for o in outcomes if o.error is None),
        "reprefilled_repaired": sum(o.prefills > 1 and o.repaired for o in outcomes if o.error is None),
        "chunked_prefill_tokens": size.chunked_prefill_tokens,
        # Answered prompts longer than one prefill window (split for sure; shorter ones may be
        # too, when they share a prefill batch), and those repaired.
        "split_prompts": sum(o.prompt_tokens > size.chunked_prefill_tokens for o in outcomes if o.error is None),
        "split_prompts_repaired": sum(o.prompt_tokens > size.chunked_prefill_tokens and o.repaired
                                      for o in outcomes if o.error is None),
        "pool_tokens": flushed["kv_total_tokens"],
        "working_set_tokens": working_set_tokens(model_path, workload),
        "slots_leaked": flushed["kv_total_tokens"] - flushed["kv_available_tokens"],
        "chunk_tokens_held_after_flush": flushed["chunk_tokens_held"],
        "chunk_locked_tokens_after_flush": flushed["chunk_locked_tokens"],
        # admission pins a flush had to drop: SGLang flushes only an idle server, so any is a leak
        "chunk_pins_dropped_at_flush": flushed.get("chunk_pins_dropped_at_reset", 0),
        "final_probe_mismatches": final_mismatches,
        "server_alive": alive,
    }
    return SoakResult(figures, outcomes)


def _healthy(url: str) -> bool:
    try:
        return requests.get(url + "/health_generate", timeout=60).status_code == 200
    except requests.RequestException:
        return False


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def summary(result: SoakResult) -> str:
    """One screen: the figures, then the verdict."""
    f = result.figures
    lines = [
        f"soak: {f['requests']} requests, {f['clients']} clients, {f['duration_s']} s ({f['requests_per_s']} req/s)",
        f"  completed {f['completed']} · aborted by client {f['aborts']} (server aborted {f['aborts_observed']}) · "
        f"invalid {f['invalid']} · probes {f['probes']} (mismatches {f['probe_mismatches']})",
        f"  latency p50 {f['latency_p50_s']} s · p99 {f['latency_p99_s']} s · max {f['max_latency_s']} s "
        f"(bound {f['request_timeout_s']} s)",
        f"  KV pool {f['pool_tokens']} tokens · shared documents {f['working_set_tokens']} tokens · "
        f"chunk hits {f['chunk_hits']} of {f['chunk_lookups']} lookups · evictions {f['chunk_evictions']} · "
        f"retractions {f['retractions']} (answered requests prefilled again {f['reprefilled']}, "
        f"repaired {f['reprefilled_repaired']})",
        f"  prompts over the chunked-prefill size {f['chunked_prefill_tokens']}: {f['split_prompts']} "
        f"(repaired {f['split_prompts_repaired']})",
        f"  errors {f['errors'] or 'none'} · slots leaked {f['slots_leaked']} · server alive {f['server_alive']}",
        f"  policies {f['policies']}",
    ]
    problems = result.problems()
    lines += [f"  FAILED: {p}" for p in problems] if problems else ["  all checks passed"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e.soak", description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true", help=f"{QUICK.requests} requests, {QUICK.clients} clients (default)")
    which.add_argument("--long", action="store_true", help=f"{LONG.seconds:.0f} s of {LONG.clients} clients")
    which.add_argument("--retract", action="store_true",
                       help=f"{RETRACT.requests} requests on a {RETRACT.pool_tokens}-token pool that force retractions")
    parser.add_argument("--requests", type=int, help="requests to send (with --seconds: whichever ends first)")
    parser.add_argument("--clients", type=int, help="concurrent client threads")
    parser.add_argument("--seconds", type=float, help="stop sending new requests after this long")
    parser.add_argument("--pool-tokens", type=int, help="the started server's KV pool (--max-total-tokens)")
    parser.add_argument("--seed", type=int, help="workload seed")
    parser.add_argument("--url", help="use this running relaxkv server instead of starting one (it needs --enable-metrics, "
                        "see server_config)")
    parser.add_argument("--model", help="model folder (default: the tiny test model)")
    args = parser.parse_args(argv)
    size = LONG if args.long else RETRACT if args.retract else QUICK
    changes = {k: v for k, v in (("requests", args.requests), ("clients", args.clients), ("seconds", args.seconds),
                                 ("pool_tokens", args.pool_tokens), ("seed", args.seed)) if v is not None}
    if args.seconds is not None and args.requests is None:
        changes["requests"] = None  # --seconds alone: as many requests as fit
    size = dataclasses.replace(size, **changes)
    result = run_soak(size, model_path=args.model, url=args.url)
    print(summary(result))
    print(json.dumps(result.figures, sort_keys=True))
    return 1 if result.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
