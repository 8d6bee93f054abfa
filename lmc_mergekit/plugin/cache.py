"""The cache of prepared inputs, keyed by what went into them.

A key hashes the method, its settings, the package version and a fingerprint of every input
checkpoint (file names, sizes and modification times, as build tools do: content hashes of
multi-GB shards would cost as much as the pass itself).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pydantic import BaseModel

COMPLETE_FILE = "complete.json"


def default_cache_dir() -> Path:
    """``$LMC_MERGEKIT_CACHE``, else ``~/.cache/lmc-mergekit``."""
    return Path(os.environ.get("LMC_MERGEKIT_CACHE", "~/.cache/lmc-mergekit")).expanduser()


def fingerprint(folder: Path) -> list:
    """Names, sizes and mtimes of the files that define a checkpoint."""
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".json"))
    return [str(folder)] + [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def cache_key(method: str, settings: BaseModel, inputs: list[Path]) -> str:
    """A short hex key for prepared inputs."""
    from lmc_mergekit import __version__

    payload = {
        "method": method,
        # Settings that only steer the merge after the pass do not make new prepared inputs.
        "settings": settings.model_dump(mode="json", exclude=set(settings.merge_only)),
        "version": __version__,
        "inputs": [fingerprint(path) for path in inputs],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]
