"""Content keys: short stable hashes of what went into a cached artefact.

Inputs that are folders of files are identified by their fingerprints (file names, sizes and
modification times, as build tools do): content hashes of multi-GB shards would cost as much as
the work the cache saves.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# The files that define a checkpoint folder.
CHECKPOINT_SUFFIXES = (".safetensors", ".json")


def content_key(payload, length: int = 24) -> str:
    """A hex key of ``length`` characters for a JSON-serialisable ``payload``."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:length]


def fingerprint(folder: Path) -> list:
    """The folder's path and the name, size and mtime of each file that defines a checkpoint."""
    files = sorted(p for p in folder.iterdir() if p.suffix in CHECKPOINT_SUFFIXES)
    return [str(folder)] + [[p.name, *size_and_mtime(p)] for p in files]


def size_and_mtime(path: Path) -> tuple[int, int]:
    """A file's size and modification time in nanoseconds."""
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns
