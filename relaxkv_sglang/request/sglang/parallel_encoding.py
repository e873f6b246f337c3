"""SGLang's parallel encoding, served as chunk reuse.

``forks.join(mode="concate_and_append")`` posts ``/concate_and_append_request`` with frontend ids
no server request carried (stock SGLang: 404), so the branches are tied to the joined request by
content (:class:`~.join_registry.JoinRegistry`) and each branch is marked in
``custom_params.relaxkv_chunks`` for the native path (:mod:`.api`). Rules and policy:
``docs/api.md`` section 5. Without ``--radix-cache-backend relaxkv`` the route answers 200 and
marks nothing.

SGLang file touched: ``entrypoints/http_server.py``: the route added to its FastAPI ``app``;
``serve_generate_request`` (``POST /generate`` after its contract check) wrapped."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Optional

from fastapi import Request

from relaxkv_sglang.runtime.hooks import Hook
from relaxkv_sglang.repair.policies import Policy
from relaxkv_sglang.request.schema import CHUNKS, POLICY
from relaxkv_sglang.runtime.settings import server_settings
from relaxkv_sglang.request.sglang.join_registry import JoinRegistry
from relaxkv_sglang.request.plan import chunk_tree_served

if TYPE_CHECKING:
    from fastapi.responses import ORJSONResponse
    from sglang.srt.managers.io_struct import GenerateReqInput

ROUTE = "/concate_and_append_request"
JOIN_POLICY = Policy.PIC.value  # what a joined request naming no policy gets when the server default reuses nothing

MAX_BRANCHES = CHUNKS.max_chunks  # a join's branches become chunks, and a request holds at most that many


REGISTRY = JoinRegistry()


def _merge_chunks(existing: Any, extra: Iterable[tuple[int, int]]) -> Optional[list[int]]:
    """``existing`` flat offsets plus the non-overlapping ``extra`` spans, sorted; None if malformed."""
    if existing is None:
        pairs: list[tuple[int, int]] = []
    elif isinstance(existing, (list, tuple)) and len(existing) % 2 == 0 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in existing
    ):
        pairs = [(existing[i], existing[i + 1]) for i in range(0, len(existing), 2)]
    else:
        return None
    merged = list(pairs)
    for s, e in extra:
        if all(e <= ps or s >= pe for ps, pe in pairs):
            merged.append((s, e))
    merged.sort()
    return [x for pair in merged for x in pair]


def apply_to_request(
    obj: GenerateReqInput, registry: JoinRegistry = REGISTRY, default_policy: Optional[str] = None,
) -> bool:
    """Record commits and mark joined branches in a ``GenerateReqInput`` (in place); whether it changed."""
    texts = obj.text
    if texts is None:
        return False
    single = isinstance(texts, str)
    items = [texts] if single else list(texts)
    sps = obj.sampling_params
    if isinstance(sps, list):
        if len(sps) != len(items):
            return False  # SGLang's own validation reports it
        sp_items = [sp if isinstance(sp, dict) else {} for sp in sps]
    else:
        sp_items = [sps if isinstance(sps, dict) else {} for _ in items]
    if default_policy is None:
        default_policy = server_settings().default_policy
    changed = False
    new_items = []
    for text, sp in zip(items, sp_items):
        new_sp = sp
        cp = sp.get("custom_params")
        if isinstance(text, str) and (cp is None or isinstance(cp, dict)):
            policy = (cp or {}).get(POLICY.name)
            if policy is None:
                add_policy = None if POLICY.reuses_chunks(default_policy) else JOIN_POLICY
                allowed = default_policy != Policy.FULL
            else:  # a malformed policy is left to the native path, which reports it
                add_policy, allowed = None, POLICY.reuses_chunks(policy)
            spans = registry.spans_for(text) if allowed else []
            if spans:
                chunks = _merge_chunks((cp or {}).get(CHUNKS.name), spans)
                if chunks is not None:
                    new_cp = dict(cp or {}, **{CHUNKS.name: chunks})
                    if add_policy is not None:
                        new_cp[POLICY.name] = add_policy
                    new_sp = dict(sp, custom_params=new_cp)
                    changed = True
        new_items.append(new_sp)
    if single and isinstance(texts, str) and not obj.stream and sp_items[0].get("max_new_tokens") == 0:
        registry.commit(texts)
    if changed:
        obj.sampling_params = new_items[0] if single else new_items
    return changed


def _relaxkv_served() -> bool:
    from sglang.srt.entrypoints import http_server

    state = http_server.get_global_state()
    server_args = getattr(getattr(state, "tokenizer_manager", None), "server_args", None)
    return chunk_tree_served(server_args)


async def around_serve_generate_request(
    original: Callable[..., Awaitable[Any]], obj: GenerateReqInput, request: Optional[Request] = None, *args: Any,
    **kwargs: Any,
) -> Any:
    """Hook on ``http_server.serve_generate_request`` (``POST /generate``)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    if isinstance(obj, GenerateReqInput) and _relaxkv_served():
        apply_to_request(obj)
    return await original(obj, request, *args, **kwargs)


async def concate_and_append_request(request: Request) -> ORJSONResponse:
    """``POST /concate_and_append_request {"src_rids": [str, ...], "dst_rid": str}``."""
    from fastapi.responses import ORJSONResponse

    def bad(field: str, message: str) -> ORJSONResponse:
        """A 400 naming ``field``, in /generate's error format."""
        return ORJSONResponse({"error": {"message": f"invalid {field}: {message}"}}, status_code=400)

    try:
        body = await request.json()
    except ValueError as exc:
        return bad("body", f"not JSON ({exc})")
    if not isinstance(body, dict):
        return bad("body", "must be a JSON object")
    src = body.get("src_rids")
    if not isinstance(src, list) or not all(isinstance(r, str) for r in src):
        return bad("src_rids", "must be a list of strings")
    if len(src) > MAX_BRANCHES:
        return bad("src_rids", f"at most {MAX_BRANCHES} branches, got {len(src)}")
    if not isinstance(body.get("dst_rid"), str):
        return bad("dst_rid", "must be a string")
    if _relaxkv_served():
        REGISTRY.join(len(src))
    return ORJSONResponse({"success": True, "branches": len(src)})


def register_http_routes() -> None:
    """Add :data:`ROUTE` to SGLang's FastAPI app (idempotent); only the HTTP process serves it."""
    from sglang.srt.entrypoints.http_server import app

    if any(getattr(route, "path", None) == ROUTE for route in app.router.routes):
        return
    app.add_api_route(ROUTE, concate_and_append_request, methods=["POST"])


#: the SGLang functions this module wraps (registered by ``server/sglang/plugin.py``)
HOOKS = (
    Hook("sglang.srt.entrypoints.http_server.serve_generate_request",
         around_serve_generate_request, ("obj", "request")),
)
