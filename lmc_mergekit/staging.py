"""Output folders that appear only when complete: write into a hidden sibling, rename at the end."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lmc_mergekit.errors import LmcError


def check_output_free(out: Path, overwrite: bool = False) -> None:
    """Refuse an existing non-empty output folder unless the user asked to overwrite it."""
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise LmcError(f"output {str(out)!r} already exists; remove it or pass --overwrite")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def staged_output(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; on success it replaces ``out``, on any error it is
    removed, so a half-written output never looks complete."""
    out = Path(out).expanduser().absolute()
    check_output_free(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        # mkdtemp makes the folder private (0700); the output gets the usual permissions.
        tmp.chmod(0o777 & ~_umask())
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
