"""Loss barrier between two zoo models of different seeds, raw and after weight matching.

    python benchmarks/weight_matching_barrier.py [--zoo DIR] [--hidden 128] [--steps 1500]
        [--arch gpt_neox llama] [--markdown docs/results.md]

Builds (or reuses) the zoo pairs (seeds 0 and 1), runs an ``lmc_dm`` recipe with ``steps: 0``
through the real pipeline for each, and prints one table row per pair from its
``lmc_report.json``: endpoint test losses, raw barrier, weight-matching barrier, the share of the
raw barrier removed, and the matching time. Building a d=128 pair takes about 10 minutes on two
CPU cores the first time.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import yaml
from markdown_blocks import add_markdown_option, publish
from mergekit.options import MergeOptions

from lmc_mergekit.passes.lmc_dm.records import AlignmentReport
from lmc_mergekit.plugin.pipeline import run_recipe
from lmc_mergekit.runtime.locations import default_cache_dir
from lmc_mergekit.zoo import build_zoo


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zoo", type=Path, default=default_cache_dir() / "zoo")
    parser.add_argument("--arch", nargs="+", default=["gpt_neox", "llama"])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1500)
    add_markdown_option(parser)
    args = parser.parse_args()
    rows = []
    work = Path(tempfile.mkdtemp(prefix="wm-bench-"))
    for arch in args.arch:
        a, b = build_zoo(args.zoo, arch, args.hidden, args.layers, (0, 1), args.steps)
        recipe = {
            "merge_method": "lmc_dm",
            "models": [
                {"model": str(a), "parameters": {"weight": 0.5}},
                {"model": str(b), "parameters": {"weight": 0.5}},
            ],
            "dtype": "float32",
            "alignment": {"matching": "weights", "steps": 0},
        }
        path = work / f"{arch}.yml"
        path.write_text(yaml.safe_dump(recipe))
        out = run_recipe(path, work / arch, MergeOptions(quiet=True), work / "cache")
        report = AlignmentReport.read(out / AlignmentReport.file_name)
        pair, match = report.pairs[0], report.matching[0]
        raw, aligned = pair.raw.barrier, pair.matched.barrier
        rows.append(
            (
                f"{arch} d={args.hidden} L={args.layers} {args.steps} steps",
                "{:.3f} / {:.3f}".format(*pair.raw.endpoint_losses),
                f"{raw:.3f}",
                f"{aligned:.3f}",
                f"{100 * (1 - aligned / raw):.0f} %",
                f"{match['seconds']:.1f} s ({match['iterations']})",
                f"{report.merged.test_loss:.3f}",
            )
        )
    header = (
        "pair",
        "endpoint losses",
        "raw barrier",
        "WM barrier",
        "removed",
        "matching (iters)",
        "merged loss",
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    publish(args, "table", "\n".join(lines))


if __name__ == "__main__":
    main()
