"""The demo as a user runs it: ``lmc-mergekit demo``, and what it prints.

    python benchmarks/demo.py [--zoo DIR] [--markdown README.md]

Runs the console script ``lmc-mergekit demo`` in a fresh output folder with a fresh cache for
its prepared inputs and measurements, so that every stage runs on today's code (the zoo models
are the demo's own, from ``--zoo``, by default the plugin cache's ``zoo``: trained on the first
run, as for a user) and prints the summary the command printed, with the output folder shown as
``./lmc-demo`` and the home folder as ``~``. With ``--markdown`` the summary is written into the
README's demo block, so the README shows what the demo prints today.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from markdown_blocks import add_markdown_option, publish

from lmc_mergekit.runtime.locations import default_cache_dir


def run_demo(zoo: Path) -> str:
    """The summary ``lmc-mergekit demo`` prints, its paths shown as a user's would be."""
    script = Path(sys.executable).with_name("lmc-mergekit")
    with tempfile.TemporaryDirectory(prefix="lmc-demo-") as work:
        out = Path(work) / "lmc-demo"
        cache = Path(work) / "cache"
        command = [str(script), "demo", str(out), "--zoo", str(zoo), "--lmc-cache", str(cache)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"lmc-mergekit demo failed:\n{done.stdout}\n{done.stderr}")
        summary = done.stdout.strip().split("\n\n")[-1]
        summary = summary.replace(str(out), "./lmc-demo").replace(str(Path.home()), "~")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", type=Path, default=default_cache_dir() / "zoo")
    add_markdown_option(parser)
    args = parser.parse_args()
    summary = run_demo(args.zoo)
    publish(args, "output", f"```\n{summary}\n```")


if __name__ == "__main__":
    main()
