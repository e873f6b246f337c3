"""Quality, fidelity and TTFT of every reuse policy on four tasks, in several prompt formats, across anchor ratios.

Tasks (``benchmarks.quality_tasks``, 10 documents as chunks, ~1.5K tokens each):
HotpotQA dev (its 10 paragraphs), multi-document SQuAD (the gold paragraph
among 9 from other articles), and RULER-style multi-value needle and variable
tracking in essay text (seeded). Every example is asked in every prompt format
of ``--formats`` (:data:`benchmarks.prompt_formats.PROMPT_FORMATS`; the documents are the chunks, and
whatever depends on a document's position, such as its number, is glue outside them):

* ``plain``: ``Title: text`` documents between blank lines, the question block last;
* ``document``: each document a ``Document: <title>`` line then its text, single newlines;
* ``chat``: the ChatML template (SmolLM2-Instruct's and Qwen2.5's own), documents and question in the user turn;
* ``langchain``: LangChain's RAG tutorial prompt in ChatML: its instruction and the documents as the
  system turn, the bare question as the user turn;
* ``llamaindex``: LlamaIndex's default text-QA completion prompt, each document a node opening with its
  ``file_path:`` metadata line (part of the chunk);
* ``tagged``: Anthropic-style ``<document index="n">`` tags around each document's ``<source>`` and
  ``<document_content>`` (those two inside the chunk), the question last;
* ``numbered``: the OpenAI-SDK shape in ChatML, a ``Documents:`` list of ``[n] document`` lines, then the question;
* ``question_first``: ``plain`` with the question stated once before the documents, the answer's lead-in after.

For each example and format the server is flushed,
the format's chunk texts are cached by a first request (other system prompt,
reversed order, a placeholder question), then the same prompt is answered by
``full`` and ``pic`` once and by every repair policy at every anchor ratio, in a
shuffled order. Fidelity to ``full`` prefill is the figure to steer by (a 135M
model's task scores barely separate the policies):

* task score: LongBench QA F1 of the answer's first line (HotpotQA, SQuAD) or
  RULER ``string_match_all``, the fraction of the expected values in the answer;
* F1 of the greedy answer against ``full``'s, and exact agreement with it;
* top-1 agreement: the first answer token is ``full``'s first answer token;
* KL(full || policy) of the first answer token, over ``full``'s top-K tokens
  (the policy's log-probabilities for the same token ids come back through
  ``token_ids_logprob``; the mass outside the top K is left out);
* TTFT: the time to the first streamed token of that same request, at the
  client. It costs no extra request; it includes the small overhead of
  returning log-probabilities, alike for every policy;
* the repair's cost from the plugin's report: achieved anchor ratio (CacheBlend
  repairs more than it is asked), visible and executed repair KV pairs.

``--kl-only`` answers with one token: first-token KL, top-1 agreement and TTFT
stay exact, the answers are cut, so task score, F1 and exact agreement are not
computed (``null`` in the JSON, ``-`` in the tables).

Splits (``--split``): tune on ``dev`` (HotpotQA dev examples 0-2999, synthetic
seeds 0-999; starts at example 0 and seed 0), report on ``test`` (examples
3000-3199, seeds 1000-1099; starts at 3000 and 1000). A run of ``n`` examples
from ``--offset o``/``--seed s`` uses examples ``o..o+n-1`` and counts as using
seeds ``s..s+n-1``; a run whose range leaves its split is refused.

Long context: ``--documents N`` puts N documents in each prompt instead of 10 (``squad``,
``niah_multivalue`` and ``variable_tracking``; HotpotQA examples have their own 10): 50 make
prompts of ~7K SmolLM2 tokens, near its 8K context.

A long run can be split into parts over disjoint examples (``--offset``/``--seed``) and the
parts' JSON files merged afterwards without a server: ``--merge a.json b.json --output all.json``
pools their per-example rows and recomputes every summary and paired comparison, as one run of
all the examples would (the parts must agree on model, split, formats, tasks, documents, policies,
anchor ratios, context ratio, ``--versus`` and ``--kl-only``; an example in two parts is refused).

Result JSON (beside the benchmark's name, machine and arguments):

* ``calibration``: the repair calibration the server ran with (``ServerClient.calibration``:
  ``file`` null for the code defaults; null from a stock server);
* ``split``: ``{"name", "offset", "seed"}`` actually used; ``formats``;
  ``versus``; ``kl_only``; ``tasks``: per task its example count, scorer, ids;
* ``per_example``: one row per (example, format, policy, anchor ratio) with
  ``task``, ``format``, ``example_id``, ``policy``, ``anchor_ratio`` (asked;
  null for ``full``/``pic``), the metrics above and the plugin's report
  ``relaxkv``;
* ``summary``: one cell per (``format``, ``task``, ``policy``, ``anchor_ratio``),
  ``task`` ``"all"`` pooling the tasks' examples and ``format`` ``"all"`` pooling
  the formats (with one format its cells equal the format's); means with 95%
  bootstrap intervals (``*_ci95``), ``ttft_median_s``, ``anchor_ratio_achieved``,
  ``context_ratio``, ``repair_kv_pairs`` and ``repair_kv_pairs_executed``;
* ``paired``: per (``format``, ``task``, ``anchor_ratio``) and policy, the
  per-example difference of first-token KL, policy minus ``versus`` (both at
  that ratio; ``pic`` has none): ``diff`` and ``diff_ci95`` (the mean difference
  and its paired bootstrap interval, examples resampled; with formats pooled an
  example's difference is its mean over the formats), ``wins``/``ties``/
  ``losses`` over (example, format) pairs (a win: the policy's KL is lower by
  more than 1e-6), ``kl``/``kl_versus`` and both achieved anchor ratios;
* ``equal_ttft``: per format (tasks pooled) and policy point, ``versus``'s KL at the same median
  TTFT (:func:`equal_ttft`): linear between ``versus``'s two points that bracket it, or
  ``versus``'s nearest end point with ``where`` saying the point is cheaper or dearer than all of
  them; ``below`` says whether the policy's KL is lower; ``gap`` (the policy's KL minus that) with
  ``gap_ci95``, its bootstrap interval (examples resampled, every median and mean recomputed), and
  ``verdict``: ``below``/``above`` when the interval excludes 0, else ``level``.

A PNG next to the JSON plots first-token KL against median TTFT, one line per
repair policy across the anchor ratios (each point labelled with the ratio asked
and, where it differs, the ratio achieved: ``15%→20.7%``), ``pic`` and ``full``
as single points: formats and tasks pooled, then each format, then each task.

    python -m benchmarks.bench_quality --quick                       # 3 examples per task, 15% anchors, plain
    python -m benchmarks.bench_quality                               # 10 per task x 5/15/30% anchors, dev split
    python -m benchmarks.bench_quality --formats plain document chat --kl-only --examples 20
    python -m benchmarks.bench_quality --split test --formats plain document chat --examples 20 --versus prophetkv
    python -m benchmarks.bench_quality --formats langchain llamaindex tagged numbered question_first --kl-only
    python -m benchmarks.bench_quality --tasks hotpotqa --examples 40 --anchor-ratios 0.15
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import sys
from typing import Callable, Iterable, Optional, Sequence

from tqdm import tqdm

from benchmarks import common, metrics, prompt_formats, quality_tasks, tables
from benchmarks.quality_stats import ALL, ANSWER_METRICS, equal_ttft, paired_all, summarize_all
from relaxkv_sglang.client import ServerClient
from relaxkv_sglang.repair.policies import Policy, served_policies
from relaxkv_sglang.request.schema import CONTEXT_RATIO

BENCH = "bench_quality"
TASKS = quality_tasks.QUALITY_TASKS
FORMATS = prompt_formats.PROMPT_FORMATS
# Every served policy but prefix: SGLang's radix cache computes what full computes.
POLICIES = tuple(p for p in served_policies() if p != Policy.PREFIX)
BASELINES = tuple(p for p in POLICIES if not Policy(p).repairs)  # no anchor ratio: answered once per example
WARM_SYSTEM = prompt_formats.SYSTEM_PROMPTS[1]
TOP_K = 20
QUICK_EXAMPLES = 3  # per task: the whole quick run stays under 5 minutes on 2 cores with SmolLM2
HEADLINE_RATIO = 0.15  # the ratio of the generated quality table (docs/performance.md) and the README's headline

SPLITS = quality_tasks.QUALITY_SPLITS


def split_origin(split: str, tasks: Iterable[str], examples: int, offset: int | None = None,
                 seed: int | None = None) -> tuple[int, int]:
    """``(offset, seed)`` of a run of ``examples`` per task on ``split`` (the split's, unless given).

    Raises ``ValueError`` (one line) when the run would use HotpotQA examples or seeds outside the
    split: examples ``offset..offset+examples-1`` for HotpotQA, seeds ``seed..seed+examples-1`` for
    the seeded tasks (each checked only if such a task is run).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    rule = SPLITS[split]
    offset = rule["offset"] if offset is None else offset
    seed = rule["seed"] if seed is None else seed
    tasks = set(tasks)
    checks = []
    if "hotpotqa" in tasks:
        checks.append(("HotpotQA dev examples", "--offset", offset, rule["hotpotqa"]))
    if tasks - {"hotpotqa"}:
        checks.append(("synthetic seeds", "--seed", seed, rule["seeds"]))
    for what, flag, first, (lo, end) in checks:
        if not (lo <= first and first + examples <= end):
            raise ValueError(f"--split {split} allows {what} {lo}-{end - 1}; this run would use "
                             f"{first}-{first + examples - 1} ({flag} {first}, --examples {examples})")
    return offset, seed


def first_token_kl(full: dict, other: dict) -> float:
    """KL(full || other) over full's top-K first tokens (renormalised on that support)."""
    full_top = {tok: lp for lp, tok, *_ in full["meta_info"]["output_top_logprobs"][0]}
    other_lp = {tok: lp for lp, tok, *_ in other["meta_info"]["output_token_ids_logprobs"][0]}
    p_mass = sum(math.exp(lp) for lp in full_top.values())
    q_mass = sum(math.exp(other_lp[t]) for t in full_top)
    kl = 0.0
    for tok, lp in full_top.items():
        p = math.exp(lp) / p_mass
        kl += p * (math.log(p) - (other_lp[tok] - math.log(q_mass)))
    return max(kl, 0.0)


def first_token_id(out: dict) -> int | None:
    """The id of the first generated token (from ``output_token_logprobs``), None if not returned."""
    tokens = out["meta_info"].get("output_token_logprobs") or []
    return tokens[0][1] if tokens else None


def first_line(text: str) -> str:
    """The short answer the QA prompts ask for: the continuation up to its first line break."""
    return text.strip().split("\n", 1)[0]


def task_score(example: quality_tasks.TaskExample, answer: str) -> float:
    """The example's task score: QA F1 on the answer's first line, RULER string match on all of it."""
    return metrics.score(example.scorer, first_line(answer) if example.scorer == "qa_f1" else answer, example.answers)


AUTO_PREFIX = "auto:"  # a config's "ratio" AUTO_PREFIX + quality: relaxkv_budget auto at that quality


def budget_fields(ratio: float | str | None) -> dict:
    """The request fields of a config's ratio: an anchor ratio, or ``auto:<quality>`` (an auto budget)."""
    if isinstance(ratio, str) and ratio.startswith(AUTO_PREFIX):
        return {"budget": "auto", "quality": ratio.removeprefix(AUTO_PREFIX)}
    return {"anchor_ratio": ratio}


def configs(policies: list[str], ratios: list[float | str]) -> list[tuple[str, float | str | None]]:
    """(policy, anchor ratio) pairs one example is answered under; baselines once, with ratio None."""
    return ([(p, None) for p in policies if p in BASELINES]
            + [(p, r) for r in ratios for p in policies if p not in BASELINES])


def result_row(example: quality_tasks.TaskExample, fmt: str, policy: str, ratio: float | None, out: dict,
               full: dict, kl_only: bool) -> dict:
    """One per-example row: the answer of ``policy`` at ``ratio`` in ``fmt``, scored against ``full``'s."""
    row = {"task": example.task, "format": fmt, "example_id": example.example_id, "policy": policy,
           "anchor_ratio": ratio, "answer": out["text"]}
    if kl_only:  # one token: no answer to score
        row.update(dict.fromkeys(ANSWER_METRICS))
    else:
        row.update(score=task_score(example, out["text"]),
                   f1_to_full=metrics.fidelity_f1(out["text"], full["text"]),
                   exact_to_full=metrics.exact_agreement(out["text"], full["text"]))
    top1, full_top1 = first_token_id(out), first_token_id(full)
    row.update(
        top1_to_full=None if top1 is None or full_top1 is None else float(top1 == full_top1),
        kl_first_token=0.0 if policy == "full" else first_token_kl(full, out),
        ttft_s=out["ttft_s"], latency_s=out["latency_s"],
        prompt_tokens=out["meta_info"]["prompt_tokens"], cached_tokens=out["meta_info"]["cached_tokens"],
        relaxkv=common.relaxkv_report(out))
    return row


def answer_example(client: ServerClient, example: quality_tasks.TaskExample, fmt: str,
                   cfgs: list[tuple[str, float | None]], args: argparse.Namespace, rng: random.Random) -> list[dict]:
    """One example in one format under every config: ``full`` first (its top tokens are the KL support),
    the rest shuffled; the format's chunk texts are cached first."""
    client.flush()
    common.warm_chunks(client, example.chunk_documents(fmt), WARM_SYSTEM)
    text, offsets = example.marked(fmt)
    max_new = 1 if args.kl_only else (args.max_new_tokens or example.max_new_tokens)
    full = client.generate_stream(text, offsets, "full", max_new_tokens=max_new, top_logprobs=TOP_K)
    top_ids = [tok for _, tok, *_ in full["meta_info"]["output_top_logprobs"][0]]
    order = [c for c in cfgs if c[0] != "full"]
    rng.shuffle(order)  # drift on a shared machine then hits every policy alike
    outs = {("full", None): full}
    for policy, ratio in order:
        outs[(policy, ratio)] = client.generate_stream(
            text, offsets, policy, max_new_tokens=max_new, **budget_fields(ratio),
            context_ratio=args.context_ratio if ratio is not None else None, token_ids_logprob=top_ids)
    return [result_row(example, fmt, policy, ratio, outs[(policy, ratio)], full, args.kl_only)
            for policy, ratio in cfgs]


def answer_all(args: argparse.Namespace, policies: Sequence[str], bench: str = BENCH,
               cfgs: Optional[list[tuple[str, float | str | None]]] = None,
               check_calibration: Optional[Callable[[Optional[dict]], None]] = None,
               ) -> tuple[list[dict], dict, dict, Optional[dict]]:
    """Every example of every task in every format under every config (``cfgs``, else every policy of
    ``policies`` at every ``args.anchor_ratios``) against one server: (per-example rows, tasks,
    split, the server's calibration). ``args.context_ratio`` is the server's when not given;
    ``check_calibration`` sees the server's calibration before any example is sent (it raises
    ``RuntimeError`` to stop the run)."""
    try:
        examples = {t: quality_tasks.task_examples(t, args.examples, seed=args.seed, offset=args.offset,
                                               documents=args.documents)
                    for t in args.tasks}
    except ValueError as exc:
        raise RuntimeError(str(exc)) from exc
    cfgs = cfgs if cfgs is not None else configs(policies, args.anchor_ratios)
    rng = random.Random(args.seed)
    rows: list[dict] = []
    with common.bench_client(args, bench) as client:
        calibration = client.calibration()  # the server's repair knobs; its context ratio unless given
        print(f"{bench}: {common.calibration_line(calibration)}", file=sys.stderr, flush=True)
        if check_calibration is not None:
            check_calibration(calibration)
        if args.context_ratio is None:
            args.context_ratio = (calibration or {}).get("knobs", {}).get("context_ratio", CONTEXT_RATIO.default)
        for task, exs in examples.items():
            for example in tqdm(exs, desc=f"{bench} {task}", unit="example"):
                for fmt in args.formats:
                    rows += answer_example(client, example, fmt, cfgs, args, rng)
    tasks = {t: {"examples": len(exs), "scorer": exs[0].scorer, "example_ids": [e.example_id for e in exs]}
             for t, exs in examples.items()}
    split = {"name": args.split, "offset": args.offset, "seed": args.seed}
    return rows, tasks, split, calibration


def run(args: argparse.Namespace) -> dict:
    """Every example of every task in every format under every config against one server."""
    rows, tasks, split, calibration = answer_all(args, args.policies)
    return {**result_of(rows, split, tasks, args), "calibration": calibration}


def result_of(rows: list[dict], split: dict, tasks: dict, args: argparse.Namespace) -> dict:
    """The result JSON's body (module doc) from the per-example rows of a run (or merged parts)."""
    cfgs = configs(args.policies, args.anchor_ratios)
    summary = summarize_all(rows, args.formats, args.tasks, cfgs)
    return {"split": split, "formats": list(args.formats), "versus": args.versus, "kl_only": args.kl_only,
            "tasks": tasks, "summary": summary,
            "paired": paired_all(rows, args.formats, args.tasks, cfgs, args.versus),
            "equal_ttft": equal_ttft(rows, [*args.formats, ALL] if len(args.formats) > 1 else args.formats,
                                     args.versus),
            "per_example": rows}


MERGE_AGREE = ("model", "split", "formats", "tasks", "documents", "policies", "anchor_ratios", "context_ratio",
               "versus", "kl_only")
MERGE_MISSING = {"documents": quality_tasks.DOCUMENTS_PER_PROMPT}  # what files written before a setting existed ran with


def _setting(part_args: dict, key: str):
    """A part's value of a :data:`MERGE_AGREE` setting (a file older than the setting: what it ran with)."""
    return part_args.get(key, MERGE_MISSING.get(key))


def merge(paths: list[str], args: argparse.Namespace) -> dict:
    """Pool the per-example rows of several result files (parts of one run, module doc).

    ``args`` takes the parts' settings (what the report prints and the merged file records).
    Raises ``RuntimeError`` (one line) when a part is unreadable, the parts disagree on a setting
    of :data:`MERGE_AGREE`, or an example appears in two parts.
    """
    parts = []
    for path in paths:
        try:
            with open(path) as f:
                parts.append(json.load(f))
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"--merge {path}: {exc}") from exc
        if parts[-1].get("bench") != BENCH or "per_example" not in parts[-1]:
            raise RuntimeError(f"--merge {path}: not a {BENCH} result file")
    first = parts[0]["args"]
    for path, part in zip(paths[1:], parts[1:]):
        if part.get("calibration") != parts[0].get("calibration"):
            raise RuntimeError(f"--merge {path}: the server's calibration differs from {paths[0]}'s")
        for key in MERGE_AGREE:
            if _setting(part["args"], key) != _setting(first, key):
                raise RuntimeError(f"--merge {path}: {key} {_setting(part['args'], key)!r} differs from "
                                   f"{paths[0]}'s {_setting(first, key)!r}")
    tasks: dict[str, dict] = {}
    for path, part in zip(paths, parts):
        for task, info in part["tasks"].items():
            merged = tasks.setdefault(task, {"examples": 0, "scorer": info["scorer"], "example_ids": []})
            repeated = set(merged["example_ids"]) & set(info["example_ids"])
            if repeated:
                raise RuntimeError(f"--merge {path}: {task} example {sorted(repeated)[0]} is in an earlier part")
            merged["examples"] += info["examples"]
            merged["example_ids"] += info["example_ids"]
    for key in MERGE_AGREE:
        setattr(args, key, _setting(first, key))
    rows = [row for part in parts for row in part["per_example"]]
    split = {**parts[0]["split"], "parts": [{**part["split"], "file": path} for path, part in zip(paths, parts)]}
    return {**result_of(rows, split, tasks, args), "calibration": parts[0].get("calibration")}


