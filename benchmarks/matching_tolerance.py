"""Does weight matching's early stop change the barrier? The descent to convergence against the
default tolerance and steady-layer skipping, on one zoo pair.

    python benchmarks/matching_tolerance.py [--zoo DIR] [--arch qwen3] [--hidden 128]
        [--markdown docs/results.md]

Prints, for each setting, the rounds, layers assigned per round, seconds, the final relative
distance and the barrier on ``--eval`` test sequences (11 λ points).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from markdown_blocks import add_markdown_option, publish

from lmc_mergekit.data import DataConfig, load_split, load_tokenizer
from lmc_mergekit.evaluation.barrier import interpolation_losses
from lmc_mergekit.matching import weight_matching
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.runtime.locations import default_cache_dir
from lmc_mergekit.symmetry import Transform
from lmc_mergekit.transform_checkpoint import transform_checkpoint
from lmc_mergekit.zoo import build_zoo

SETTINGS = {
    "to convergence (tolerance 1e-6, every layer every round)": (1e-6, 0.0),
    "default (tolerance 1e-4, steady layers kept)": (
        weight_matching.TOLERANCE,
        weight_matching.STEADY_ROTATION,
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", type=Path, default=default_cache_dir() / "zoo")
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--eval", type=int, default=128)
    add_markdown_option(parser)
    args = parser.parse_args()
    a, b = build_zoo(args.zoo, args.arch, args.hidden, 4, (0, 1), 1500)
    test = load_split(DataConfig(), load_tokenizer([a]), "test", args.eval)
    work = Path(tempfile.mkdtemp(prefix="tolerance-"))
    views = [open_model(a), open_model(b)]
    first = work / "a"
    transform_checkpoint(a, first, Transform(views[0].spec.num_layers, True), progress=False)
    lines = [
        "| setting | rounds | layers assigned per round | seconds | distance | barrier |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for index, (label, (tolerance, steady)) in enumerate(SETTINGS.items()):
        weight_matching.STEADY_ROTATION = steady
        result = weight_matching.match_weights(*views, tolerance=tolerance)
        moved = work / f"b{index}"
        transform_checkpoint(b, moved, result.transform, progress=False)
        barrier = interpolation_losses(first, moved, test).barrier
        lines.append(
            f"| {label} | {result.iterations} | {', '.join(map(str, result.solved))} | "
            f"{result.seconds:.1f} | {result.distance:.5f} | {barrier:.4f} |"
        )
        print(lines[-1], flush=True)
    publish(args, "table", "\n".join(lines))


if __name__ == "__main__":
    main()
