"""Every measured block in the docs, the command that writes it, and which are stale.

    python benchmarks/docs_blocks.py [list|stale] [FILE ...]

``list`` prints each block of the pages (default: README.md and docs/*.md) with the command
that wrote it, read from its first line; ``stale`` prints only the blocks to run again, each
with why: transcribed by hand, written from uncommitted code (``+changes``), written at a
commit this clone does not have, or written at a commit after which the code it measures
changed (the benchmark script, the benchmark modules it imports, the ``lmc_mergekit``
package and ``pyproject.toml``). It exits 1 when any is stale, so that a check can run it.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(
    r"<!-- begin (benchmarks/[\w./-]+\.py):([\w-]+) -->\n(.*?)<!-- end \1:\2 -->", re.S
)
WRITTEN = re.compile(r"Written by `([^`]+)` on .+, commit ([0-9a-f]{7,})(\+changes)?\.")
#: What every benchmark measures besides its own script.
SHARED = ("lmc_mergekit", "pyproject.toml")


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)


def dependencies(script: str) -> list[str]:
    """``script`` and the benchmark modules it imports, directly or not, as paths from the
    repository's root, then :data:`SHARED`."""
    found, todo = [], [script]
    while todo:
        path = todo.pop()
        if path in found or not (ROOT / path).is_file():
            continue
        found.append(path)
        source = (ROOT / path).read_text(encoding="utf-8")
        for name in re.findall(r"^\s*(?:from|import) (\w+)", source, flags=re.M):
            todo.append(f"benchmarks/{name}.py")
    return [*found, *SHARED]


def staleness(script: str, first_line: str) -> str | None:
    """Why the block whose first line is ``first_line`` should be written again, or None."""
    written = WRITTEN.fullmatch(first_line.strip())
    if written is None:
        return "transcribed by hand" if first_line.startswith("Transcribed") else "no provenance"
    commit = written.group(2)
    if written.group(3):
        return f"written from uncommitted code at {commit}"
    if git("cat-file", "-e", f"{commit}^{{commit}}").returncode:
        return f"written at {commit}, a commit this clone does not have"
    changed = git("diff", "--name-only", commit, "HEAD", "--", *dependencies(script))
    files = changed.stdout.split()
    if files:
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        return f"code changed since {commit}: {shown}"
    return None


def blocks(page: Path) -> list[tuple[int, str, str, str]]:
    """Each block of ``page``: its line, script, name and first line."""
    text = page.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, m.start()) + 1, m[1], m[2], (m[3].strip().splitlines() or [""])[0])
        for m in BLOCK.finditer(text)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("list", "stale"), nargs="?", default="stale")
    parser.add_argument("files", type=Path, nargs="*")
    args = parser.parse_args()
    pages = args.files or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    stale = 0
    for page in pages:
        shown = page.resolve().relative_to(ROOT) if page.resolve().is_relative_to(ROOT) else page
        for line, script, name, first in blocks(page):
            why = staleness(script, first)
            written = WRITTEN.fullmatch(first.strip())
            rerun = written.group(1) if written else f"python {script} … --block {name}"
            if args.action == "list" or why:
                print(f"{shown}:{line} {script}:{name}: {why or 'current'}; run: {rerun}")
            stale += why is not None
    if args.action == "stale" and stale:
        print(f"{stale} stale block(s)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
