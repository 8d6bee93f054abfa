"""Resumable training state: written atomically, read back only by the run that wrote it.

A state file holds an ``identity`` (everything that defines the run: its settings, and for
derived runs the inputs) next to the state itself. A rerun with another identity starts afresh
instead of resuming someone else's run; a kill mid-write leaves the previous file intact.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

IDENTITY = "identity"


def save_state(path: Path, identity, state: dict) -> None:
    """Write ``state`` with its run's ``identity`` to ``path``, replacing the file atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of this process's own: two writers never interleave one file.
    partial = path.with_suffix(f"{path.suffix}.partial-{os.getpid()}")
    torch.save({IDENTITY: identity, **state}, partial)
    os.replace(partial, path)


def link_state(source: Path, path: Path) -> None:
    """Make ``path`` the state file ``source`` (written by :func:`save_state`) too: a hard
    link, replacing ``path`` atomically (a copy where the file system has no links), so a state
    already on disk is not written twice."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f"{path.suffix}.partial-{os.getpid()}")
    partial.unlink(missing_ok=True)
    try:
        os.link(source, partial)
    except OSError:
        shutil.copyfile(source, partial)
    os.replace(partial, path)


def load_state(path: Path | None, identity) -> dict | None:
    """The state saved at ``path`` by a run of this ``identity``; None when there is none (or
    it belongs to another run)."""
    if path is None or not path.is_file():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=False)
    if saved.get(IDENTITY) != identity:
        return None
    return saved
