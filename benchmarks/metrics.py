"""Scoring and latency statistics for the demo and the benchmarks.

Pure Python, no server and no model: everything here is unit-tested on
hand-computed cases.

- Answer quality: LongBench's QA F1 (the scorer LongBench uses for HotpotQA:
  lowercase, strip punctuation and the articles a/an/the, split on whitespace,
  token-multiset F1, max over the references) and exact agreement of two
  answers after the same normalisation (the fidelity figure: does a cache mode
  answer what full prefill answers?); RULER's ``string_match_all`` (share of
  the references found in the answer) for the synthetic tasks.
- Latency: percentiles with linear interpolation (numpy's default), and a
  ``mean/p50/p90/p99`` summary.
- Comparisons over examples: a 95% percentile-bootstrap interval of a mean,
  the same of the mean per-example difference of two policies (paired: the
  examples are resampled, each keeping both its values), and win/tie/loss
  counts.
- Cache: hit rate = cached prompt tokens / prompt tokens, and the reuse bound
  of a trace (every chunk token after the chunk's first appearance).
"""

from __future__ import annotations

import collections
import math
import random
import re
import string
from typing import Hashable, Iterable, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """LongBench/SQuAD normalisation: lowercase, drop punctuation, drop a/an/the, squeeze whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _token_f1(prediction: list[str], reference: list[str]) -> float:
    common = collections.Counter(prediction) & collections.Counter(reference)
    same = sum(common.values())
    if same == 0:  # also the empty-vs-empty case, as in LongBench
        return 0.0
    precision = same / len(prediction)
    recall = same / len(reference)
    return 2 * precision * recall / (precision + recall)


def _references(references: str | Sequence[str]) -> list[str]:
    refs = [references] if isinstance(references, str) else list(references)
    if not refs:
        raise ValueError("at least one reference answer is needed")
    return refs


def qa_f1(prediction: str, references: str | Sequence[str]) -> float:
    """LongBench-style QA F1 of ``prediction`` against one or more references (max over them), in [0, 1]."""
    pred = normalize_answer(prediction).split()
    return max(_token_f1(pred, normalize_answer(ref).split()) for ref in _references(references))


def exact_agreement(prediction: str, references: str | Sequence[str]) -> float:
    """1.0 if ``prediction`` equals a reference after :func:`normalize_answer`, else 0.0.

    Returned as a float so that a mean over requests is the agreement rate.
    """
    pred = normalize_answer(prediction)
    return 1.0 if any(pred == normalize_answer(ref) for ref in _references(references)) else 0.0


def fidelity_f1(answer: str, reference: str) -> float:
    """Answer F1 of ``answer`` against another policy's answer to the same prompt (e.g. full prefill's).

    As :func:`qa_f1`, except that two answers that both normalise to nothing
    agree (1.0): the reference said nothing and so did the answer.
    """
    if not normalize_answer(reference).split():
        return float(not normalize_answer(answer).split())
    return qa_f1(answer, reference)


def string_match_all(prediction: str, references: str | Sequence[str]) -> float:
    """RULER's ``string_match_all``: the fraction of references found (case-insensitively) in ``prediction``.

    In [0, 1] (RULER reports it x100). Every reference counts alike, so an
    answer listing 3 of 4 needle values scores 0.75.
    """
    refs = _references(references)
    text = prediction.lower()
    return sum(ref.lower() in text for ref in refs) / len(refs)


# Scorer names used by the quality tasks (quality_tasks.TaskExample.scorer).
SCORERS = {"qa_f1": qa_f1, "string_match_all": string_match_all}


def score(scorer: str, prediction: str, references: str | Sequence[str]) -> float:
    """The task score of ``prediction`` under the scorer named ``scorer`` (a key of :data:`SCORERS`)."""
    if scorer not in SCORERS:
        raise ValueError(f"unknown scorer {scorer!r}; choose one of {', '.join(SCORERS)}")
    return SCORERS[scorer](prediction, references)


def mean(values: Iterable[float]) -> float | None:
    """Arithmetic mean, or None for no values (JSON has no NaN)."""
    values = list(values)
    return sum(values) / len(values) if values else None


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics.

    Same definition as ``numpy.percentile(values, q)`` (method ``linear``).
    """
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def latency_summary(values: Iterable[float]) -> dict:
    """``{"mean", "p50", "p90", "p99"}`` of ``values`` (seconds in, seconds out); all None when empty."""
    values = list(values)
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {
        "mean": mean(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def bootstrap_ci(values: Sequence[float], *, seed: int = 0, rounds: int = 1000) -> tuple[float, float] | None:
    """95% percentile-bootstrap interval of the mean of ``values`` (None for no values).

    ``rounds`` resamples of ``len(values)`` draws with replacement from one
    ``random.Random(seed)``: lists of equal length resample the same indices,
    so intervals of several policies over the same examples are paired.
    """
    values = list(values)
    if not values:
        return None
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(rounds))
    return means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


def paired_bootstrap_ci(a: Sequence[float], b: Sequence[float], *, seed: int = 0,
                        rounds: int = 1000) -> tuple[float, float] | None:
    """95% bootstrap interval of the mean of ``a[i] - b[i]``: the examples ``i`` are resampled, each
    keeping its pair. An interval that excludes 0 says ``a`` and ``b`` differ on these examples,
    which two overlapping marginal intervals cannot say. None for no pairs."""
    if len(a) != len(b):
        raise ValueError(f"paired values need equal lengths, got {len(a)} and {len(b)}")
    return bootstrap_ci([x - y for x, y in zip(a, b)], seed=seed, rounds=rounds)


def win_counts(a: Sequence[float], b: Sequence[float], *, tol: float = 1e-6) -> tuple[int, int, int]:
    """``(wins, ties, losses)`` of ``a`` against ``b`` pair by pair, lower is better (a loss, such as
    a KL): a win is ``a[i] < b[i] - tol``, a loss ``a[i] > b[i] + tol``, a tie anything closer."""
    if len(a) != len(b):
        raise ValueError(f"paired values need equal lengths, got {len(a)} and {len(b)}")
    wins = sum(x < y - tol for x, y in zip(a, b))
    losses = sum(x > y + tol for x, y in zip(a, b))
    return wins, len(a) - wins - losses, losses


def hit_rate(cached_tokens: int, prompt_tokens: int) -> float:
    """Fraction of prompt tokens served from cache (0.0 for an empty prompt)."""
    if cached_tokens < 0 or prompt_tokens < 0:
        raise ValueError("token counts must be non-negative")
    return cached_tokens / prompt_tokens if prompt_tokens else 0.0


def reusable_tokens(trace: Iterable[Iterable[tuple[Hashable, int]]]) -> int:
    """Tokens a perfect chunk cache could serve: every chunk token after that chunk's first appearance.

    ``trace`` is the requests in order, each a sequence of ``(chunk key,
    token count)``; a chunk counts as reusable from its second appearance on,
    whatever its position, and including a repeat inside the same request.
    This is the workload's best possible cached-token count (capacity and
    eviction ignored).
    """
    seen: set = set()
    total = 0
    for request in trace:
        for key, n_tokens in request:
            if key in seen:
                total += n_tokens
            else:
                seen.add(key)
    return total
