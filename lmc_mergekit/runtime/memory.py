"""Memory: handing what a stage freed back to the system before the next stage starts, and
knowing before heavy work whether its estimated peak fits in what is available.

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
from pathlib import Path

from lmc_mergekit.errors import LmcError


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


GIB = 1024**3


def available_memory() -> int:
    """Bytes this process can still use without swapping or being killed: the kernel's
    ``MemAvailable``, or less where a memory cgroup (v1 or v2) caps the process (its limit
    less what it holds, reclaimable file pages not counted)."""
    available = _meminfo().get("MemAvailable", 0)
    for limit, used in _cgroup_limits():
        available = min(available, max(0, limit - used))
    return available


def require_memory(need: int, what: str, fits: str) -> None:
    """A one-line error where ``need`` bytes (the estimated peak of ``what`` beyond what the
    process holds now) exceed :func:`available_memory`; ``fits`` says what would fit."""
    available = available_memory()
    if need > available:
        raise LmcError(
            f"{what} needs about {need / GIB:.1f} GiB more memory at its peak (estimated) and "
            f"{available / GIB:.1f} GiB is available; {fits}"
        )


def _meminfo() -> dict[str, int]:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    fields = {}
    for line in lines:
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            fields[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return fields


def _cgroup_limits() -> list[tuple[int, int]]:
    """``(limit, used)`` of each memory cgroup above this process that sets a limit, v2 and
    v1 (``used`` without inactive file pages, which the kernel reclaims before it kills)."""
    found = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root, files = Path("/sys/fs/cgroup"), ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            root = Path("/sys/fs/cgroup/memory")
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        # The process's cgroup as mounted: where the mount is namespaced, its root is an
        # ancestor of the cgroup, and the path's leading parts are not in it.
        parts = Path(path.lstrip("/")).parts
        folders = [root.joinpath(*parts[start:]) for start in range(len(parts) + 1)]
        folder = next((f for f in folders if (f / files[0]).is_file()), None)
        if folder is None:
            continue
        while True:
            limit = _read_number(folder / files[0])
            if limit is not None and limit < 1 << 60:
                stat = _memory_stat(folder / "memory.stat")
                used = (_read_number(folder / files[1]) or 0) - stat.get(files[2], 0)
                found.append((limit, max(used, 0)))
            if folder == root:
                break
            folder = folder.parent
    return found


def _read_number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _memory_stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v) for k, _, v in (line.partition(" ") for line in lines) if v.isdigit()}
