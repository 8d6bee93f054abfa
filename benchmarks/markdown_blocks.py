"""Benchmark tables written into the documentation, with the command, machine, date and commit.

A table lives in a Markdown file between two markers that name the benchmark writing it::

    <!-- begin benchmarks/subclone.py:table -->
    ... written by the benchmark ...
    <!-- end benchmarks/subclone.py:table -->

Every benchmark that prints a table takes ``--markdown FILE [FILE ...]``: the table, with a
line saying where and how it was measured, replaces what stands between its markers in each
file (``docs/results.md``, and ``README.md`` for the headline tables). A file without the
block's markers is an error rather than a guess at where the table belongs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_markdown_option(parser: argparse.ArgumentParser) -> None:
    """The ``--markdown FILE ...`` option every table-printing benchmark takes."""
    parser.add_argument(
        "--markdown",
        type=Path,
        nargs="+",
        default=[],
        metavar="FILE",
        help="write the table between its markers in these Markdown files (docs/results.md)",
    )
    parser.add_argument(
        "--block",
        default=None,
        help="the name of the table's block, where runs with other options keep their own",
    )


#: The vector units named after the CPU where its flags list them (they set its speed here).
VECTOR_UNITS = (("avx512f", "AVX-512"), ("avx512_vnni", "VNNI"), ("avx512_bf16", "bf16"))


def machine() -> str:
    """The machine in words: CPU model and the cores this process may use, and any GPU."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    # One model name covers CPUs with and without AVX-512 (int8 and bf16 products): timings
    # differ by up to twice between them.
    vector = [name for flag, name in VECTOR_UNITS if flag in flags]
    if vector:
        cpu += f" ({', '.join(vector)})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    words = f"{cores} cores of {cpu}"
    try:
        import torch

        if torch.cuda.is_available():
            words += f", {torch.cuda.get_device_name()}"
    except ImportError:
        pass
    return words


def _commit() -> str:
    """The checked-out commit, marked ``+changes`` when code differs from it (the Markdown
    files the tables are written into do not count)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!*.md")
    return head + ("+changes" if changed else "")


#: Read when the benchmark starts: the code that runs is the code checked out then.
COMMIT = _commit()


def _script(path: str) -> str:
    """A script's path as the markers and the command show it (from the repository's root)."""
    script = Path(path).resolve()
    return script.relative_to(ROOT).as_posix() if script.is_relative_to(ROOT) else script.name


def command() -> str:
    """The command that was run, without its ``--markdown`` files."""
    shown, skipping = [], False
    for arg in sys.argv[1:]:
        if arg == "--markdown":
            skipping = True
            continue
        if skipping and not arg.startswith("-"):
            continue
        skipping = False
        shown.append(arg)
    return shlex.join(["python", _script(sys.argv[0]), *shown])


def write_block(files: list[Path], table: str, body: str, where_marked: bool = False) -> None:
    """Put ``body`` (a Markdown table, perhaps with a caption) with a line saying where and how
    it was measured between the markers of ``table`` in each file (``where_marked``: in those
    of the files that have its markers, at least one; a detailed table and its summary go to
    different pages)."""
    script = _script(sys.argv[0])
    begin, end = f"<!-- begin {script}:{table} -->", f"<!-- end {script}:{table} -->"
    provenance = f"Written by `{command()}` on {machine()}, {date.today()}, commit {COMMIT}."
    text = f"{begin}\n{provenance}\n\n{body.strip()}\n{end}"
    pages = {path: path.read_text(encoding="utf-8") for path in files}
    if where_marked:
        pages = {path: page for path, page in pages.items() if begin in page} or pages
    for path, page in pages.items():
        start, stop = page.find(begin), page.find(end)
        if start < 0 or stop < start:
            raise SystemExit(f"{path} has no block {begin}: add its two markers where it belongs")
        path.write_text(page[:start] + text + page[stop + len(end) :], encoding="utf-8")
        print(f"wrote {table} into {path}")


def publish(args: argparse.Namespace, table: str, body: str, where_marked: bool = False) -> None:
    """Print a table and, with ``--markdown``, write it into the documentation as the block
    ``table`` (or the ``--block`` given; ``where_marked``: see :func:`write_block`)."""
    print("\n" + body.strip(), flush=True)
    if getattr(args, "markdown", None):
        write_block(args.markdown, getattr(args, "block", None) or table, body, where_marked)
