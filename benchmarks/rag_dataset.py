"""A RAG dataset for ``python -m sglang.bench_serving``: bench_cache_hit's trace as OpenAI chat rows.

SGLang's own load generator replays a JSONL file of OpenAI chat requests (``--dataset-name openai``,
:mod:`sglang.benchmark.datasets.openai_dataset`): each line a ``messages`` list, ``max_tokens``,
and any other request field, which it sends as it is. This module writes
:func:`benchmarks.replay.make_trace`'s trace (the same flags, the same seed: the same
requests in the same order) in that format, one row per request::

    {"messages": [{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": [{"type": "text", "text": DOC_1}, ...,
                                               {"type": "text", "text": "Question: ...\\nAnswer:"}]}],
     "max_tokens": 8, "custom_params": {"relaxkv_policy": "pic"}}

Each document is its own text part, so the server marks it as a chunk (``request/sglang/chat.py``: every text
part of a message but its last); ``custom_params`` carries the per-request policy
(``--policy none`` leaves it out, for a server default or an ``X-RelaxKV-Policy`` header). 
``bench_serving`` renders every row with the tokenizer's chat template to estimate its length
before sending it (the figures it reports are the server's ``usage.prompt_tokens``). Many models'
templates, SmolLM2's among them, concatenate ``message['content']`` as a string and fail on a
list of parts, which SGLang's server flattens first (text parts joined by a space). So next to the
dataset this module writes a tokenizer folder for ``bench_serving`` (``--tokenizer-out``, default
``<output>.tokenizer``): ``--model``'s tokenizer files with its template behind a prelude that
flattens content parts the way the server does. The measurement, documented in
``docs/experiments/2026-12-01-bench-serving.md`` (its figure in ``docs/performance.md``)::

    python -m benchmarks.rag_dataset --output rag_trace.jsonl            # 100 requests, 5 documents each
    python -m sglang.bench_serving --backend sglang-oai-chat --base-url http://127.0.0.1:30000 \\
        --dataset-name openai --dataset-path rag_trace.jsonl --num-prompts 100 --max-concurrency 4 \\
        --tokenizer rag_trace.jsonl.tokenizer --model smollm2-135m --flush-cache --cache-report

``bench_serving``'s "Cache Hit Details" (cached tokens over prompt tokens, both as the server
reports them) is then the hit rate ``bench_cache_hit`` reports for the same trace and policy.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
from typing import Any, Sequence

from benchmarks import common
from benchmarks.replay import TraceRequest, add_trace_args, check_trace_args, make_trace, policy_spec
from relaxkv_sglang import assets
from relaxkv_sglang.client import custom_params
from relaxkv_sglang.request.schema import FIELDS, POLICY

BENCH = "rag_dataset"

# Put before a chat template: every message whose content is a list of parts gets, as its content,
# the text of its text parts joined by a space (SGLang's flattening for string-content templates).
FLATTEN_PARTS = (
    "{%- set flat = namespace(messages=[]) -%}"
    "{%- for m in messages -%}"
    "{%- if m['content'] is string or m['content'] is none -%}{%- set flat.messages = flat.messages + [m] -%}"
    "{%- else -%}{%- set flat.messages = flat.messages + [dict(m, content=m['content'] "
    "| selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' '))] -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- set messages = flat.messages -%}\n"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt")


def chat_row(request: TraceRequest, max_tokens: int, custom: dict | None) -> dict[str, Any]:
    """One request as an OpenAI chat body without ``model`` (bench_serving's ``openai`` row);
    ``custom``: its ``custom_params`` (None or empty: none)."""
    parts = [{"type": "text", "text": text} for text in (*request.documents, request.question)]
    row: dict[str, Any] = {
        "messages": [{"role": "system", "content": request.system}, {"role": "user", "content": parts}],
        "max_tokens": max_tokens,
    }
    if custom:
        row["custom_params"] = dict(custom)
    return row


def policy_params(policy: str | None, anchor_ratio: float | None) -> dict:
    """``custom_params`` of every row under ``policy`` (a :func:`~benchmarks.replay.policy_spec`
    name; None: none); a ``-auto`` policy's prompts would go unmarked, which content parts cannot
    say (ValueError)."""
    if policy is None:
        return {}
    spec = policy_spec(policy, anchor_ratio)
    if spec.unmarked:
        raise ValueError(f"{policy}: every document is its own content part here (marked); "
                         "send the unmarked shapes with bench_cache_hit --frameworks")
    return custom_params(spec.server_policy, **spec.knobs)


def check_params(custom: dict) -> dict:
    """``custom`` as the server takes it (each field validated and normalized, ``request/schema.py``: a
    budget given as text becomes a number), else ValueError naming the field."""
    return {field.name: field.validate(custom[field.name]) for field in FIELDS if field.name in custom}


def write_dataset(path: pathlib.Path, trace: Sequence[TraceRequest], max_tokens: int, custom: dict | None) -> int:
    """Write ``trace`` to ``path`` as JSONL chat rows with ``custom`` params; the number of rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for request in trace:
            f.write(json.dumps(chat_row(request, max_tokens, custom), ensure_ascii=False) + "\n")
    return len(trace)


def write_bench_tokenizer(model_dir: pathlib.Path, out: pathlib.Path) -> None:
    """``model_dir``'s tokenizer in ``out`` with its chat template behind :data:`FLATTEN_PARTS`.

    The template is the model folder's ``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template`` string; a model without one cannot serve chat requests (ValueError).
    """
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    jinja = model_dir / "chat_template.jinja"
    template = jinja.read_text() if jinja.is_file() else config.get("chat_template")
    if not isinstance(template, str):
        raise ValueError(f"{model_dir} has no chat template (chat_template.jinja or a string in tokenizer_config.json)")
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out / name)
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out / "chat_template.jinja").write_text(FLATTEN_PARTS + template)


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.rag_dataset``: write the trace as a bench_serving dataset."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{BENCH}", description=__doc__.split("\n\n")[0])
    add_trace_args(parser)
    parser.add_argument("--policy", default="pic",
                        help="custom_params.relaxkv_policy of every row (%s; '<policy>@auto' adds relaxkv_budget "
                             "auto); 'none' leaves it out" % ", ".join(POLICY.choices))
    parser.add_argument("--anchor-ratio", type=float, default=None,
                        help="custom_params.relaxkv_anchor_ratio of a repair policy's rows (default: the server's)")
    parser.add_argument("--output", required=True, help="the JSONL file to write")
    parser.add_argument("--model", default="smollm2-135m",
                        help="whose tokenizer bench_serving gets: a model name (%s) or folder" % ", ".join(assets.MODELS))
    parser.add_argument("--tokenizer-out", default=None,
                        help="the tokenizer folder for bench_serving's --tokenizer (default: <output>.tokenizer)")
    args = parser.parse_args(argv)
    check_trace_args(BENCH, args)
    if args.max_new_tokens < 1:
        common.fail(BENCH, f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    try:
        custom = check_params(policy_params(None if args.policy == "none" else args.policy, args.anchor_ratio))
    except ValueError as exc:
        common.fail(BENCH, f"--policy {args.policy}: {exc}")
    tokenizer_out = pathlib.Path(args.tokenizer_out or f"{args.output}.tokenizer")
    try:
        write_bench_tokenizer(assets.resolve_model(args.model), tokenizer_out)
    except (ValueError, OSError) as exc:
        common.fail(BENCH, f"--model {args.model}: {exc}")
    rows = write_dataset(pathlib.Path(args.output), make_trace(args), args.max_new_tokens, custom)
    print(f"{BENCH}: wrote {rows} requests ({args.docs_per_request} documents each, policy "
          f"{args.policy}) to {args.output}, and bench_serving's tokenizer to {tokenizer_out}")


if __name__ == "__main__":
    main()
