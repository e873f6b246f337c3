"""A failure inside the forward: one request's is served as ``pic`` with a ``not_repaired_reason``
(:func:`served_as_pic`), the batch's others as before; a broken invariant of the plugin's own
bookkeeping (:class:`InvariantError`, never one request's input) stops the server."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class InvariantError(RuntimeError):
    """A broken invariant of the plugin's own bookkeeping (module doc)."""


def served_as_pic(req: Any, failure: str) -> str:
    """The ``not_repaired_reason`` of SGLang's ``req`` whose repair cannot be carried out, logged once."""
    reason = f"{failure} (served as pic)"
    logger.warning("relaxkv: request %s not repaired: %s", getattr(req, "rid", "?"), reason)
    return reason
