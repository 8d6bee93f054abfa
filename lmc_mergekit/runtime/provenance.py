"""The mark a pre-merge pass leaves in every folder it prepared.

The plugin's merge methods combine only folders their own pass prepared: run through plain
mergekit on raw checkpoints they would silently compute a meaningless merge.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

PROVENANCE_FILE = "lmc_prepared.json"


def write_provenance(folder: Path, method: str, details: dict[str, Any]) -> None:
    """Mark ``folder`` as prepared by ``method``'s pre-merge pass."""
    with open(folder / PROVENANCE_FILE, "w", encoding="utf-8") as fp:
        json.dump({"method": method, **details}, fp, indent=2, sort_keys=True)


@cache
def prepared_by(path: str) -> str | None:
    """The method whose pre-merge pass wrote the model folder ``path``, if any."""
    marker = Path(path) / PROVENANCE_FILE
    if not marker.is_file():
        return None
    with open(marker, encoding="utf-8") as fp:
        return json.load(fp).get("method")
