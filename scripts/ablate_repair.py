"""Ablate repair knobs on the torch reference: first-token KL to full prefill, paired, per format.

The tuning tool behind the defaults of ``core/repair_plan.py::RepairConfig`` (the server runs the
same planner and the prompt is split into the same parts, glue between chunks included, so a
knob's effect here is its effect there). No server: the model runs in
``core/reference.py`` (float32, CPU), the stale KV and the query pass once per example, then one
repair pass per variant. Development data only (HotpotQA dev from ``--offset``, synthetic
``--seed``; see ``workloads.QUALITY_SPLITS``); final figures come from ``bench_quality`` on the
test split.

A variant is ``NAME=POLICY[,knob=value...]`` with repair knobs by their flat names
(``repair_plan.knob_defaults``: RepairConfig's shared knobs and the policies' options), e.g.::

    python scripts/ablate_repair.py --examples 3 --formats plain document chat \\
        --variant prophetkv=prophetkv \\
        --variant old=relaxkv,layer_value=uniform,own_chunk_in_budget=true,context_ratio=0.25 \\
        --variant new=relaxkv --versus prophetkv --output results/ablate.json

Prints, per format and pooled, each variant's mean KL (over the full vocabulary), top-1 agreement
with ``full``, mean attended KV pairs, and its paired difference to ``--versus`` (95% bootstrap CI
over the (example, format) pairs, which the pooled row resamples alike; wins/ties/losses).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

from benchmarks import metrics, workloads
from relaxkv_sglang import assets
from relaxkv_sglang.core.reference import from_hf_state_dict, reference_prefill, stale_context
from relaxkv_sglang.core.repair_plan import RepairConfig, knob_defaults


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
        overrides[key] = _knob_value(defaults[key], value)
    return name, policy, overrides


def _knob_value(default, value: str):
    """``value`` parsed as the type of the knob's default (None defaults are optional floats)."""
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes")
    if default is None or isinstance(default, float):
        return None if value.lower() == "none" else float(value)
    return int(value) if isinstance(default, int) else value


def request_tokens(tokenizer, example: workloads.TaskExample, fmt: str) -> tuple[torch.Tensor, list, int]:
    """(input_ids int64 [n], chunk token spans, query start), split as the server splits the request
    (``core.segments``): each part tokenized on its own, the glue between chunks a part of its own
    (computed with the request, never cached)."""
    text, offsets = example.marked(fmt)
    spans = workloads.chunk_spans(offsets)
    ids = workloads.token_ids(tokenizer, text[:spans[0][0]], special=True)
    token_spans, prev = [], spans[0][0]
    for start, end in spans:
        ids += workloads.token_ids(tokenizer, text[prev:start]) if start > prev else []
        piece = workloads.token_ids(tokenizer, text[start:end])
        token_spans.append((len(ids), len(ids) + len(piece)))
        ids += piece
        prev = end
    query_start = len(ids)
    ids += workloads.token_ids(tokenizer, text[prev:])
    return torch.tensor(ids), token_spans, query_start


def kl_full_vocab(full: torch.Tensor, other: torch.Tensor) -> float:
    """KL(softmax(full) || softmax(other)) over the whole vocabulary (logits float [vocab])."""
    p, q = torch.log_softmax(full.double(), -1), torch.log_softmax(other.double(), -1)
    return float((p.exp() * (p - q)).sum())


