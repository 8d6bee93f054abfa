"""A plugin recipe resolved once in a process: the plan every stage of the pipeline is handed.

Resolving a recipe finds a local folder for every model it names (Hub ids, revisions and LoRA
adapters included), checks them, lists the inputs the pre-merge pass prepares and sets up the
test split; each stage (the pass, mergekit's merge of the prepared inputs, the finishing step,
the measurement and the card) reads what it needs from the plan instead of deriving it again.
What the layers below read from the inputs' folders (configs, tokenizers) they read once a
process too, while the files are unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

from lmc_mergekit.models.checkpoint import model_dir
from lmc_mergekit.passes.base import Section
from lmc_mergekit.passes.text import Split, load_test_split
from lmc_mergekit.plugin.inputs import plugin_inputs
from lmc_mergekit.plugin.methods import PluginMethod
from lmc_mergekit.plugin.recipe import Recipe
from lmc_mergekit.plugin.resolve import resolve_models


@dataclass(frozen=True)
class Plan:
    """A plugin recipe resolved for one run: the recipe as written (the card quotes it), its
    method, mergekit's configuration and the plugin section with every model a checked local
    folder, the reference as written for each of those folders, the inputs (resolved folders,
    recipe order, the base model first), the base model's folder, mergekit's options, the
    plugin's cache folder, and the test split (loaded on first use, once)."""

    recipe: Recipe
    method: PluginMethod
    config: MergeConfiguration
    settings: Section
    written: dict[Path, str]
    inputs: tuple[Path, ...]
    base_model: Path | None
    options: MergeOptions
    cache_dir: Path
    #: The test split as the inputs' shared tokenizer cuts it (None when the recipe does not
    #: evaluate).
    load_test: Callable[[], Split | None]
    #: The test split as the tokenizer of the checkpoint in a folder cuts it.
    split_for: Callable[[Path], Split]


def plan_recipe(recipe: Recipe, options: MergeOptions, cache_dir: Path) -> Plan:
    """The plan of a plugin recipe: its models resolved to local folders (see
    :func:`~lmc_mergekit.plugin.resolve.resolve_models`; LoRA merges go under ``cache_dir``)
    and its inputs checked by the method's settings, before the cache is consulted."""
    method = recipe.method
    local = resolve_models(recipe.config, recipe.settings, options, cache_dir)
    settings = local.settings
    inputs = tuple(plugin_inputs(local.config, method.name))
    base = local.config.base_model
    base_model = None if base is None else model_dir(base.model.path)
    settings.check_inputs(list(inputs), base_model, options.trust_remote_code)
    readers = settings.evaluation_inputs(inputs, base_model)

    @functools.cache
    def load_test() -> Split | None:
        return load_test_split(readers, settings, method.section)

    @functools.cache
    def split_for(folder: Path) -> Split:
        return load_test_split((folder,), settings, method.section)

    return Plan(
        recipe=recipe,
        method=method,
        config=local.config,
        settings=settings,
        written=local.written,
        inputs=inputs,
        base_model=base_model,
        options=options,
        cache_dir=cache_dir,
        load_test=load_test,
        split_for=split_for,
    )
