"""A plugin recipe given to mergekit's own ``run_merge`` (``mergekit-yaml``, ``mergekit-multi``,
a notebook): the pipeline runs it as ``lmc-mergekit-yaml`` would, with the same output."""

from __future__ import annotations

from pathlib import Path

import click
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from mergekit.scripts.run_yaml import main as mergekit_yaml

from lmc_mergekit.errors import LmcError
from lmc_mergekit.plugin.mergekit_hooks import without_sections
from lmc_mergekit.plugin.pipeline import run_recipe
from lmc_mergekit.plugin.recipe import Recipe, parse_recipe, recipe_of
from lmc_mergekit.runtime.locations import default_cache_dir


def run_plugin_merge(
    merge_config: MergeConfiguration,
    out_path: str,
    options: MergeOptions,
    config_source: str | None = None,
) -> None:
    """A plugin recipe given to ``run_merge``: the pipeline into ``out_path``. Errors are one
    line: click's, under a click command (``mergekit-yaml``), else :class:`LmcError`."""
    context = click.get_current_context(silent=True)
    try:
        recipe = _recipe(merge_config, config_source, context)
        out = Path(out_path).expanduser().absolute()
        run_recipe(
            recipe,
            out,
            options,
            default_cache_dir(),
            overwrite=_replaceable(out),
            device_given=_device_given(context),
        )
    except LmcError as error:
        if context is None:
            raise
        raise click.ClickException(str(error)) from None


def _device_given(context: click.Context | None) -> bool:
    """Whether the device in the options is the user's: from Python (no command, or one
    without mergekit's options), always; from a command, when its line named one."""
    if context is None or "device" not in {p.name for p in context.command.params}:
        return True
    return option_given(context, "device", "cuda", "gpu_rich")


def option_given(context: click.Context, *names: str) -> bool:
    """Whether the command line set any of the options ``names`` (not their defaults)."""
    default = click.core.ParameterSource.DEFAULT
    return any(context.get_parameter_source(name) not in (default, None) for name in names)


def _recipe(
    merge_config: MergeConfiguration, config_source: str | None, context: click.Context | None
) -> Recipe:
    """The recipe run_merge was given: its text when that is the configuration's (the card
    quotes it as written), else the configuration written out with its section. Under
    ``mergekit-yaml`` the configuration was parsed from that very text, so it is not parsed
    again."""
    kept = merge_config.model_extra is not None
    if config_source and kept and context is not None and context.command is mergekit_yaml:
        return recipe_of(merge_config, config_source)
    if config_source:
        recipe = parse_recipe(config_source)
        if _same(recipe.config, merge_config):
            return recipe
    if not kept:
        raise LmcError(
            f"this {merge_config.merge_method} configuration was parsed before lmc-mergekit was "
            "loaded, so its plugin section is lost: import lmc_mergekit.plugin before "
            "MergeConfiguration.model_validate, or pass config_source=<the recipe text>"
        )
    return recipe_of(merge_config, merge_config.to_yaml())


def _same(a: MergeConfiguration, b: MergeConfiguration) -> bool:
    return without_sections(a).model_dump(mode="json") == without_sections(b).model_dump(
        mode="json"
    )


def _replaceable(out: Path) -> bool:
    """mergekit writes into an existing output folder; the plugin replaces it whole (the old
    one stays until the new one is complete), so only a folder that holds a model or nothing
    is replaced: anything else is a one-line error rather than a deleted folder."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return False
    if out.is_dir() and (out / "config.json").is_file():
        return True
    raise LmcError(
        f"output {str(out)!r} exists and holds no model; mergekit would write into it, this "
        "plugin method replaces its output whole: give an empty or new folder"
    )
