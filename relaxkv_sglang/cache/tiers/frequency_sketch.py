"""Admission's frequencies: approximate access counts of chunk keys (TinyLFU's sketch).

:class:`FrequencySketch` is a count-min sketch: 4 rows of 4-bit counters (saturating at 15),
each key hashed to one counter per row, its estimate the minimum of its counters, so it never
under-counts since the last halving. Every ``sample_size`` increments (default ``10 * width``)
every counter is halved, so old popularity fades (TinyLFU, Einziger et al. 2017). The host tier
admits a chunk that needs victims only if its estimate beats every victim's
(:meth:`~.host.HostTier.would_admit`): a flood of one-shot keys (frequency 1) cannot push out
chunks used twice or more.
"""

from __future__ import annotations

import hashlib

__all__ = ["FrequencySketch"]


def _key_hash(key: str) -> int:
    """64 bits of a key: its first 16 hex chars (keys are sha256 hex), else a blake2b of it."""
    try:
        return int(key[:16], 16)
    except ValueError:
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


class FrequencySketch:
    """Approximate access counts (count-min sketch, 4 rows of 4-bit counters, periodic halving)."""

    ROWS = 4
    MAX = 15

    def __init__(self, width: int = 4096, sample_size: int | None = None) -> None:
        """
        Args:
            width: counters per row (rounded up to a power of two, at least 16).
            sample_size: increments between halvings (default ``10 * width``).
        """
        w = 1
        while w < max(16, width):
            w <<= 1
        self.width = w
        self.sample_size = sample_size or 10 * w
        self.table = [bytearray(w) for _ in range(self.ROWS)]
        self.additions = 0

    def _indices(self, key: str) -> list[int]:
        h = _key_hash(key)
        mask = self.width - 1
        out = []
        for row in range(self.ROWS):
            h = (h * 0x9E3779B97F4A7C15 + row + 1) & 0xFFFFFFFFFFFFFFFF
            out.append((h >> 20) & mask)
        return out

    def increment(self, key: str) -> None:
        for row, i in zip(self.table, self._indices(key)):
            if row[i] < self.MAX:
                row[i] += 1
        self.additions += 1
        if self.additions >= self.sample_size:
            for row in self.table:
                for i in range(self.width):
                    row[i] >>= 1
            self.additions //= 2

    def estimate(self, key: str) -> int:
        return min(row[i] for row, i in zip(self.table, self._indices(key)))
