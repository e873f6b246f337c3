"""lm-eval-harness against the server: the same loglikelihoods and scores cold and warm (issue 46).

An evaluation client must get the same answer from a request whatever the cache holds. This runs
the real client, lm-eval (``lm-eval==0.4.13``, pinned in requirements/dev.txt), with its
``local-completions`` model against the server's ``/v1/completions``: each loglikelihood request
is one completion with ``echo`` and ``logprobs`` (``max_tokens: 1``), the prompt sent as text
(``tokenized_requests=False``: token ids would not be chunked), the tokenizer the tiny model's
own folder (nothing from a hub).

The task is built here, offline, from HotpotQA (``assets.load_data("hotpotqa")``): each example's
first :data:`N_DOCS` paragraphs as ``[n] Title: text`` lines between blank lines, the question,
``Answer:``, and :data:`N_CHOICES` answer choices (its own answer and other examples' answers);
a YAML task over a local jsonl, scored by ``acc`` and ``acc_norm``. The client names no chunks:
the server's discovery finds the paragraphs (a marker opens each; a ``Question:`` line follows
the last), and the policy comes from the ``X-RelaxKV-Policy`` header lm-eval sends.

Under ``pic`` and ``relaxkv``: the task is evaluated after ``/flush_cache`` (cold: each
example's documents are computed by its first request, hits for its other choices) and again
(warm: every document a hit). Every choice's loglikelihood must agree within 1e-4 and the scores
exactly, and the warm run must have reused every document (the chunk tree's counters), so the
comparison cannot pass with nothing reused. An echo request asks for input logprobs from the
prompt's start, so a repair policy serves it as ``pic`` (docs/api.md, "A cache changes speed,
never answers"): the ``relaxkv`` case checks that path (the header's policy, the fallback), not
the repair.

lm-eval slices a completion's ``token_logprobs`` by its own tokenization of the context, which
has no BOS; the server adds the model's BOS, so each sum also holds the context's last token
(the ``:`` of ``Answer:``), the same for every choice of an example.
"""

from __future__ import annotations

import json
import logging
import pathlib
import random

import pytest
import requests
from rag_helpers import flush, relaxkv_state

from relaxkv_sglang import assets

pytestmark = pytest.mark.e2e

TASK = "relaxkv_hotpotqa_mc"
N_EXAMPLES = 3
N_DOCS = 4
N_CHOICES = 4
TOLERANCE = 1e-4  # the invariant's bound on logprobs (float32)


def hotpotqa_multiple_choice(n: int, *, n_docs: int = N_DOCS, n_choices: int = N_CHOICES,
                             seed: int = 46) -> list[dict]:
    """``n`` HotpotQA examples as multiple-choice rows: ``prompt`` (documents, question,
    ``Answer:``), ``choices`` (the answer and ``n_choices - 1`` other examples' answers, shuffled),
    ``label`` (the answer's index). Yes/no questions are left out (their choices would be two)."""
    data = [ex for ex in assets.load_data("hotpotqa") if ex["answer"].lower() not in ("yes", "no")]
    rng = random.Random(seed)
    picked = rng.sample(range(len(data)), n)
    answers = sorted({ex["answer"] for ex in data})
    rows = []
    for i in picked:
        ex = data[i]
        docs = [f"[{k + 1}] {title}: {''.join(sentences).strip()}"
                for k, (title, sentences) in enumerate(ex["context"][:n_docs])]
        prompt = ("Answer the question from the documents.\n\n" + "\n\n".join(docs)
                  + f"\n\nQuestion: {ex['question']}\nAnswer:")
        others = rng.sample([a for a in answers if a != ex["answer"]], n_choices - 1)
        choices = [ex["answer"], *others]
        rng.shuffle(choices)
        rows.append({"id": ex["_id"], "prompt": prompt, "choices": choices, "label": choices.index(ex["answer"])})
    return rows


def write_task(folder: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    """A YAML task over a local jsonl in ``folder`` (``datasets``' json builder: no hub)."""
    data = folder / "hotpotqa_mc.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    (folder / f"{TASK}.yaml").write_text(json.dumps({  # JSON is YAML
        "task": TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(folder / "datasets")},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{prompt}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")],
        "metadata": {"version": 1},
    }), encoding="utf-8")
    return folder


def evaluate(url: str, model_path: str, task_dir: pathlib.Path, policy: str) -> tuple[dict, dict]:
    """lm-eval's ``local-completions`` on the task: (scores, each example's choice loglikelihoods
    by doc id)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    served = requests.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
    out = simple_evaluate(
        model="local-completions",
        model_args={"base_url": url + "/v1/completions", "model": served, "tokenizer": model_path,
                    "tokenizer_backend": "huggingface", "tokenized_requests": False, "max_length": 4096,
                    "header": {"X-RelaxKV-Policy": policy}, "max_retries": 1, "timeout": 300},
        tasks=[TASK], task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        num_fewshot=0, batch_size=1, bootstrap_iters=0, log_samples=True, random_seed=0)
    scores = {k: v for k, v in out["results"][TASK].items() if k.startswith(("acc,", "acc_norm,"))}
    per_example = {s["doc_id"]: [resp[0] for resp in s["resps"]] for s in out["samples"][TASK]}
    return scores, per_example


@pytest.mark.parametrize("policy", ["pic", "relaxkv"])
def test_lm_eval_loglikelihoods_are_the_same_cold_and_warm(relaxkv_server, tiny_model_path, tmp_path, policy):
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    rows = hotpotqa_multiple_choice(N_EXAMPLES)
    task_dir = write_task(tmp_path, rows)
    url = relaxkv_server.url
    n_requests, n_docs = N_EXAMPLES * N_CHOICES, N_EXAMPLES * N_DOCS

    flush(url)
    before = relaxkv_state(url)
    cold_scores, cold = evaluate(url, tiny_model_path, task_dir, policy)
    mid = relaxkv_state(url)
    warm_scores, warm = evaluate(url, tiny_model_path, task_dir, policy)
    after = relaxkv_state(url)

    # the documents were found and stored by the cold run, and every one reused by the warm run
    assert mid["chunk_inserts"] - before["chunk_inserts"] == n_docs, (before, mid)
    assert after["chunk_inserts"] == mid["chunk_inserts"], (mid, after)
    assert after["chunk_hits"] - mid["chunk_hits"] == n_requests * N_DOCS, (mid, after)

    assert sorted(cold) == sorted(warm) == list(range(N_EXAMPLES))
    diffs = [(doc_id, i, c[0], w[0]) for doc_id in cold for i, (c, w) in enumerate(zip(cold[doc_id], warm[doc_id]))
             if abs(c[0] - w[0]) > TOLERANCE or c[1] != w[1]]
    worst = max(abs(c[0] - w[0]) for doc_id in cold for c, w in zip(cold[doc_id], warm[doc_id]))
    print(f"{policy}: cold {cold_scores} warm {warm_scores}; largest loglikelihood difference {worst:.3g}")
    assert not diffs, f"{policy}: {len(diffs)} of {n_requests} choices differ cold vs warm (doc, choice, cold, warm): {diffs}"
    assert cold_scores == warm_scores