def run(args: argparse.Namespace) -> list[dict]:
    """One row per (example, format): every variant's KL, top-1 agreement and attended pairs."""
    from transformers import AutoModelForCausalLM

    path = assets.model_path(args.model)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    weights = from_hf_state_dict(hf.state_dict(), hf.config.to_dict())
    tokenizer = assets.load_tokenizer(path)
    rows = []
    for task in args.tasks:
        for example in workloads.task_examples(task, args.examples, seed=args.seed, offset=args.offset):
            for fmt in args.formats:
                started = time.perf_counter()
                ids, spans, q0 = request_tokens(tokenizer, example, fmt)
                full = reference_prefill(weights, ids, spans, q0, "full").last_logits
                stale = stale_context(weights, ids, spans, q0)
                row = {"task": task, "example_id": example.example_id, "format": fmt, "tokens": int(ids.numel()),
                       "variants": {"pic": {"kl": kl_full_vocab(full, stale.pic_logits), "pairs": 0,
                                            "top1": int(stale.pic_logits.argmax() == full.argmax())}}}
                for name, policy, overrides in args.variant:
                    config = RepairConfig.from_knobs(**{"anchor_ratio": args.anchor_ratio, **overrides})
                    res = reference_prefill(weights, ids, spans, q0, policy, config, stale=stale)
                    row["variants"][name] = {"kl": kl_full_vocab(full, res.last_logits),
                                             "top1": int(res.last_logits.argmax() == full.argmax()),
                                             "pairs": res.report.repair_kv_pairs}
                rows.append(row)
                print(f"{task} {fmt} {example.example_id[:12]} {row['tokens']} tok {time.perf_counter() - started:.0f}s "
                      + " ".join(f"{n}={v['kl']:.3f}" for n, v in row["variants"].items()), file=sys.stderr, flush=True)
    return rows


def summarize(rows: list[dict], versus: str) -> list[dict]:
    """Per format and pooled ("all"): each variant's means and its paired difference to ``versus``."""
    out = []
    for fmt in [*dict.fromkeys(r["format"] for r in rows), "all"]:
        cell = [r for r in rows if fmt == "all" or r["format"] == fmt]
        for name in cell[0]["variants"]:
            kl = [r["variants"][name]["kl"] for r in cell]
            ref = [r["variants"][versus]["kl"] for r in cell]
            out.append({"format": fmt, "variant": name, "n": len(cell), "kl": statistics.mean(kl),
                        "top1": statistics.mean(r["variants"][name]["top1"] for r in cell),
                        "pairs": statistics.mean(r["variants"][name]["pairs"] for r in cell),
                        "diff": statistics.mean(k - v for k, v in zip(kl, ref)),
                        "diff_ci95": metrics.paired_bootstrap_ci(kl, ref), "wtl": metrics.win_counts(kl, ref)})
    return out


def main(argv: list[str] | None = None) -> None:
    """``python scripts/ablate_repair.py``: run the variants, print the paired table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", nargs="+", default=list(workloads.QUALITY_TASKS), choices=workloads.QUALITY_TASKS)
    parser.add_argument("--formats", nargs="+", default=["plain"], choices=workloads.PROMPT_FORMATS)
    parser.add_argument("--examples", type=int, default=3, help="examples per task")
    parser.add_argument("--offset", type=int, default=0, help="first HotpotQA dev example (dev split: < 3000)")
    parser.add_argument("--seed", type=int, default=0, help="synthetic tasks' seed (dev split: < 1000)")
    parser.add_argument("--anchor-ratio", type=float, default=0.15)
    parser.add_argument("--variant", type=parse_variant, action="append", required=True,
                        help="NAME=POLICY[,knob=value...] (repeatable)")
    parser.add_argument("--versus", default="pic", help="the variant the paired differences are taken against")
    parser.add_argument("--output", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    dev = workloads.QUALITY_SPLITS["dev"]
    if args.offset + args.examples > dev["hotpotqa"][1] or args.seed >= dev["seeds"][1]:
        parser.error("scripts/ablate_repair.py tunes: it runs on the development split only")
    if args.versus not in ["pic", *(v[0] for v in args.variant)]:
        parser.error(f"--versus {args.versus!r} is not a variant")
    rows = run(args)
    summary = summarize(rows, args.versus)
    print(f"\n{'format':<9}{'variant':<16}{'n':>4}{'KL':>8}{'top-1':>7}{'pairs':>11}   vs {args.versus}: diff [95% CI] W/T/L")
    for s in summary:
        lo, hi = s["diff_ci95"]
        print(f"{s['format']:<9}{s['variant']:<16}{s['n']:>4}{s['kl']:>8.4f}{s['top1']:>7.2f}{s['pairs']:>11,.0f}"
              f"   {s['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] {'/'.join(map(str, s['wtl']))}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        payload = {"args": {k: v for k, v in vars(args).items() if k != "output"}, "summary": summary, "rows": rows}
        args.output.write_text(json.dumps(payload, indent=1, default=str))
        print(f"written to {args.output}")


if __name__ == "__main__":
    main()
