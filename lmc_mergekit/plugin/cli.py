"""``lmc-mergekit-yaml``: a drop-in for ``mergekit-yaml`` that runs the plugin's methods (the
plugin's other tools are ``lmc-mergekit``, :mod:`lmc_mergekit.cli`)."""

from __future__ import annotations

from pathlib import Path

import click
from mergekit.options import MergeOptions, PrettyPrintHelp, add_merge_options

from lmc_mergekit.cli import lmc_cache_option, one_line_errors
from lmc_mergekit.runtime.locations import default_cache_dir


@click.command("lmc-mergekit-yaml", cls=PrettyPrintHelp)
@click.argument("config_file")
@click.argument("out_path")
@lmc_cache_option
@click.option("--overwrite", is_flag=True, help="Replace OUT_PATH if it exists and is not empty")
@add_merge_options
@one_line_errors
def mergekit_yaml_main(
    merge_options: MergeOptions,
    config_file: str,
    out_path: str,
    lmc_cache: Path | None,
    overwrite: bool,
) -> None:
    """Run a mergekit YAML recipe; the plugin's methods run their pre-merge pass first."""
    from lmc_mergekit.plugin.mergekit_entry import option_given
    from lmc_mergekit.plugin.pipeline import launcher_rank, run_recipe

    merge_options.apply_global_options()
    out = run_recipe(
        config_file,
        out_path,
        merge_options,
        lmc_cache or default_cache_dir(),
        overwrite,
        device_given=option_given(click.get_current_context(), "device", "cuda", "gpu_rich"),
    )
    if not merge_options.quiet and launcher_rank() == 0:
        click.echo(f"merged model written to {out}")
