"""Folders that appear only when complete.

A folder is written inside a hidden staging folder beside its final place,
``.<name>.partial-<host>-<pid>-<random>/<name>``, and renamed into place only when everything
succeeded; on any Python-level error the staging folder is removed. The inner folder already
has its final name (mergekit titles its model card after the folder it writes) and the usual
permissions (``mkdtemp`` makes only the hidden outer one private). A process killed outright
(``kill -9``) cannot clean up: its staging folder names its host and process id, so the next
run that publishes beside it removes it once that process is gone.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from lmc_mergekit.errors import LmcError

STAGING_MARK = ".partial-"
_STAGING_NAME = re.compile(r"^\.(?P<name>.+)\.partial-(?P<host>.+)-(?P<pid>\d+)-[^-]+$")


def check_output_free(out: Path, overwrite: bool = False) -> None:
    """Refuse an existing non-empty output folder unless the user asked to overwrite it."""
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise LmcError(f"output {str(out)!r} already exists; remove it or pass --overwrite")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_staging(parent: Path, name: str | None = None) -> list[Path]:
    """Remove the staging folders in ``parent`` (of ``name`` only, if given) whose process on
    this host has ended; return what was removed. Folders of live processes, of other hosts
    (a shared file system) and anything not named like a staging folder are left alone."""
    removed = []
    if not parent.is_dir():
        return removed
    host = _host()
    for path in parent.glob(f".{'*' if name is None else _glob_escape(name)}{STAGING_MARK}*"):
        match = _STAGING_NAME.match(path.name)
        if match is None or match["host"] != host or (name is not None and match["name"] != name):
            continue
        if not _alive(int(match["pid"])):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _glob_escape(text: str) -> str:
    """``text`` with glob's special characters taken literally."""
    return re.sub(r"([*?\[])", r"[\1]", text)


Existing = Literal["refuse", "replace", "keep"]


@contextmanager
def staged_folder(
    out: str | Path, existing: Existing = "refuse", sweep_siblings: bool = False
) -> Iterator[Path]:
    """Yield an empty folder named like ``out`` inside a hidden staging folder beside it; on
    success it becomes ``out``, on any error it is removed.

    ``existing`` says what happens to a folder already at ``out``: ``refuse`` it (an error
    before any work, unless it is empty), ``replace`` it, or ``keep`` it and drop the staged
    one (for caches, whose entries only ever appear complete: a concurrent run finished
    first). Stale staging folders of ``out`` from dead processes are removed first (of every
    name in ``out``'s parent with ``sweep_siblings``, for folders only this tool writes into).
    """
    out = Path(out).expanduser().absolute()
    if existing == "refuse":
        check_output_free(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out.parent, None if sweep_siblings else out.name)
    prefix = f".{out.name}{STAGING_MARK}{_host()}-{os.getpid()}-"
    outer = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    inner = outer / out.name
    try:
        inner.mkdir()
        yield inner
        if out.exists() and existing == "keep":
            return
        if out.exists():
            shutil.rmtree(out) if out.is_dir() and not out.is_symlink() else out.unlink()
        inner.rename(out)
    finally:
        shutil.rmtree(outer, ignore_errors=True)
