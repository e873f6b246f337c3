"""What a failure inside the forward does: one request's is served as ``pic``; the plugin's stops.

* A request whose repair cannot be carried out (its query pass cannot be set up, its plan cannot
  be made) is served as ``pic``, the rows SGLang's forward computed, with a
  ``not_repaired_reason`` naming the failure, logged once (:func:`served_as_pic`); the batch's
  other requests are served as before.
* A broken invariant of the plugin's own bookkeeping (:class:`InvariantError`), never one
  request's input, is the only error the forward's stages let out of the scheduler:
  :mod:`relaxkv_sglang.forward.pipeline` logs it in one line before SGLang stops the server.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class InvariantError(RuntimeError):
    """A broken invariant of the plugin's own bookkeeping (module doc)."""


def served_as_pic(req: Any, failure: str) -> str:
    """The ``not_repaired_reason`` of a request whose repair cannot be carried out, logged once (a
    request's repair is decided once per prefill of its prompt). ``req``: SGLang's ``Req``;
    ``failure``: what went wrong."""
    reason = f"{failure} (served as pic)"
    logger.warning("relaxkv: request %s not repaired: %s", getattr(req, "rid", "?"), reason)
    return reason