# ------------------------------------------------------------------- report


def headline_ratio(ratios: list[float]) -> float:
    """The swept ratio closest to 15% (the paper's and the README's operating point)."""
    return min(ratios, key=lambda r: abs(r - HEADLINE_RATIO))


def ratio_label(asked: float | None, achieved: float | None) -> str:
    """``"15%"``, or ``"15%→20.7%"`` when the policy achieved another anchor ratio than it was asked."""
    if asked is None:
        return "-"
    if achieved is None or round(achieved, 3) == round(asked, 3):
        return f"{asked:.0%}"
    return f"{asked:.0%}→{achieved:.1%}"


def blocks(formats: list[str], tasks: list[str]) -> list[tuple[str, str]]:
    """The (format, task) cells a report shows: each, then pooled ones that differ from a single one."""
    fmts = [*formats, ALL] if len(formats) > 1 else list(formats)
    tsks = [*tasks, ALL] if len(tasks) > 1 else list(tasks)
    return [(f, t) for f in fmts for t in tsks]


def print_table(result: dict, args: argparse.Namespace) -> None:
    """The summaries as plain-text tables, one per (format, task), then the paired comparisons."""
    split = result["split"]
    print(f"\nsplit {split['name']} (HotpotQA dev from {split['offset']}, synthetic seed {split['seed']}); "
          f"model {args.model}; relaxkv context ratio {args.context_ratio}; "
          f"{common.calibration_line(result.get('calibration'))}"
          + ("; --kl-only: one answer token, so score, F1 and exact are not measured (-)" if result["kl_only"]
             else ""))
    for fmt, task in blocks(result["formats"], list(result["tasks"])):
        info = result["tasks"].get(task)
        what = (f"{info['examples']} examples, score = {info['scorer']}" if info
                else "all tasks pooled, score = mean task score")
        print(f"\n{'all formats pooled' if fmt == ALL else 'format ' + fmt} / {task}: {what}")
        columns = [tables.left("policy", 16), tables.right("anchors", 8), tables.right("achieved", 9),
                   tables.right("score", 7), tables.right("F1→full", 16), tables.right("exact", 7),
                   tables.right("top-1", 7), tables.right("KL 1st tok", 18), tables.right("TTFT p50", 9),
                   tables.right("ctx", 6), tables.right("repair KV", 13), tables.right("executed", 13)]
        tables.print_text_table(columns, [
            [s["policy"], common.fmt(s["anchor_ratio"], ".0%"), common.fmt(s["anchor_ratio_achieved"], ".1%"),
             common.fmt(s["score"], ".3f"),
             "-" if s["f1_to_full"] is None else f"{s['f1_to_full']:.3f} {common.ci_text(s['f1_to_full_ci95'], '.2f')}",
             common.fmt(s["exact_to_full"], ".3f"), common.fmt(s["top1_to_full"], ".3f"),
             f"{s['kl_first_token']:.3f} {common.ci_text(s['kl_first_token_ci95'], '.2f')}", f"{s['ttft_median_s']:.2f}s",
             common.fmt(s["context_ratio"], ".2f"), common.fmt(s["repair_kv_pairs"], ",.0f"),
             common.fmt(s["repair_kv_pairs_executed"], ",.0f")]
            for s in result["summary"] if (s["format"], s["task"]) == (fmt, task)])
    print_paired(result)


