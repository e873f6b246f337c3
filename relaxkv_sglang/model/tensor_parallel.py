"""Tensor-parallel ranks as the repair sees them: one sum, one exchange of digests, nothing else.

What the repair decides on must be the same on every rank, or the ranks run different rows and their
collectives no longer match; a rank holds H / tp heads, so its share of a decision is summed (what, and why
that is exact: docs/install.md, "Tensor parallelism"). :data:`ONE_RANK`: tp 1 and the torch reference.
:func:`check_same`: a disagreement raises :class:`RankDisagreement` on every rank, not a hang in a collective.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Protocol, Sequence

import torch

from relaxkv_sglang.runtime.failures import InvariantError

__all__ = ["TensorParallel", "OneRank", "ONE_RANK", "TimedCollectives", "CollectiveTally", "RankDisagreement",
           "digest", "check_same", "place_shard"]


class RankDisagreement(InvariantError):
    """Tensor-parallel ranks decided differently (the message names what and where); stops the server."""


@dataclasses.dataclass
class CollectiveTally:
    """Collectives one rank ran: ``calls``, ``elements`` moved (each rank's input), ``seconds`` spent in them."""

    calls: int = 0
    elements: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"calls": self.calls, "elements": self.elements, "seconds": round(self.seconds, 6)}


class TensorParallel(Protocol):
    """One tensor-parallel group (``size`` 1: no collective ever runs). ``checks``: whether
    :func:`check_same` compares decisions (a setting: one small gather per checked decision)."""

    size: int
    rank: int
    checks: bool
    tally: CollectiveTally

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x (any shape, the same on every rank) -> the elementwise sum over ranks (may reuse x's storage)."""

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x int64 [n] (the same n on every rank) -> int64 [size, n], row r rank r's."""


class OneRank:
    """A group of one: every reduction is the identity, nothing is exchanged."""

    size = 1
    rank = 0
    checks = False

    def __init__(self) -> None:
        self.tally = CollectiveTally()

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x[None]


ONE_RANK = OneRank()


class TimedCollectives:
    """Base of a real group: times and counts each collective in :attr:`tally` (subclasses: ``_sum``, ``_gather``)."""

    def __init__(self, size: int, rank: int, checks: bool) -> None:
        self.size, self.rank, self.checks = size, rank, checks
        self.tally = CollectiveTally()

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return self._timed(self._sum, x.contiguous())

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return self._timed(self._gather, x.to(torch.int64).contiguous()).reshape(self.size, -1)

    def _timed(self, collective, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = collective(x)
        self.tally.calls += 1
        self.tally.elements += x.numel()
        self.tally.seconds += time.perf_counter() - start
        return out

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def digest(*parts: torch.Tensor | int | float | str) -> int:
    """A 63-bit digest of tensors' values and shapes (and scalars), equal across processes for equal inputs."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        if isinstance(part, torch.Tensor):
            t = part.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy().tobytes())
        else:
            h.update(repr(part).encode())
    return int.from_bytes(h.digest(), "little") >> 1


def check_same(ranks: TensorParallel, digests: Sequence[int], labels: Sequence[str], what: str) -> None:
    """Raise :class:`RankDisagreement` on every rank when some rank's ``digests`` differ (one gather of
    ``len(digests)`` int64, if ``ranks.checks``); ``labels[i]`` names entry i (e.g. ``"layer 3"``)."""
    if ranks.size == 1 or not ranks.checks or not digests:
        return
    mine = torch.tensor(list(digests), dtype=torch.int64)
    every = ranks.gather(mine)
    differs = (every != every[0]).any(dim=0).nonzero().flatten()
    if differs.numel():
        i = int(differs[0])
        seen = ", ".join(f"rank {r}: {int(every[r, i]):x}" for r in range(ranks.size))
        raise RankDisagreement(f"relaxkv: tensor-parallel ranks decided {what} differently at {labels[i]} "
                               f"({seen}; {differs.numel()} of {len(digests)} entries differ): their collectives "
                               "would no longer match, so the server stops instead of hanging")


def place_shard(shard: torch.Tensor, ranks: TensorParallel) -> torch.Tensor:
    """shard [..., m] this rank's slice of a last dim split evenly in rank order -> [..., m * size], zeros but
    at ``[rank * m, (rank + 1) * m)``: summed over ranks it is the whole, as an all-gather would give it."""
    if ranks.size == 1:
        return shard
    m = shard.shape[-1]
    whole = shard.new_zeros(*shard.shape[:-1], m * ranks.size)
    whole[..., ranks.rank * m:(ranks.rank + 1) * m] = shard
    return whole
