"""Freed memory handed back to the system after a large request, and when the server goes idle.

glibc keeps what a thread frees in that thread's arena for its next allocations, and a server
prepares requests on several threads: a few 20 MB bodies (their JSON, the rendered prompt,
decoded frames) would otherwise hold hundreds of MB for the life of the process. `trim()` asks
glibc to return every arena's free pages (`malloc_trim`); elsewhere it does nothing. `release()`
collects reference cycles first: Python's collector counts objects, not bytes, and behind the
~200,000 objects a loaded model leaves, a full collection may not come for many minutes."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

LARGE_BODY_BYTES = 1 << 20  # bodies from this size on are followed by a trim


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    return getattr(ctypes.CDLL(name), "malloc_trim", None)  # glibc only (not musl, not macOS)


def trim() -> None:
    """Return the free pages of every malloc arena to the system (a no-op without glibc)."""
    if (malloc_trim := _malloc_trim()) is not None:
        malloc_trim(0)


def release() -> None:
    """What an idle process holds beyond its live objects handed back: garbage in reference
    cycles collected, then `trim()`."""
    gc.collect()
    trim()