def print_paired(result: dict) -> None:
    """The paired comparisons as one compact table."""
    versus = result["versus"]
    if not result["paired"]:
        print(f"\nno paired comparison: --versus {versus} was not among the policies run")
        return
    print(f"\npaired first-token KL, policy − {versus} per example (same ratio asked; lower is better): mean "
          f"difference, 95% bootstrap CI over examples, wins/ties/losses over (example, format) pairs")
    columns = [tables.left("format", 10), tables.left("task", 19), tables.left("policy", 16),
               tables.right("anchors", 14), tables.right("KL", 7), tables.right(versus[:9], 10), tables.right("diff", 8),
               tables.right("95% CI", 17), tables.right("W/T/L", 10), tables.right("n", 4)]
    shown = set(blocks(result["formats"], list(result["tasks"])))
    tables.print_text_table(columns, [
        [p["format"], p["task"], p["policy"], ratio_label(p["policy_anchor_ratio"], p["anchor_ratio_achieved"]),
         f"{p['kl']:.3f}", f"{p['kl_versus']:.3f}", f"{p['diff']:+.3f}", common.ci_text(p["diff_ci95"], "+.3f"),
         f"{p['wins']}/{p['ties']}/{p['losses']}", str(p["n_examples"])]
        for p in result["paired"] if (p["format"], p["task"]) in shown and p["n_examples"] > 0])
    refs = {p["anchor_ratio"]: p["anchor_ratio_achieved_versus"] for p in result["paired"]
            if (p["format"], p["task"]) == (ALL, ALL)}
    if any(v is not None for v in refs.values()):
        print(f"{versus} achieved anchors (all pooled): "
              + ", ".join(ratio_label(r, a) for r, a in sorted(refs.items())))
    print_equal_ttft(result)


