"""``--enable-deterministic-inference`` with the relaxkv backends: refused at startup, saying why.

SGLang's flag promises bitwise-equal outputs for a request whatever its batch. The relaxkv
backends cannot keep that promise: their chunk policies answer from KV computed apart from the
prompt (an approximation of its full prefill, by design), and the attention backend is none of
SGLang's batch-invariant kernels. Rather than start and quietly break the promise (or fail on
SGLang's own "only [...] attention backends" line, which does not say why), the server stops with
:data:`REFUSAL`; a deterministic server is SGLang without ``--attention-backend relaxkv`` and
``--radix-cache-backend relaxkv`` (the plugin then leaves every request alone). docs/api.md.

SGLang file touched: ``sglang/srt/arg_groups/attention_hook.py`` (``handle_deterministic_inference``,
wrapped; it runs while SGLang resolves the server's arguments, before any process starts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from relaxkv_sglang.runtime.hooks import Hook
from relaxkv_sglang.request.plan import BACKEND_NAME

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

__all__ = ["REFUSAL", "around_handle_deterministic_inference", "refusal"]

REFUSAL = ("relaxkv-sglang: --enable-deterministic-inference is refused with the relaxkv backends: chunk policies "
           "reuse KV approximately and relaxkv attention is not batch-invariant, so outputs would not be bitwise "
           "equal; drop the flag, or serve without --attention-backend/--radix-cache-backend relaxkv")


def refusal(server_args: "ServerArgs") -> str:
    """:data:`REFUSAL` if ``server_args`` (SGLang's ``ServerArgs``) asks for determinism with a
    relaxkv backend, else "".

    >>> from types import SimpleNamespace as Args
    >>> refusal(Args(enable_deterministic_inference=True, attention_backend="relaxkv")) == REFUSAL
    True
    >>> refusal(Args(enable_deterministic_inference=True, attention_backend="triton", radix_cache_backend=None))
    ''
    """
    if not getattr(server_args, "enable_deterministic_inference", False):
        return ""
    backends = (getattr(server_args, "attention_backend", None), getattr(server_args, "radix_cache_backend", None))
    return REFUSAL if BACKEND_NAME in backends else ""


def around_handle_deterministic_inference(original: Callable[..., Any], server_args: "ServerArgs", *args: Any,
                                          **kwargs: Any) -> Any:
    """Hook on ``handle_deterministic_inference``: stop with :data:`REFUSAL` before SGLang's own check."""
    why = refusal(server_args)
    if why:
        raise SystemExit(why)
    return original(server_args, *args, **kwargs)


#: the SGLang functions this module wraps (registered by ``server/sglang/plugin.py``)
HOOKS = (
    Hook("sglang.srt.arg_groups.attention_hook.handle_deterministic_inference",
         around_handle_deterministic_inference, ("server_args",)),
)
