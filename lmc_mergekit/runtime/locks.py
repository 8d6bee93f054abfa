"""One run at a time on a cache entry: the others wait, then reuse what it wrote.

Two runs of one recipe at once (two shells, two notebooks, a launcher retrying) would both run
the same pass and share its resumable state. An exclusive lock on a file beside the entry makes
the second wait (it says so) and then find the entry complete. The lock is the operating
system's (``filelock``: ``flock`` on POSIX), so a process that dies, even by ``kill -9``,
releases it; on a network file system it is as good as that system's locking.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

LOG = logging.getLogger(__name__)


@contextmanager
def entry_lock(entry: Path) -> Iterator[None]:
    """Hold the lock of the cache entry ``entry`` (the file ``.<name>.lock`` beside it) for the
    block, waiting for another run that holds it."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(entry.parent / f".{entry.name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        LOG.warning("another run is preparing %s; waiting for it to finish", entry)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
