"""Returning the C heap's free pages to the OS, so a host tier's process stays near its bound.

The per-chunk buffers a server makes while spilling (``>= 128 KiB``) come, once glibc has raised
its mmap threshold, from the heap and from the arenas of torch's threads, whose free holes stay
resident: measured here, a process pushing 4x a 64 MiB tier through it grew by 110-133 MiB in
some runs, 70 in others. The host tier calls :func:`release_free_heap` after every
``capacity / 16`` bytes (at least 8 MiB) it stores. (Pinning the mmap threshold instead made
torch's CPU forward 60% slower.) Not glibc: nothing is done.
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
