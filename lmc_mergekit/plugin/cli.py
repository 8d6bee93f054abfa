"""Command-line entry points: ``lmc-mergekit-yaml`` (a drop-in for ``mergekit-yaml``) and
``lmc-mergekit`` (the plugin's own tools)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click
from mergekit.options import MergeOptions, PrettyPrintHelp, add_merge_options

from lmc_mergekit.errors import LmcError
from lmc_mergekit.plugin.cache import default_cache_dir


def one_line_errors(fn):
    """Turn the tool's own errors into click's one-line ``Error: ...`` and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LmcError as error:
            raise click.ClickException(str(error)) from None

    return wrapper


@click.command("lmc-mergekit-yaml", cls=PrettyPrintHelp)
@click.argument("config_file")
@click.argument("out_path")
@click.option(
    "--lmc-cache",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder for prepared inputs [default: $LMC_MERGEKIT_CACHE or ~/.cache/lmc-mergekit]",
)
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
    import lmc_mergekit  # noqa: F401  (registers the methods)
    from lmc_mergekit.plugin.pipeline import run_recipe_file

    merge_options.apply_global_options()
    out = run_recipe_file(
        config_file, out_path, merge_options, lmc_cache or default_cache_dir(), overwrite
    )
    if not merge_options.quiet:
        click.echo(f"merged model written to {out}")


@click.group("lmc-mergekit")
def main() -> None:
    """lmc-mergekit tools."""


@main.command("scramble")
@click.argument("model")
@click.argument("out")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed")
@click.option(
    "--save-transform",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the applied transform to this file",
)
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists")
@click.option("--trust-remote-code", is_flag=True, help="Allow a checkpoint's own code to run")
@one_line_errors
def scramble_command(
    model: str,
    out: str,
    seed: int,
    save_transform: Path | None,
    overwrite: bool,
    trust_remote_code: bool,
) -> None:
    """Write MODEL moved by a random element of every symmetry it admits to OUT.

    The copy computes the same function (checked before it is kept) but its weights are
    permuted, rotated, rescaled and re-mixed per head: a hard test case for any merge method.
    """
    from lmc_mergekit.models.adapters import open_model
    from lmc_mergekit.symmetry import random_transform
    from lmc_mergekit.symmetry.transform import save_transform as write_transform

    transform = random_transform(open_model(model, trust_remote_code).spec, seed)
    _transform_and_report(model, out, transform, overwrite, trust_remote_code)
    if save_transform is not None:
        write_transform(transform, save_transform)


@main.command("transform")
@click.argument("model")
@click.argument("transform_file", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("out")
@click.option("--inverse", is_flag=True, help="Apply the inverse of the transform")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists")
@click.option("--trust-remote-code", is_flag=True, help="Allow a checkpoint's own code to run")
@one_line_errors
def transform_command(
    model: str,
    transform_file: Path,
    out: str,
    inverse: bool,
    overwrite: bool,
    trust_remote_code: bool,
) -> None:
    """Write MODEL moved by the symmetry saved in TRANSFORM_FILE to OUT."""
    from lmc_mergekit.symmetry.transform import load_transform

    transform = load_transform(transform_file)
    _transform_and_report(
        model, out, transform.inverse() if inverse else transform, overwrite, trust_remote_code
    )


def _transform_and_report(model, out, transform, overwrite, trust_remote_code) -> None:
    from lmc_mergekit.transform_checkpoint import transform_checkpoint

    spec, error = transform_checkpoint(
        model, out, transform, overwrite=overwrite, trust_remote_code=trust_remote_code
    )
    click.echo(
        f"wrote {out} ({spec.architecture}, {spec.num_layers} layers); "
        f"self-check: logits match the source to {error:.1e} (relative)"
    )


if __name__ == "__main__":
    sys.exit(main())
