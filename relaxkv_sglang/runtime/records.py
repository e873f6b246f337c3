"""The plugin's records on SGLang's objects: one attribute, :data:`ATTR`, on each object it touches,
holding one typed record per kind. Each kind is declared beside the code that owns it:

=====================================  =================================================  ==============
object                                 record                                             kind's home
=====================================  =================================================  ==============
the plugin's tree cache                the gate's verdict, the served calibration,        ``GateResult``, ``ServedCalibration``,
                                       the repair stages' timing                          ``RepairTiming``
SGLang's ``TokenizerManager``          the gate refusal, the discovery index              ``GateRefusal``, ``DocumentIndex``
SGLang's ``TpModelWorker``             its tree cache, the repair's services              ``WorkerCache``, ``RepairServices``
SGLang's ``ScheduleBatch``             the folded batch of the running forward            ``PendingForward``
the attention backend                  the rows of the running forward                    ``FoldedRows``
a decoder stack                        the repair run after SGLang's layers               ``RepairStage``
SGLang's ``Req``                       the request's plan and chunk bookkeeping           ``RequestState``
=====================================  =================================================  ==============

A record sits in the object's ``__dict__`` (an ``nn.Module``'s too, so its ``__getattr__`` is not involved).
"""

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
