"""Ablate repair knobs on the torch reference: first-token KL to full prefill, paired, per format.

The tuning tool behind the defaults of ``repair/repair_config.py::RepairConfig`` (the server runs the
same planner and the prompt is split into the same parts, glue between chunks included, so a
knob's effect here is its effect there). No server: the model runs in
``repair/reference.py`` (float32, CPU), the stale KV and the query pass once per example, then one
repair pass per variant. Development data only (HotpotQA dev from ``--offset``, synthetic
``--seed``; see ``quality_tasks.QUALITY_SPLITS``); final figures come from ``bench_quality`` on the
test split.

A variant is ``NAME=POLICY[,knob=value...]`` with repair knobs by their flat names
(``repair_config.knob_defaults``: RepairConfig's shared knobs and the policies' options), e.g.::

    python scripts/ablate_repair.py --examples 3 --formats plain document chat \\
        --variant prophetkv=prophetkv \\
        --variant old=relaxkv,layer_value=uniform,own_chunk_in_budget=true,context_ratio=0.25 \\
        --variant new=relaxkv --versus prophetkv --output results/ablate.json

Prints, per format and pooled, each variant's mean KL (over the full vocabulary), top-1 agreement
with ``full``, mean attended KV pairs, and its paired difference to ``--versus`` (95% bootstrap CI
over the (example, format) pairs, which the pooled row resamples alike; wins/ties/losses).

Variants start from the model's repair calibration (``repair/calibration.py``: the repository's file
for the model, or ``--calibration FILE``; ``--calibration none``: the code defaults): a variant's
knobs override the calibrated ones. The calibration used is printed and written to the JSON.
``scripts/calibrate.py`` runs on the same cases (:func:`reference_cases`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time
from typing import Any, Iterator, Optional

import torch

from benchmarks import metrics, prompt_formats, quality_tasks
from relaxkv_sglang import assets
from relaxkv_sglang.repair.calibration import Calibration, CalibrationError, calibration_for_model
from relaxkv_sglang.repair.reference import StaleContext, from_hf_state_dict, reference_prefill, stale_context
from relaxkv_sglang.repair.repair_config import RepairConfig, knob_defaults


def parse_variant(text: str) -> tuple[str, str, dict]:
    """``NAME=POLICY[,knob=value...]`` -> (name, policy, RepairConfig overrides)."""
    name, _, spec = text.partition("=")
    policy, *knobs = spec.split(",")
    if not name or not policy:
        raise argparse.ArgumentTypeError(f"variant {text!r}: expected NAME=POLICY[,knob=value...]")
    defaults = knob_defaults()
    overrides = {}
    for knob in knobs:
        key, _, value = knob.partition("=")
        if key not in defaults:
            raise argparse.ArgumentTypeError(f"variant {name}: unknown knob {key!r}; the knobs are {', '.join(defaults)}")
        overrides[key] = parse_knob_value(defaults[key], value)
    return name, policy, overrides


def parse_knob_value(default, value: str):
    """``value`` parsed as the type of the knob's default (None defaults are optional floats)."""
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes")
    if default is None or isinstance(default, float):
        return None if value.lower() == "none" else float(value)
    return int(value) if isinstance(default, int) else value


def request_tokens(tokenizer, example: quality_tasks.TaskExample, fmt: str) -> tuple[torch.Tensor, list, int]:
    """(input_ids int64 [n], chunk token spans, query start), split as the server splits the request
    (``core.segments``): each part tokenized on its own, the glue between chunks a part of its own
    (computed with the request, never cached)."""
    text, offsets = example.marked(fmt)
    spans = prompt_formats.chunk_spans(offsets)
    ids = prompt_formats.token_ids(tokenizer, text[:spans[0][0]], special=True)
    token_spans, prev = [], spans[0][0]
    for start, end in spans:
        ids += prompt_formats.token_ids(tokenizer, text[prev:start]) if start > prev else []
        piece = prompt_formats.token_ids(tokenizer, text[start:end])
        token_spans.append((len(ids), len(ids) + len(piece)))
        ids += piece
        prev = end
    query_start = len(ids)
    ids += prompt_formats.token_ids(tokenizer, text[prev:])
    return torch.tensor(ids), token_spans, query_start


def kl_full_vocab(full: torch.Tensor, other: torch.Tensor) -> float:
    """KL(softmax(full) || softmax(other)) over the whole vocabulary (logits float [vocab])."""
    p, q = torch.log_softmax(full.double(), -1), torch.log_softmax(other.double(), -1)
    return float((p.exp() * (p - q)).sum())


