"""``lmc-mergekit demo``: two zoo models of different seeds merged by ``lmc_dm``, end to end."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from mergekit.options import MergeOptions

from lmc_mergekit.passes.lmc_dm.records import PLOT_FILE, AlignmentReport, path_label
from lmc_mergekit.plugin.pipeline import run_recipe
from lmc_mergekit.runtime.publish import check_output_free
from lmc_mergekit.zoo import build_zoo

RECIPE_FILE = "recipe.yml"
MERGED_DIR = "merged"


@dataclass(frozen=True)
class DemoResult:
    """Where the demo wrote things, and the barriers it measured."""

    recipe: Path
    merged: Path
    report: AlignmentReport

    def summary(self) -> str:
        """What the demo prints: the two models, the barriers, and where the results are."""
        pair = self.report.pairs[0]
        ends = " and ".join(f"{loss:.3f}" for loss in pair.raw.endpoint_losses)
        barriers = [
            f"barrier {label + ':':<24}{path.barrier:.3f} nats"
            for path, label in (
                (pair.raw, "before alignment"),
                (pair.matched, "after " + path_label("matched", self.report.matching)),
                (pair.learned, "after learned matching"),
                (pair.repaired, "after repair"),
            )
            if path is not None
        ]
        return "\n".join(
            [
                f"models:   {pair.a}",
                f"          {pair.b}",
                f"test loss of each:              {ends} nats",
                *barriers,
                f"merged model (λ = 0.5) loss:    {self.report.merged.test_loss:.3f} nats",
                f"merged model: {self.merged}",
                f"report:       {self.merged / AlignmentReport.file_name}",
                f"plot:         {self.merged / PLOT_FILE}",
                f"recipe:       {self.recipe}",
            ]
        )


def demo_recipe(models: list[Path], align_steps: int) -> dict:
    """An ``lmc_dm`` recipe averaging the models equally after weight and learned matching."""
    return {
        "merge_method": "lmc_dm",
        "models": [{"model": str(path), "parameters": {"weight": 1.0}} for path in models],
        "dtype": "float32",
        "alignment": {
            "matching": "weights",
            "steps": align_steps,
            "lr": 0.02,
            "eval_sequences": 128,
            "points": 7,
        },
    }


def run_demo(
    out: Path,
    *,
    zoo_root: Path,
    cache_dir: Path,
    arch: str = "gpt_neox",
    hidden: int = 64,
    layers: int = 4,
    steps: int,
    align_steps: int,
    seeds: tuple[int, int] = (0, 1),
    overwrite: bool = False,
    quiet: bool = False,
) -> DemoResult:
    """Build (or reuse) two zoo models, write an ``lmc_dm`` recipe for them into ``out`` and run
    it into ``out/merged``."""
    out = Path(out).expanduser().absolute()
    check_output_free(out / MERGED_DIR, overwrite)
    models = build_zoo(zoo_root, arch, hidden, layers, seeds, steps, progress=not quiet)
    out.mkdir(parents=True, exist_ok=True)
    recipe = out / RECIPE_FILE
    recipe.write_text(
        "# Written by `lmc-mergekit demo`: rerun with\n"
        f"#   lmc-mergekit-yaml {recipe} {out / MERGED_DIR} --overwrite\n"
        + yaml.safe_dump(demo_recipe(models, align_steps), sort_keys=False),
        encoding="utf-8",
    )
    merged = run_recipe(recipe, out / MERGED_DIR, MergeOptions(quiet=quiet), cache_dir, overwrite)
    report = AlignmentReport.read(merged / AlignmentReport.file_name)
    return DemoResult(recipe=recipe, merged=merged, report=report)