def print_equal_ttft(result: dict) -> None:
    """Each policy point against ``versus``'s curve at equal measured TTFT (tasks pooled)."""
    rows = result.get("equal_ttft") or []
    if not rows:
        return
    versus = result["versus"]
    print(f"\nat equal measured TTFT (tasks pooled): {versus}'s KL on its KL-vs-TTFT curve at the policy's TTFT "
          f"(between two of its points, or its cheapest/dearest point when the policy's lies outside them); "
          f"gap = KL minus that, with its 95% interval (examples resampled)")
    columns = [tables.left("format", 10), tables.left("policy", 16), tables.right("anchors", 8),
               tables.right("TTFT p50", 10), tables.right("KL", 8), tables.right(versus[:12] + " KL", 16),
               tables.right("where", 9), tables.right("gap [95% CI]", 28), tables.right("verdict", 9)]
    tables.print_text_table(columns, [
        [r["format"], r["policy"], common.fmt(r["anchor_ratio"], ".0%"), f"{r['ttft_s']:.2f}s", f"{r['kl']:.3f}",
         f"{r['kl_versus_at_ttft']:.3f}", r["where"], f"{r['gap']:+.3f} {common.ci_text(r['gap_ci95'], '+.3f')}", r["verdict"]]
        for r in rows])


