"""The plugin's records on SGLang's objects (the tree cache, ``TokenizerManager``, ``TpModelWorker``, a
``ScheduleBatch``, ``Req``, the attention backend, a decoder stack): one attribute, :data:`ATTR`, in the
object's ``__dict__`` (an ``nn.Module``'s too), holding one record per kind, each declared by its owner."""

from __future__ import annotations

from typing import Any, Optional, TypeVar

__all__ = ["ATTR", "record", "attach", "detach"]

ATTR = "relaxkv"
Record = TypeVar("Record")


def record(obj: Any, kind: type[Record], create: bool = True) -> Optional[Record]:
    """``obj``'s record of ``kind``: made from ``kind()`` on first use (with ``create`` False: None instead)."""
    held = vars(obj).get(ATTR, {}).get(kind)
    if held is None and create:
        held = attach(obj, kind())
    return held


def attach(obj: Any, held: Record) -> Record:
    """Make ``held`` ``obj``'s record of its kind (its exact type), replacing any."""
    vars(obj).setdefault(ATTR, {})[type(held)] = held
    return held


def detach(obj: Any, kind: type) -> None:
    """Remove ``obj``'s record of ``kind``, if any."""
    held = vars(obj).get(ATTR)
    if held is not None:
        held.pop(kind, None)
        if not held:
            del vars(obj)[ATTR]
