"""Handing memory a stage freed back to the system before the next stage starts.

glibc keeps freed blocks below its (growing) mmap threshold in the process's heap, so a stage
that allocated and freed a few hundred MiB of tensors leaves that much resident, and the next
stage's allocations add to it: the whole command's peak becomes the sum of its stages'.
``malloc_trim`` returns the free heap; elsewhere than glibc it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


@functools.cache
def _trim():
    name = ctypes.util.find_library("c")
    library = ctypes.CDLL(name) if name else None
    return getattr(library, "malloc_trim", None)


def release_freed_memory() -> None:
    """Collect garbage and return the heap's free memory to the system (where glibc can)."""
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Return the heap's free memory to the system (where glibc can), without collecting
    garbage: cheap enough to run between the pieces of one computation."""
    trim = _trim()
    if trim is not None:
        trim(0)