def plot(result: dict, path: pathlib.Path) -> None:
    """First-token KL against median TTFT: all pooled (top left), then each format, then each task."""
    plt = common.pyplot()
    formats, tasks, summary = result["formats"], list(result["tasks"]), result["summary"]
    pool = ALL if len(formats) > 1 else formats[0]
    panels = [(pool, ALL)]
    panels += [(f, ALL) for f in formats] if len(formats) > 1 else []
    panels += [(pool, t) for t in tasks] if len(tasks) > 1 else []
    cols = min(3, len(panels))
    n_rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(4.6 * cols, 3.8 * n_rows), squeeze=False)
    cells_of_axes = list(axes.flat)
    for ax, (fmt, task) in zip(cells_of_axes, panels):
        cells = [s for s in summary if (s["format"], s["task"]) == (fmt, task)]
        for baseline, marker in (("full", "s"), ("pic", "D")):
            for s in (s for s in cells if s["policy"] == baseline):
                ax.scatter([s["ttft_median_s"]], [s["kl_first_token"]], marker=marker, color="k", zorder=3,
                           label=baseline)
                ax.annotate(baseline, (s["ttft_median_s"], s["kl_first_token"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=8)
        for policy in dict.fromkeys(s["policy"] for s in cells if s["policy"] not in BASELINES):
            pts = sorted((s["anchor_ratio"], s["ttft_median_s"], s["kl_first_token"], s["anchor_ratio_achieved"])
                         for s in cells if s["policy"] == policy)
            line, = ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=policy)
            for ratio, x, y, achieved in pts:  # the budget it spent, not only the one it was asked for
                ax.annotate(ratio_label(ratio, achieved), (x, y), textcoords="offset points", xytext=(3, -9),
                            fontsize=7, color=line.get_color())
        what = task if task != ALL else "all tasks" if len(tasks) > 1 else tasks[0]
        ax.set_title(f"{'all formats' if fmt == ALL else 'format ' + fmt}, {what}", fontsize=10)
        ax.set_xlabel("TTFT median (s)")
        ax.set_ylabel("first-token KL to full (lower is better)")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
    handles, labels = cells_of_axes[0].get_legend_handles_labels()
    spare = cells_of_axes[len(panels):]
    for ax in spare:
        ax.axis("off")
    legend_title = "policy (point labels: anchor ratio\nasked→achieved)"
    if spare:  # an empty grid cell holds the legend
        spare[0].legend(handles, labels, loc="center", title=legend_title)
        fig.tight_layout()
    else:
        fig.tight_layout(rect=(0, 0, 0.80, 1))
        fig.legend(handles, labels, loc="center right", title=legend_title, fontsize=8, title_fontsize=8)
    common.save_plot(fig, path)


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.bench_quality``: parse the flags, measure, print, write the JSON and the plot."""
    parser = common.bench_parser(BENCH, __doc__,
                                 quick_help=f"{QUICK_EXAMPLES} examples per task, 15%% anchors only")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--formats", nargs="+", default=["plain"], choices=FORMATS,
                        help="prompt formats; every example is answered in each (default: plain): "
                             + ", ".join(FORMATS))
    parser.add_argument("--examples", type=int, default=10, help="examples per task")
    parser.add_argument("--documents", type=int, default=quality_tasks.DOCUMENTS_PER_PROMPT,
                        help="documents per prompt, ~150 SmolLM2 tokens each (50: ~7K tokens, the long-context "
                             "runs; squad, niah_multivalue and variable_tracking only)")
    parser.add_argument("--split", default="dev", choices=tuple(SPLITS),
                        help="dev: HotpotQA 0-2999, seeds 0-999 (tune here); test: HotpotQA 3000-3199, "
                             "seeds 1000-1099 (report here). Default dev")
    parser.add_argument("--offset", type=int, default=None, help="first HotpotQA dev example (default: the split's)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the SQuAD and RULER-style examples (default: the split's)")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--versus", default="prophetkv", choices=[p for p in POLICIES if p != "full"],
                        help="the policy every other one is compared with, example by example (default prophetkv)")
    parser.add_argument("--anchor-ratios", type=float, nargs="+", default=[0.05, 0.15, 0.30])
    parser.add_argument("--context-ratio", type=float, default=None,
                        help="relaxkv's context ratio (default: the server's, i.e. its calibration's for the "
                             f"model, else {CONTEXT_RATIO.default})")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="answer length (default: each task's own: 16 for QA, 40 needle, 32 variable tracking)")
    parser.add_argument("--kl-only", action="store_true",
                        help="answer with one token: first-token KL, top-1 agreement and TTFT only (no task scores)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                        help="no server: pool these result files (parts over disjoint examples) into one report")
    args = common.parse_args(parser, argv, quick={"examples": QUICK_EXAMPLES, "anchor_ratios": [HEADLINE_RATIO]})
    if args.merge:
        common.run_bench(BENCH, args, lambda a: merge(a.merge, a), report=lambda result: print_table(result, args),
                         plot=plot)
        return
    args.formats = list(dict.fromkeys(args.formats))
    try:
        args.offset, args.seed = split_origin(args.split, args.tasks, args.examples, args.offset, args.seed)
    except ValueError as exc:
        common.fail(BENCH, str(exc))
    if "full" not in args.policies:
        args.policies = ["full"] + args.policies
    common.run_bench(BENCH, args, run, report=lambda result: print_table(result, args), plot=plot)


if __name__ == "__main__":
    main()
