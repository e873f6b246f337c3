"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``relaxkv``).

SGLang calls :func:`register` in every process it starts; it registers the ``relaxkv`` attention
and tree cache backends and the hooks of :data:`HOOKS`, each with the parameters it relies on, so a
release that changes one stops the server at startup naming it.
"""

from __future__ import annotations

import inspect
import os
import pkgutil
import sys

from relaxkv_sglang.model.model_family import hooked_model_classes

SGLANG_VERSION = "0.5.23"

#: ``<class>.forward`` of each decoder-stack class (``model/model_family.py``) -> the repair hook.
MODEL_FORWARD_HOOKS = {
    f"{model_class}.forward": (
        "relaxkv_sglang.forward.repair_stage:around_model_forward", ("self", "input_ids", "positions", "forward_batch"))
    for model_class in hooked_model_classes()
}

# target -> (hook "module:function", parameters the hook relies on)
HOOKS = {
    "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request": (
        "relaxkv_sglang.request.sglang.api:around_generate_request", ("self", "obj", "request")),
    "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.flush_cache": (
        "relaxkv_sglang.request.sglang.api:around_flush_cache", ("self",)),
    "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation": (
        "relaxkv_sglang.forward.pipeline:around_forward_batch_generation", ("self", "batch")),
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new": (
        "relaxkv_sglang.forward.pipeline:around_forward_batch_init_new", ("cls", "batch", "model_runner")),
    **MODEL_FORWARD_HOOKS,
    "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill": (
        "relaxkv_sglang.cache.sglang.admission:around_get_new_batch_prefill", ("self", "running_batch")),
    "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req": (
        "relaxkv_sglang.cache.sglang.admission:around_add_one_req", ("self", "req")),
    "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req": (
        "relaxkv_sglang.cache.sglang.admission:around_add_chunked_req", ("self", "req")),
    "sglang.srt.managers.scheduler.Scheduler.get_internal_state": (
        "relaxkv_sglang.server.sglang.startup:around_get_internal_state", ("self", "recv_req")),
    "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
    ".is_request_level_customized_info_key": (
        "relaxkv_sglang.forward.report:around_is_request_level_key", ("self", "key")),
    "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._convert_to_internal_request": (
        "relaxkv_sglang.request.sglang.chat:around_convert_to_internal_request", ("self", "request", "raw_request")),
    "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._generate_stream_content": (
        "relaxkv_sglang.request.sglang.chat_stream_logprobs:around_generate_stream_content",
        ("self", "content", "index", "request", "created", "stream_offsets", "reasoning_parser_dict", "parser_dict",
         "has_tool_calls", "choice_logprobs", "finish_reason_type")),
    "sglang.srt.entrypoints.http_server.serve_generate_request": (
        "relaxkv_sglang.request.sglang.parallel_encoding:around_serve_generate_request", ("obj", "request")),
    "sglang.srt.managers.scheduler_components.logprob_result_processor.SchedulerLogprobResultProcessor"
    ".add_logprob_return_values": (
        "relaxkv_sglang.request.sglang.prefill_only:around_add_logprob_return_values", ("self", "i", "req")),
    "sglang.srt.arg_groups.attention_hook.handle_deterministic_inference": (
        "relaxkv_sglang.server.sglang.deterministic:around_handle_deterministic_inference", ("server_args",)),
}


def announce(message: str) -> None:
    """One line in the server log. SGLang loads plugins before it configures
    logging in its spawned processes, so a logger here would be dropped."""
    print(f"[relaxkv] {message}", file=sys.stderr, flush=True)


def _check_cpu_shims() -> None:
    import torch

    if torch.cuda.is_available():
        return
    try:
        import relaxkv_patches
    except ImportError as exc:  # the package is installed without `make install`
        raise SystemExit(f"relaxkv-sglang: CPU shims missing ({exc}); install the package with its "
                         "relaxkv_patches, then run `python -m relaxkv_patches.install_pth`") from exc
    relaxkv_patches.arm()
    announce(f"CPU shims active in pid {os.getpid()}: {', '.join(relaxkv_patches.activated())}")


def _check_target(target: str, params: tuple[str, ...]) -> None:
    owner, _, attr = target.rpartition(".")
    try:
        fn = inspect.getattr_static(pkgutil.resolve_name(owner), attr)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"relaxkv-sglang: hook target {target} is gone ({exc}); written for sglang {SGLANG_VERSION}")
    fn = getattr(fn, "__func__", fn)
    names = list(inspect.signature(fn).parameters)
    if names[: len(params)] != list(params):
        raise SystemExit(
            f"relaxkv-sglang: {target} now takes {names}, the hook expects {list(params)} first; "
            f"written for sglang {SGLANG_VERSION}"
        )


def _register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, (hook_path, params) in HOOKS.items():
        _check_target(target, params)
        HookRegistry.register(target, pkgutil.resolve_name(hook_path), HookType.AROUND)


def _register_backends() -> None:
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from relaxkv_sglang.attention.sglang.attention_backend import create_backend
    from relaxkv_sglang.request.plan import BACKEND_NAME
    from relaxkv_sglang.server.sglang.startup import make_tree_cache

    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(create_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, make_tree_cache)


def register() -> None:
    """Called by ``sglang.srt.plugins.load_plugins`` in each SGLang process."""
    _check_cpu_shims()
    from relaxkv_sglang.request.schema import check_default_policy
    from relaxkv_sglang.runtime.settings import server_settings

    check_default_policy(server_settings())  # read once per process: a bad RELAXKV_* value stops the server here
    _register_backends()
    _register_hooks()
    from relaxkv_sglang.request.sglang.stop_regex import install

    install()  # stop_regex matched with RE2, in linear time (re's backtracking can hang the scheduler)
    from relaxkv_sglang.request.sglang.parallel_encoding import register_http_routes

    register_http_routes()  # POST /concate_and_append_request on SGLang's FastAPI app
