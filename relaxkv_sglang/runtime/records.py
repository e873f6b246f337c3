"""The plugin's state on SGLang's objects: one attribute, :data:`ATTR`, on each object it touches,
holding one typed record for that kind of object.

======================================  =======================  =========================================
object                                  record                   what it holds
======================================  =======================  =========================================
the plugin's tree cache                 :class:`CacheState`      the startup gate's verdict, the calibration
SGLang's ``TokenizerManager``           :class:`TokenizerState`  the gate refusal, the discovery index
SGLang's ``TpModelWorker``              :class:`WorkerState`     its scheduler's relaxkv tree cache
SGLang's ``ScheduleBatch``              :class:`BatchState`      the folded batch of the running forward
an attention backend, a decoder stack   :class:`ReaderState`     the fold's decision for that forward
SGLang's ``Req``                        ``plan.RequestState``    the request's plan and chunk bookkeeping
======================================  =======================  =========================================

A record sits in the object's ``__dict__`` (an ``nn.Module``'s too, so its ``__getattr__`` is not
involved); an object holds one kind of record, :func:`record` refuses another.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, TypeVar

from relaxkv_sglang.runtime.failures import InvariantError

if TYPE_CHECKING:
    from relaxkv_sglang.request.doc_index import DocumentIndex
    from relaxkv_sglang.server.gate import GateResult
    from relaxkv_sglang.repair.sglang.served_calibration import ServedCalibration
    from relaxkv_sglang.forward.context import ForwardContext, PendingForward
    from relaxkv_sglang.cache.sglang.relaxkv_cache import RelaxKVCache

__all__ = ["ATTR", "record", "attach", "detach", "CacheState", "TokenizerState", "WorkerState", "BatchState",
           "ReaderState"]

ATTR = "relaxkv"
Record = TypeVar("Record")


def record(obj: Any, kind: type[Record], create: bool = True) -> Optional[Record]:
    """``obj``'s record of ``kind``: made from ``kind``'s defaults on first use (with ``create``
    False: None instead); InvariantError when ``obj`` holds a record of another kind."""
    held = vars(obj).get(ATTR)
    if held is None:
        return attach(obj, kind()) if create else None
    if not isinstance(held, kind):
        raise InvariantError(f"relaxkv: {type(obj).__name__} holds a {type(held).__name__}, not a {kind.__name__}")
    return held


def attach(obj: Any, held: Record) -> Record:
    """Make ``held`` the record of ``obj``, replacing any."""
    vars(obj)[ATTR] = held
    return held


def detach(obj: Any) -> None:
    """Remove ``obj``'s record, if any."""
    vars(obj).pop(ATTR, None)


@dataclasses.dataclass
class CacheState:
    """The tree cache's: ``gate`` the startup gate's verdict (None before it ran), ``calibration``
    the served calibration and budget settings (None before startup chose them), ``repair_stages`` and
    ``repair_seconds`` the repair stages run and their wall time (collectives included)."""

    gate: Optional["GateResult"] = None
    calibration: Optional["ServedCalibration"] = None
    repair_stages: int = 0
    repair_seconds: float = 0.0


@dataclasses.dataclass
class TokenizerState:
    """The HTTP process's: ``gate_refusal`` why chunk policies are refused, "" when served (None
    until the scheduler was asked), ``document_index`` the discovered chunks (None until made)."""

    gate_refusal: Optional[str] = None
    document_index: Optional["DocumentIndex"] = None


@dataclasses.dataclass
class WorkerState:
    """A scheduler worker's: ``cache`` its relaxkv tree cache."""

    cache: Optional["RelaxKVCache"] = None


@dataclasses.dataclass
class BatchState:
    """A ``ScheduleBatch``'s: ``pending`` its folded batch while its forward runs."""

    pending: Optional["PendingForward"] = None


@dataclasses.dataclass
class ReaderState:
    """An object that reads the fold's decision during a forward: ``context`` that decision."""

    context: Optional["ForwardContext"] = None
