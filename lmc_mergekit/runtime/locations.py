"""Where the tool keeps what it makes: the cache of prepared inputs, the zoo, the real models
of the benchmarks (imports nothing heavy: every command reads it)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$LMC_MERGEKIT_CACHE``, else ``~/.cache/lmc-mergekit``."""
    return Path(os.environ.get("LMC_MERGEKIT_CACHE", "~/.cache/lmc-mergekit")).expanduser()
