"""Measure where a model's stale chunk KV deviates from full prefill, and what exact KV at chosen tokens would buy.

The diagnosis behind a model's calibration (issue 35, item 2): why does the same repair leave
first-token KL ~0.03 on SmolLM2-135M and ~0.3 on Qwen2.5-0.5B? On the torch reference
(``repair/reference.py``, float32), per (example, format) of the development split:

* **Deviation profile**: per layer l and token group g of the chunks (each chunk's ``opening``
  token, its tokens ``1-3``, the ``body`` from offset 4), the mean relative error of the stale K
  and V, ``|k_stale(t) - k_full(t)| / |k_full(t)|`` (K post-RoPE, re-rotated; per token over all
  KV heads), and the norm ratio ``|v_stale(t)| / |v_full(t)|`` (a chunk computed alone makes its
  opening its attention sink; a sink's V is small).
* **Chunk-opening sinks**: the query's attention mass on the chunks' opening tokens (summed over
  them, averaged over layers; s_l of ``attention.query_scores.query_attention_scores``) over the stale KV and
  over full prefill's KV.
* **Exact-KV bounds** (first-token KL over the whole vocabulary, as ``scripts/ablate_repair.py``):
  ``pic`` (the stale KV), and the stale KV with full prefill's K/V at every layer for a token set:
  the chunk openings; the openings and the template markup every chunk repeats
  (``token_sets.shared_runs``: ``</source><document_content>`` in the ``tagged`` layout;
  ``markup_share`` of the chunk tokens); the ``--anchor-ratio`` share of the chunk tokens the query scores highest
  (mean s_l over layers, the anchors a perfect repair of that ratio would fix); a random set of
  the same size. What the best possible repair of a set leaves is the KL of its exact-KV bound:
  the rest of the error sits in the tokens it does not touch.

Development split only (``ablate_repair.dev_split_error``)::

    python -m scripts.measure_deviation --model qwen2.5-0.5b --examples 1 --formats plain chat \\
        --offset 600 --seed 600 --output docs/results/deviation_qwen_dev.json

Prints the profile (every third layer) and the per-format means; the JSON holds every row.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import torch

from benchmarks import quality_tasks
from relaxkv_sglang.repair.reference import query_over, reference_prefill, stale_context
from relaxkv_sglang.repair.token_sets import chunk_offsets, eligible_tokens, shared_runs
from scripts.ablate_repair import add_case_arguments, dev_split_error, kl_full_vocab, load_reference, request_tokens

GROUPS = ("opening", "1-3", "body")
BOUNDS = ("pic", "exact_openings", "exact_openings_markup", "exact_top", "exact_random")


def token_groups(spans: list, n_context: int) -> dict[str, torch.Tensor]:
    """bool [n_context] masks of the chunk tokens by their offset in their chunk (:data:`GROUPS`)."""
    elig = eligible_tokens(spans, n_context)
    offset, _ = chunk_offsets(spans, elig, n_context)
    masks = {g: torch.zeros(n_context, dtype=torch.bool) for g in GROUPS}
    masks["opening"][elig[offset == 0]] = True
    masks["1-3"][elig[(offset >= 1) & (offset <= 3)]] = True
    masks["body"][elig[offset >= 4]] = True
    return masks


def relative_error(stale: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """[n] per token: |stale - full| / |full| over heads and dims (stale, full: [n, Hkv, d])."""
    return (stale - full).flatten(1).norm(dim=1) / full.flatten(1).norm(dim=1).clamp_min(1e-6)


def deviation_profile(stale_kv: list, full_kv: list, masks: dict[str, torch.Tensor]) -> list[dict]:
    """Per layer, per group: mean K error, V error and V norm ratio (module doc)."""
    profile = []
    for (ks, vs), (kf, vf) in zip(stale_kv, full_kv):
        n = ks.shape[0]
        k_err, v_err = relative_error(ks, kf[:n]), relative_error(vs, vf[:n])
        v_norm = vs.flatten(1).norm(dim=1) / vf[:n].flatten(1).norm(dim=1).clamp_min(1e-6)
        profile.append({g: {"k_err": float(k_err[m].mean()), "v_err": float(v_err[m].mean()),
                            "v_norm": float(v_norm[m].mean())} for g, m in masks.items() if m.any()})
    return profile


def exact_at(stale_kv: list, full_kv: list, tokens: torch.Tensor) -> list:
    """The stale KV with full prefill's K/V at ``tokens`` (bool [n_context]) at every layer."""
    out = []
    for (ks, vs), (kf, vf) in zip(stale_kv, full_kv):
        k, v = ks.clone(), vs.clone()
        k[tokens], v[tokens] = kf[:k.shape[0]][tokens], vf[:v.shape[0]][tokens]
        out.append((k, v))
    return out


