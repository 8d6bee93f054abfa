"""The plugin's cache: prepared inputs, and the measurements made on merges of them.

``<cache>/<method>/<key>/`` holds one prepared checkpoint per input (``model-<i>``), the pass's
record (``preparation.json``) and its artefacts; the key hashes only what changes the prepared
weights: the method, the section's preparation settings, the package version and the
fingerprint of every input and dependency. ``<cache>/<method>/measurements/<key>/`` holds a
report and its files; its key adds everything else the measurement depends on (all settings,
the merge configuration, the options that change numbers), so changing only how a recipe is
measured reuses the prepared inputs, and rerunning a recipe reuses its measurement.
"""

from __future__ import annotations

import os
from pathlib import Path

from mergekit.options import MergeOptions

from lmc_mergekit import __version__
from lmc_mergekit.data.sources import data_fingerprint
from lmc_mergekit.passes.base import Section
from lmc_mergekit.runtime.keys import content_key, fingerprint

PREPARATION_FILE = "preparation.json"
ARTEFACTS_DIR = "artefacts"
MEASUREMENTS_DIR = "measurements"
# mergekit options that can change the numbers a measurement reports.
NUMERIC_OPTIONS = {
    "allow_crimes",
    "unsafe_truncate_embeddings",
    "lora_merge_dtype",
    "cuda",
    "device",
    "trust_remote_code",
    "random_seed",
}


def default_cache_dir() -> Path:
    """``$LMC_MERGEKIT_CACHE``, else ``~/.cache/lmc-mergekit``."""
    return Path(os.environ.get("LMC_MERGEKIT_CACHE", "~/.cache/lmc-mergekit")).expanduser()


def preparation_key(method: str, settings: Section, inputs: list[Path], device: str) -> str:
    """The key of the prepared inputs of ``method`` with ``settings`` for ``inputs`` (in
    recipe order, the base model first), computed on a ``device`` of that type (``cpu``,
    ``cuda``)."""
    payload = {
        "method": method,
        "settings": _with_text(settings.preparation_settings()),
        "version": __version__,
        "inputs": [fingerprint(path) for path in inputs + settings.dependencies()],
        "device": device,
    }
    return content_key(payload)


def measurement_key(
    prepared_key: str, settings: Section, merge_config: dict, options: MergeOptions
) -> str:
    """The key of a measurement of the merge ``merge_config`` of prepared inputs."""
    payload = {
        "prepared": prepared_key,
        "settings": _with_text(settings.model_dump(mode="json")),
        "merge": merge_config,
        "options": options.model_dump(mode="json", include=NUMERIC_OPTIONS),
        "version": __version__,
    }
    return content_key(payload)


def _with_text(settings: dict) -> dict:
    """Settings that name a text (``data``) keyed by its files too, not only by its path."""
    if "data" not in settings:
        return settings
    return {**settings, "text": data_fingerprint(settings["data"], settings.get("field", "text"))}
