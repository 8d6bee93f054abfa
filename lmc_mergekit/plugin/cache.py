"""The plugin's cache: prepared inputs, and the measurements made on merges of them.

``<cache>/<method>/<key>/`` holds one prepared checkpoint per input (``model-<i>``), the pass's
record (``preparation.json``) and its artefacts; the key hashes only what changes the prepared
weights: the method, the section's preparation settings, the package version and the
fingerprint of every input and dependency. ``<cache>/<method>/measurements/<key>/`` holds a
report and its files; its key adds everything else the measurement depends on (all settings,
the merge configuration, the options that change numbers), so changing only how a recipe is
measured reuses the prepared inputs, and rerunning a recipe reuses its measurement.

An entry whose record cannot be read (a truncated or hand-edited JSON file, a disk that filled
up) is debris: it is removed with a warning and computed again.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TypeVar

from mergekit.options import MergeOptions
from pydantic import ValidationError

from lmc_mergekit import __version__
from lmc_mergekit.data.sources import data_fingerprint
from lmc_mergekit.passes.base import Section
from lmc_mergekit.runtime.keys import content_key, fingerprint
from lmc_mergekit.runtime.publish import discard
from lmc_mergekit.runtime.records import Record

LOG = logging.getLogger(__name__)
R = TypeVar("R", bound=Record)

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


def preparation_key(method: str, settings: Section, inputs: list[Path], device: str) -> str:
    """The key of the prepared inputs of ``method`` with ``settings`` for ``inputs`` (in
    recipe order, the base model first), computed on a ``device`` of that type (``cpu``,
    ``cuda``)."""
    payload = {
        "method": method,
        "settings": _with_text(settings.preparation_settings(inputs)),
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


def cached_record(entry: Path, name: str, kind: type[R]) -> R | None:
    """The record ``name`` of the cache ``entry`` read as a ``kind`` when the entry is
    complete, else None. An entry whose record is there but unreadable is removed (with a
    warning), to be computed again."""
    path = entry / name
    if not path.is_file():
        return None
    try:
        return kind.read(path)
    except (UnicodeDecodeError, ValidationError) as error:  # not OSError: no damage of its own
        reason = error.errors()[0]["msg"] if isinstance(error, ValidationError) else str(error)
        LOG.warning("cache entry %s is damaged (%s: %s); computing it again", entry, name, reason)
        discard(entry)
        return None
