"""Folders that appear only when complete.

A folder is written inside a hidden staging folder beside its final place,
``.<name>.partial-<host>-<pid>-<random>/<name>``, and renamed into place only when everything
succeeded; on any Python-level error the staging folder is removed. The inner folder already
has its final name (mergekit titles its model card after the folder it writes) and the usual
permissions (``mkdtemp`` makes only the hidden outer one private). A process killed outright
(``kill -9``) cannot clean up: its staging folder names its host and process id, so the next
run that publishes beside it removes it once that process is gone.

Replacing a folder never leaves a moment without a complete one: the old folder is renamed
aside into the staging folder (``<staging>/.previous``), the new one renamed in, and only then
is the old one deleted; if the rename-in fails the old one goes back. A process killed between
the two renames leaves the old folder in its staging folder, and the sweep that removes that
staging folder first renames it back into place.
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
#: Where a replaced folder waits, inside the staging folder, until the new one is in place.
PREVIOUS = ".previous"
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
            _put_back(path / PREVIOUS, parent / match["name"])
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def discard(folder: Path) -> None:
    """Delete ``folder`` without anyone seeing it half deleted: it is renamed into a staging
    folder of this process first (one that is gone already, e.g. discarded by a concurrent run,
    is fine)."""
    prefix = f".{folder.name}{STAGING_MARK}{_host()}-{os.getpid()}-"
    aside = Path(tempfile.mkdtemp(prefix=prefix, dir=folder.parent))
    try:
        folder.rename(aside / folder.name)
    except FileNotFoundError:
        pass
    finally:
        shutil.rmtree(aside, ignore_errors=True)


@contextmanager
def scratch_folder(parent: Path, name: str) -> Iterator[Path]:
    """A private folder in ``parent`` for this process's working files, named like a staging
    folder (so that the one of a killed run is swept, here by the next run using ``name``),
    removed on exit."""
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(parent, name)
    prefix = f".{name}{STAGING_MARK}{_host()}-{os.getpid()}-"
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _put_back(previous: Path, out: Path) -> None:
    """Rename a folder a killed run had moved aside back to ``out``, unless ``out`` exists."""
    if (previous.exists() or previous.is_symlink()) and not (out.exists() or out.is_symlink()):
        try:
            previous.rename(out)
        except OSError:  # another process put something there first: theirs stays
            pass


def _glob_escape(text: str) -> str:
    """``text`` with glob's special characters taken literally."""
    return re.sub(r"([*?\[])", r"[\1]", text)


Existing = Literal["refuse", "replace", "keep"]


@contextmanager
def staged_folder(
    out: str | Path,
    existing: Existing = "refuse",
    sweep_siblings: bool = False,
    complete: str | None = None,
) -> Iterator[Path]:
    """Yield an empty folder named like ``out`` inside a hidden staging folder beside it; on
    success it becomes ``out``, on any error it is removed.

    ``existing`` says what happens to a folder found at ``out`` (when starting, and again when
    publishing): ``refuse`` it unless it is empty (a one-line error), ``replace`` it, or
    ``keep`` it and drop the staged one when it holds the file ``complete`` (for caches: a
    concurrent run published first; a folder without that file is debris and is replaced).
    Stale staging folders of ``out`` from dead processes are removed first (of every name in
    ``out``'s parent with ``sweep_siblings``, for folders only this tool writes into).
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
        _publish(inner, out, existing, complete)
    finally:
        shutil.rmtree(outer, ignore_errors=True)


def _publish(inner: Path, out: Path, existing: Existing, complete: str | None) -> None:
    """Rename ``inner`` to ``out``; an existing ``out`` is moved aside into ``inner``'s staging
    folder first (deleted with it once ``inner`` is in place, put back if that fails)."""

    def kept() -> bool:
        return existing == "keep" and (complete is None or (out / complete).exists())

    if kept():
        return
    if existing == "refuse":
        check_output_free(out)  # something appeared there while this run worked
    previous = None
    if out.exists() or out.is_symlink():
        previous = inner.parent / PREVIOUS
        try:
            out.rename(previous)
        except OSError as error:
            raise LmcError(f"could not move the old {out} aside to replace it ({error})") from None
    try:
        inner.rename(out)
    except OSError:
        if previous is not None:
            _put_back(previous, out)  # unless a concurrent run published its own there
        if kept():  # a concurrent run published in between
            return
        raise LmcError(
            f"could not publish {out}: something was written there while this run worked; run again"
        ) from None
