"""``lmc_dm`` recipes on zoo pairs through the whole tool: one table row per pair.

    python benchmarks/lmc_dm_recipe.py [--zoo DIR] [--arch qwen3 gemma2] [--hidden 128]
        [--zoo-steps 1500] [--steps 600] [--matching weights activations]
        [--learn residual permutation scale qk ov]
        [--tied --tied-embeddings untie keep] [--repair default true false]
        [--markdown docs/results.md]

Builds (or reuses) the zoo pair of each architecture (seeds 0 and 1), runs an ``lmc_dm``
recipe (weight matching, then ``--steps`` of dual learned matching with the defaults) through
``lmc-mergekit-yaml``'s pipeline, and prints, from its ``lmc_report.json``: endpoint test
losses, the raw barrier, after weight matching and after learned matching, the share removed,
the merged model's loss, the learned families, the learning time and the whole command's time.
With ``--tied`` the zoo pairs tie their heads to their embeddings, and each pair runs once per
``--tied-embeddings`` setting (``untie``, ``keep``); each pair runs once per ``--matching``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import yaml
from markdown_blocks import add_markdown_option, publish
from mergekit.options import MergeOptions

from lmc_mergekit.passes.lmc_dm.records import AlignmentReport
from lmc_mergekit.plugin.pipeline import run_recipe
from lmc_mergekit.runtime.locations import default_cache_dir
from lmc_mergekit.zoo import build_zoo

HEADER = (
    "| pair | matching | endpoint losses | raw barrier | after matching | learned matching "
    "| repaired | removed | merged loss | learned families | learning | whole command |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def pair_row(
    label: str, a: Path, b: Path, steps: int, work: Path, options: MergeOptions, **alignment
) -> str:
    """The table row of an ``lmc_dm`` recipe (``steps`` of learned matching, and any other
    ``alignment`` settings) on ``a`` and ``b``, run through the pipeline into ``work``."""
    recipe = {
        "merge_method": "lmc_dm",
        "models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in (a, b)],
        "dtype": "float32",
        "alignment": {"steps": steps, **alignment},
    }
    name = "-".join(
        [label, *("+".join(v) if isinstance(v, list) else str(v) for v in alignment.values())]
    ).replace(" ", "")
    path = work / f"{name}.yml"
    path.write_text(yaml.safe_dump(recipe))
    started = time.perf_counter()
    out = run_recipe(path, work / name, options, work / "cache")
    seconds = time.perf_counter() - started
    report = AlignmentReport.read(out / AlignmentReport.file_name)
    pair, learning = report.pairs[0], report.learning
    learned_path = pair.learned or pair.matched  # steps: 0 learns nothing
    raw, matched, learned = (p.barrier for p in (pair.raw, pair.matched, learned_path))
    # Removed: from the path the output comes from (repaired where the recipe repairs).
    final = learned if pair.repaired is None else pair.repaired.barrier
    repaired = "–" if pair.repaired is None else f"**{pair.repaired.barrier:.3f}**"
    learned_cells = (
        "– | –"
        if learning is None
        else f"{', '.join(learning.families)} | {learning.seconds:.0f} s"
    )
    return (
        f"| {label} | {report.matching[0]['matching']} | "
        + " / ".join(f"{loss:.3f}" for loss in pair.raw.endpoint_losses)
        + f" | {raw:.3f} | {matched:.3f} | **{learned:.3f}** | {repaired} | "
        f"{1 - final / raw:.1%} | "
        f"{report.merged.test_loss:.3f} | {learned_cells} | {seconds / 60:.1f} min |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", type=Path, default=default_cache_dir() / "zoo")
    parser.add_argument("--arch", nargs="+", default=["qwen3", "gemma2"])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--zoo-steps", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=600, help="learned-matching steps")
    parser.add_argument(
        "--matching", nargs="+", default=["weights"], choices=["auto", "weights", "activations"]
    )
    parser.add_argument("--learn", nargs="+", help="learned families (default: the recipe's)")
    parser.add_argument("--tied", action="store_true", help="zoo pairs with tied heads")
    parser.add_argument(
        "--tied-embeddings", nargs="+", default=["untie"], choices=["untie", "keep"]
    )
    parser.add_argument(
        "--repair",
        nargs="+",
        default=["default"],
        choices=["default", "true", "false"],
        help="statistics repair of the merge (default: the recipe's default); one run each",
    )
    add_markdown_option(parser)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lmc-dm-bench-"))
    print(HEADER, flush=True)
    rows = []
    for arch in args.arch:
        a, b = build_zoo(
            args.zoo, arch, args.hidden, args.layers, (0, 1), args.zoo_steps, tied=args.tied
        )
        for tie in args.tied_embeddings if args.tied else ["untie"]:
            for matching, repair in ((m, r) for m in args.matching for r in args.repair):
                label = f"{arch} d={args.hidden}" + (f", tied, {tie}" if args.tied else "")
                options = MergeOptions(quiet=True)
                extra = {"learn": args.learn} if args.learn else {}
                if repair != "default":
                    extra["repair"] = repair == "true"
                    label += f", repair {repair}"
                row = pair_row(
                    label,
                    a,
                    b,
                    args.steps,
                    work,
                    options,
                    tied_embeddings=tie,
                    matching=matching,
                    **extra,
                )
                print(row, flush=True)
                rows.append(row)
    publish(args, "table", "\n".join([HEADER, *rows]))


if __name__ == "__main__":
    main()
