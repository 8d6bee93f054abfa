"""A Hugging Face cache laid out as huggingface_hub lays it out, written by the tests.

``<cache>/models--org--name/blobs/<sha256>`` holds each file once, ``snapshots/<commit>/<file>``
links to its blob, and ``refs/<branch>`` holds the branch's commit.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def publish(cache: Path, repo: str, folder: Path, commit: str, branch: str | None = "main") -> Path:
    """Put the files of ``folder`` into ``cache`` as the snapshot ``commit`` of ``repo`` (and
    point ``refs/<branch>`` at it); returns the snapshot folder."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for item in sorted(folder.iterdir()):
        if not item.is_file():
            continue
        data = item.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / item.name)
    if branch is not None:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / branch).write_text(commit)
    return snapshot


def commit_id(seed: int) -> str:
    """A 40-hex-digit commit id."""
    return hashlib.sha1(str(seed).encode()).hexdigest()
