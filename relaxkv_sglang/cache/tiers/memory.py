"""Returning the C heap's free pages to the OS, so a host tier's process stays near its bound.

Once glibc has raised its mmap threshold, the per-chunk buffers of spills come from heaps whose free
holes stay resident (docs/experiments/INDEX.md#host-heap-trim). Not glibc: nothing is done.
"""

from __future__ import annotations

import functools

__all__ = ["release_free_heap"]


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim(0)``); True if done."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


@functools.lru_cache(maxsize=1)
def _libc():
    """glibc, or None where there is none."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None
