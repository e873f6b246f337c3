"""An SGLang function the plugin wraps, declared in the ``HOOKS`` of the adapter module holding the wrapper."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Hook:
    """``target``: the dotted SGLang function or method wrapped; ``around(original, *args, **kwargs)`` runs in its
    place; ``params``: the target's first parameters the wrapper relies on (checked against SGLang at startup)."""

    target: str
    around: Callable[..., Any]
    params: tuple[str, ...]