@dataclasses.dataclass
class ReferenceCase:
    """One (example, format) on the torch reference: its tokens, full prefill's last logits and the
    stale state every repair variant starts from (computed once).

    Attributes:
        task, example_id, fmt: which example in which prompt format.
        ids: int64 [n] the prompt; spans: the chunks' token spans; query_start: the query's first token.
        full: float [vocab] full prefill's last logits; stale: the stale KV and the query pass over it.
    """

    task: str
    example_id: str
    fmt: str
    ids: torch.Tensor
    spans: list
    query_start: int
    full: torch.Tensor
    stale: StaleContext

    def repaired(self, weights: Any, policy: str, config: RepairConfig) -> Any:
        """The reference's result of ``policy`` with ``config`` on this case (``reference.Result``)."""
        return reference_prefill(weights, self.ids, self.spans, self.query_start, policy, config, stale=self.stale)


def load_reference(model: str) -> tuple[Any, Any, pathlib.Path]:
    """(reference weights, tokenizer, model folder) of ``model`` (a prepared model's name or a folder)."""
    from transformers import AutoModelForCausalLM

    path = assets.resolve_model(model)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return from_hf_state_dict(hf.state_dict(), hf.config.to_dict()), assets.load_tokenizer(path), path


def reference_cases(weights: Any, tokenizer: Any, tasks: list[str], formats: list[str], examples: int, *,
                    seed: int, offset: int) -> Iterator[ReferenceCase]:
    """Every (example, format) of ``tasks`` (``examples`` each, from ``offset``/``seed``), with its
    full logits and stale state."""
    for task in tasks:
        for example in quality_tasks.task_examples(task, examples, seed=seed, offset=offset):
            for fmt in formats:
                ids, spans, q0 = request_tokens(tokenizer, example, fmt)
                full = reference_prefill(weights, ids, spans, q0, "full").last_logits
                yield ReferenceCase(task, example.example_id, fmt, ids, spans, q0, full,
                                    stale_context(weights, ids, spans, q0))


def dev_split_error(offset: int, seed: int, examples: int) -> Optional[str]:
    """Why a run of ``examples`` from ``offset``/``seed`` leaves the development split, or None.
    Tuning tools run on the development split only (``quality_tasks.QUALITY_SPLITS``)."""
    dev = quality_tasks.QUALITY_SPLITS["dev"]
    if not (dev["hotpotqa"][0] <= offset and offset + examples <= dev["hotpotqa"][1]):
        return f"HotpotQA examples {offset}-{offset + examples - 1} leave the development split {dev['hotpotqa']}"
    if not (dev["seeds"][0] <= seed and seed + examples <= dev["seeds"][1]):
        return f"seeds {seed}-{seed + examples - 1} leave the development split {dev['seeds']}"
    return None


def model_calibration(model_dir: pathlib.Path, override: Optional[str]) -> Optional[Calibration]:
    """The calibration a tool starts from: ``override`` (a file, or ``none``), else the repository's
    for the model; SystemExit with one line for an unusable one."""
    try:
        return calibration_for_model(model_dir, override)
    except CalibrationError as exc:
        raise SystemExit(f"error: {exc}") from None


def add_case_arguments(parser: argparse.ArgumentParser, examples: int = 3) -> None:
    """The development cases' options the tuning tools share: tasks, formats, examples per task,
    the first HotpotQA example and synthetic seed."""
    parser.add_argument("--tasks", nargs="+", default=list(quality_tasks.QUALITY_TASKS), choices=quality_tasks.QUALITY_TASKS)
    parser.add_argument("--formats", nargs="+", default=["plain"], choices=prompt_formats.PROMPT_FORMATS)
    parser.add_argument("--examples", type=int, default=examples, help="examples per task")
    parser.add_argument("--offset", type=int, default=0, help="first HotpotQA dev example (dev split: < 3000)")
    parser.add_argument("--seed", type=int, default=0, help="synthetic tasks' first seed (dev split: < 1000)")


