"""Admission's frequencies: approximate access counts of chunk keys (TinyLFU, Einziger et al. 2017).

A key's estimate is the least of its counters, one per row, so it never under-counts since the last
halving; halving every ``sample_size`` increments lets old popularity fade. The host tier admits a
chunk needing victims only if its estimate beats every victim's (:meth:`~.host.HostTier.would_admit`):
a flood of one-shot keys cannot push out chunks used twice or more.
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
    """A count-min sketch: ``ROWS`` rows of 4-bit counters, saturating at ``MAX``."""

    ROWS = 4
    MAX = 15

    def __init__(self, width: int = 4096, sample_size: int | None = None) -> None:
        """``width``: counters per row, rounded up to a power of two >= 16."""
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
