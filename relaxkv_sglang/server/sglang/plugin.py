"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``relaxkv``).

SGLang calls :func:`register` in every process it starts; it registers the ``relaxkv`` attention
and tree cache backends and the hooks of :func:`hooks`, each with the parameters it relies on, so a
release that changes one stops the server at startup naming it.
"""

from __future__ import annotations

import inspect
import os
import pkgutil
import sys

from relaxkv_sglang.runtime.hooks import Hook

SGLANG_VERSION = "0.5.23"


def hooks() -> tuple[Hook, ...]:
    """Every hook the plugin registers, each declared by the adapter module holding its wrapper (imported here,
    after the CPU shims are armed)."""
    from relaxkv_sglang.cache.sglang import admission
    from relaxkv_sglang.forward import pipeline, repair_stage, report
    from relaxkv_sglang.request.sglang import api, chat, chat_stream_logprobs, parallel_encoding, prefill_only
    from relaxkv_sglang.server.sglang import deterministic, startup

    return (*api.HOOKS, *chat.HOOKS, *chat_stream_logprobs.HOOKS, *parallel_encoding.HOOKS, *admission.HOOKS,
            *pipeline.HOOKS, *repair_stage.HOOKS, *prefill_only.HOOKS, *report.HOOKS, *startup.HOOKS,
            *deterministic.HOOKS)


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

    for hook in hooks():
        _check_target(hook.target, hook.params)
        HookRegistry.register(hook.target, hook.around, HookType.AROUND)


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