def run(args: argparse.Namespace) -> list[dict]:
    """One row per (example, format): every variant's KL, top-1 agreement and attended pairs."""
    weights, tokenizer, _ = load_reference(args.model)
    calibrated = args.calibration_used.knobs if args.calibration_used is not None else {}
    rows = []
    started = time.perf_counter()
    for case in reference_cases(weights, tokenizer, args.tasks, args.formats, args.examples, seed=args.seed,
                                offset=args.offset):
        pic = case.stale.pic_logits
        row = {"task": case.task, "example_id": case.example_id, "format": case.fmt, "tokens": int(case.ids.numel()),
               "variants": {"pic": {"kl": kl_full_vocab(case.full, pic), "pairs": 0,
                                    "top1": int(pic.argmax() == case.full.argmax())}}}
        for name, policy, overrides in args.variant:
            config = RepairConfig.from_knobs(**{**calibrated, "anchor_ratio": args.anchor_ratio, **overrides})
            res = case.repaired(weights, policy, config)
            row["variants"][name] = {"kl": kl_full_vocab(case.full, res.last_logits),
                                     "top1": int(res.last_logits.argmax() == case.full.argmax()),
                                     "pairs": res.report.repair_kv_pairs}
        rows.append(row)
        print(f"{case.task} {case.fmt} {case.example_id[:12]} {row['tokens']} tok "
              f"{time.perf_counter() - started:.0f}s " + " ".join(f"{n}={v['kl']:.3f}" for n, v in row["variants"].items()),
              file=sys.stderr, flush=True)
        started = time.perf_counter()
    return rows


def summarize(rows: list[dict], versus: str) -> list[dict]:
    """Per format and pooled ("all"): each variant's means and its paired difference to ``versus``."""
    out = []
    for fmt in [*dict.fromkeys(r["format"] for r in rows), "all"]:
        cell = [r for r in rows if fmt == "all" or r["format"] == fmt]
        for name in cell[0]["variants"]:
            kl = [r["variants"][name]["kl"] for r in cell]
            ref = [r["variants"][versus]["kl"] for r in cell]
            out.append({"format": fmt, "variant": name, "n": len(cell), **paired_kl(kl, ref),
                        "top1": statistics.mean(r["variants"][name]["top1"] for r in cell),
                        "pairs": statistics.mean(r["variants"][name]["pairs"] for r in cell)})
    return out


def paired_kl(kl: list[float], versus: list[float]) -> dict[str, Any]:
    """KL per case against ``versus``'s on the same cases: mean KL, paired mean difference, its 95%
    bootstrap interval (cases resampled), W/T/L."""
    return {"kl": statistics.mean(kl), "diff": statistics.mean(a - b for a, b in zip(kl, versus)),
            "diff_ci95": metrics.paired_bootstrap_ci(kl, versus), "wtl": metrics.win_counts(kl, versus)}


def main(argv: list[str] | None = None) -> None:
    """``python scripts/ablate_repair.py``: run the variants, print the paired table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a prepared model's name or a model folder")
    parser.add_argument("--calibration", default=None, metavar="FILE|none",
                        help="the calibration the variants start from (default: the repository's for the model)")
    add_case_arguments(parser)
    parser.add_argument("--anchor-ratio", type=float, default=0.15)
    parser.add_argument("--variant", type=parse_variant, action="append", required=True,
                        help="NAME=POLICY[,knob=value...] (repeatable)")
    parser.add_argument("--versus", default="pic", help="the variant the paired differences are taken against")
    parser.add_argument("--output", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    outside = dev_split_error(args.offset, args.seed, args.examples)
    if outside:
        parser.error(f"scripts/ablate_repair.py tunes: it runs on the development split only ({outside})")
    if args.versus not in ["pic", *(v[0] for v in args.variant)]:
        parser.error(f"--versus {args.versus!r} is not a variant")
    args.calibration_used = model_calibration(assets.resolve_model(args.model), args.calibration)
    print(f"calibration: {args.calibration_used.describe() if args.calibration_used else 'none (the defaults)'}",
          file=sys.stderr, flush=True)
    rows = run(args)
    summary = summarize(rows, args.versus)
    print(f"\n{'format':<16}{'variant':<16}{'n':>4}{'KL':>8}{'top-1':>7}{'pairs':>11}   vs {args.versus}: diff [95% CI] W/T/L")
    for s in summary:
        lo, hi = s["diff_ci95"]
        print(f"{s['format']:<16}{s['variant']:<16}{s['n']:>4}{s['kl']:>8.4f}{s['top1']:>7.2f}{s['pairs']:>11,.0f}"
              f"   {s['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] {'/'.join(map(str, s['wtl']))}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        calibration = args.calibration_used.to_json() | {"file": args.calibration_used.path} \
            if args.calibration_used else None
        payload = {"args": {k: v for k, v in vars(args).items() if k not in ("output", "calibration_used")},
                   "calibration": calibration, "summary": summary, "rows": rows}
        args.output.write_text(json.dumps(payload, indent=1, default=str))
        print(f"written to {args.output}")


if __name__ == "__main__":
    main()