def measure_case(weights, ids: torch.Tensor, spans: list, q0: int, anchor_ratio: float, seed: int) -> dict:
    """One (example, format): the profile, the opening mass and the exact-KV bounds."""
    full = reference_prefill(weights, ids, spans, q0, "full")
    stale = stale_context(weights, ids, spans, q0)
    masks = token_groups(spans, q0)
    chunk = masks["opening"] | masks["1-3"] | masks["body"]
    markup = shared_runs(ids, spans, q0) & chunk
    _, _, full_scores = query_over(weights, ids, q0, [(k[:q0], v[:q0]) for k, v in full.kv])

    def opening_mass(scores: torch.Tensor) -> float:
        return float((scores[:, masks["opening"]].sum(1) / scores.sum(1).clamp_min(1e-12)).mean())

    k = int(anchor_ratio * int(chunk.sum()))
    ranked = stale.scores.mean(0).masked_fill(~chunk, -1.0)
    top = torch.zeros(q0, dtype=torch.bool)
    top[ranked.topk(k).indices] = True
    generator = torch.Generator().manual_seed(seed)
    chunk_tokens = chunk.nonzero().flatten()
    random = torch.zeros(q0, dtype=torch.bool)
    random[chunk_tokens[torch.randperm(chunk_tokens.numel(), generator=generator)[:k]]] = True
    bounds = {"pic": kl_full_vocab(full.last_logits, stale.pic_logits)}
    sets = (("exact_openings", masks["opening"]), ("exact_openings_markup", masks["opening"] | markup),
            ("exact_top", top), ("exact_random", random))
    for name, tokens in sets:
        logits = query_over(weights, ids, q0, exact_at(stale.kv, full.kv, tokens))[0]
        bounds[name] = kl_full_vocab(full.last_logits, logits)
    return {"tokens": int(ids.numel()), "chunks": len(spans), "opening_mass_stale": opening_mass(stale.scores),
            "opening_mass_full": opening_mass(full_scores), "top_has_openings": float(top[masks["opening"]].float().mean()),
            "markup_share": float(markup.sum()) / max(int(chunk.sum()), 1),
            **bounds, "profile": deviation_profile(stale.kv, full.kv, masks)}


def print_summary(rows: list[dict]) -> None:
    """The first row's profile (every third layer), then per format and pooled: the means."""
    print(f"deviation profile, {rows[0]['task']} {rows[0]['format']} (K err / V err / V norm ratio):")
    for l, layer in enumerate(rows[0]["profile"]):
        if l % 3 == 0 or l == len(rows[0]["profile"]) - 1:
            print(f"  layer {l:>2}  " + "  ".join(f"{g}: {d['k_err']:.2f}/{d['v_err']:.2f}/{d['v_norm']:.2f}"
                                                  for g, d in layer.items()))
    keys = ("opening_mass_stale", "opening_mass_full", "top_has_openings", "markup_share", *BOUNDS)
    print(f"\n{'format':<16}{'n':>4}" + "".join(f"{k:>20}" for k in keys))
    for fmt in [*dict.fromkeys(r["format"] for r in rows), "all"]:
        cell = [r for r in rows if fmt == "all" or r["format"] == fmt]
        print(f"{fmt:<16}{len(cell):>4}" + "".join(f"{statistics.mean(r[k] for r in cell):>20.3f}" for k in keys))
    layers = len(rows[0]["profile"])
    print("\nmean over rows and layers (K err / V err / V norm ratio): " + "  ".join(
        f"{g}: " + "/".join(f"{statistics.mean(r['profile'][l][g][m] for r in rows for l in range(layers)):.2f}"
                             for m in ("k_err", "v_err", "v_norm")) for g in GROUPS))


def main(argv: list[str] | None = None) -> list[dict]:
    """``python -m scripts.measure_deviation``: measure, print, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    add_case_arguments(parser, examples=1)
    parser.add_argument("--anchor-ratio", type=float, default=0.15, help="the share of chunk tokens of the exact sets")
    parser.add_argument("--output", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if (error := dev_split_error(args.offset, args.seed, args.examples)) is not None:
        parser.error(f"scripts/measure_deviation.py measures the development split only: {error}")
    weights, tokenizer, _ = load_reference(args.model)
    rows = []
    torch.set_grad_enabled(False)
    for task in args.tasks:
        for example in quality_tasks.task_examples(task, args.examples, seed=args.seed, offset=args.offset):
            for fmt in args.formats:
                ids, spans, q0 = request_tokens(tokenizer, example, fmt)
                row = {"task": task, "example_id": example.example_id, "format": fmt,
                       **measure_case(weights, ids, spans, q0, args.anchor_ratio, args.seed)}
                rows.append(row)
                print(f"{task} {fmt} {example.example_id[:12]} " + " ".join(
                    f"{k}={row[k]:.3f}" for k in ("opening_mass_stale", "opening_mass_full", *BOUNDS)),
                    file=sys.stderr, flush=True)
    print_summary(rows)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
        print(f"written to {args.output}")
    return rows


if __name__ == "__main__":
    main()
