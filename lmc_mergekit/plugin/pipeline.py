"""Running a recipe; the only code that runs mergekit.

A built-in method runs as ``mergekit-yaml`` runs it, on the recipe as written. A plugin method
runs as one straight line: the test split is read (when the recipe evaluates: bad data fails
before any heavy work), the pre-merge pass prepares every input (cached), mergekit combines the
prepared inputs, and the measurement (cached, with any comparison merges it declares) writes
the report. Every merged output is checked for NaN and Inf before it is kept, the card is
written from the recipe as given, and the whole output appears only when complete.
"""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.checkpoint import first_non_finite, model_dir
from lmc_mergekit.passes.base import Compared, Comparison, MeasureContext, PassContext, Section
from lmc_mergekit.passes.device import pass_device
from lmc_mergekit.passes.text import Split, load_test_split
from lmc_mergekit.plugin.cache import (
    ARTEFACTS_DIR,
    MEASUREMENTS_DIR,
    PREPARATION_FILE,
    measurement_key,
    preparation_key,
)
from lmc_mergekit.plugin.card import write_card
from lmc_mergekit.plugin.inputs import check_models, plugin_inputs, references, with_prepared
from lmc_mergekit.plugin.methods import PluginMethod
from lmc_mergekit.plugin.recipe import Recipe, read_recipe
from lmc_mergekit.runtime.distributed import Processes, close_processes, processes
from lmc_mergekit.runtime.provenance import write_provenance
from lmc_mergekit.runtime.publish import staged_folder
from lmc_mergekit.runtime.records import Record

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """The prepared inputs of one recipe: their cache entry and key, the inputs (resolved
    folders, recipe order), the prepared checkpoint of each and the pass's record."""

    key: str
    entry: Path
    inputs: tuple[Path, ...]
    folders: tuple[Path, ...]
    preparation: Record

    @property
    def artefacts(self) -> Path:
        return self.entry / ARTEFACTS_DIR


def run_recipe_file(
    recipe_path: str | Path,
    out: str | Path,
    options: MergeOptions,
    cache_dir: Path,
    overwrite: bool = False,
) -> Path:
    """Run a recipe file into ``out`` (written in a staging folder, renamed on success)."""
    recipe = read_recipe(recipe_path)
    out = Path(out).expanduser().absolute()
    cache_dir = Path(cache_dir).expanduser().absolute()
    existing = "replace" if overwrite else "refuse"
    check_models(recipe.config, local_only=recipe.method is not None)
    if recipe.method is None:
        with staged_folder(out, existing) as folder:
            merge(recipe.config, folder, options)
            if options.write_model_card:
                write_card(folder, recipe, out.name)
        return out
    procs = processes(pass_device(options))
    try:
        if not procs.is_main:  # the other processes of a launcher only help with the pass
            load_test = lazy_test_split(recipe)
            prepare(
                recipe.method, recipe.settings, recipe.config, options, cache_dir, procs, load_test
            )
            return out
        with staged_folder(out, existing) as folder:
            run_plugin_recipe(recipe, folder, out.name, options, cache_dir, procs)
        return out
    finally:
        close_processes()


def run_plugin_recipe(
    recipe: Recipe,
    folder: Path,
    name: str,
    options: MergeOptions,
    cache_dir: Path,
    procs: Processes | None = None,
) -> None:
    """The plugin recipe's merge, report and card in ``folder`` (the output's name ``name``)."""
    method, settings = recipe.method, recipe.settings
    procs = procs or Processes()
    load_test = lazy_test_split(recipe)
    prepared = prepare(method, settings, recipe.config, options, cache_dir, procs, load_test)
    merge_prepared(recipe.config, settings, prepared, folder, options)
    report = measure(recipe, prepared, folder, load_test, options, cache_dir)
    if options.write_model_card:
        written = {model_dir(r.model.path): r.model.path for r in _local(recipe.config)}
        rows = {
            written.get(source, str(source)): str(target.relative_to(cache_dir))
            for source, target in zip(prepared.inputs, prepared.folders, strict=True)
        }
        write_card(folder, recipe, name, rows, report)


def lazy_test_split(recipe: Recipe) -> Callable[[], Split | None]:
    """Loads the recipe's test split on first use (None when it does not evaluate), once."""
    inputs = tuple(plugin_inputs(recipe.config, recipe.method.name))
    return functools.cache(lambda: load_test_split(inputs, recipe.settings, recipe.method.section))


def _local(config: MergeConfiguration):
    return [ref for ref in references(config) if Path(ref.model.path).expanduser().exists()]


def merge(config: MergeConfiguration, folder: Path, options: MergeOptions) -> None:
    """mergekit's executor into ``folder`` (the card is the caller's), then every merged tensor
    checked: nothing non-finite is ever kept."""
    no_card = options.model_copy(update={"write_model_card": False})
    try:
        run_merge(config.model_copy(deep=True), str(folder), no_card)
    except LmcError:
        raise
    except (RuntimeError, ValueError, OSError) as error:
        if options.verbosity:
            raise
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
        raise LmcError(f"mergekit: {message} (-v shows where)") from None
    bad = first_non_finite(folder)
    if bad is not None:
        tensor, count = bad
        raise LmcError(
            f"the merged tensor {tensor!r} holds {count} NaN/Inf values (weights that sum to "
            "zero under normalize give 0/0): check the recipe's weights and filters; nothing "
            "was written"
        )


def prepare(
    method: PluginMethod,
    settings: Section,
    config: MergeConfiguration,
    options: MergeOptions,
    cache_dir: Path,
    procs: Processes,
    load_test: Callable[[], Split | None] = lambda: None,
) -> Prepared | None:
    """The prepared inputs of a plugin recipe: from the cache, or by running the method's
    pre-merge pass into a new entry (which calls ``load_test`` before its heavy work).
    Resumable state of an interrupted pass lives next to the entry until the pass succeeds. In
    the other processes of a launcher the pass only helps (and None is returned)."""
    inputs = tuple(plugin_inputs(config, method.name))
    key = preparation_key(method.name, settings, list(inputs))
    root = cache_dir / method.name
    entry, state_dir = root / key, root / f".{key}.state"
    names = tuple(f"model-{index}" for index in range(len(inputs)))
    base_model = config.base_model
    ctx = PassContext(
        method=method.name,
        inputs=inputs,
        outputs=tuple(entry / name for name in names),
        settings=settings,
        options=options,
        artefacts=entry / ARTEFACTS_DIR,
        state_dir=state_dir,
        cache_dir=root,
        base_model=None if base_model is None else model_dir(base_model.model.path),
        processes=procs,
        load_test=load_test,
    )
    if (entry / PREPARATION_FILE).is_file():
        LOG.info("reusing prepared inputs from %s", entry)
    elif not procs.is_main:
        method.prepare(ctx)  # helps the main process, which writes
        return None
    else:
        # A concurrent run that finished first wins: its entry is as good as this one.
        with staged_folder(entry, "keep", sweep_siblings=True) as work:
            outputs = tuple(work / name for name in names)
            preparation = method.prepare(
                replace(ctx, outputs=outputs, artefacts=work / ARTEFACTS_DIR)
            )
            for source, folder in zip(inputs, outputs, strict=True):
                write_provenance(folder, method.name, {"source": str(source), "cache_key": key})
            preparation.write(work / PREPARATION_FILE)
        shutil.rmtree(state_dir, ignore_errors=True)
    return Prepared(
        key=key,
        entry=entry,
        inputs=inputs,
        folders=ctx.outputs,
        preparation=method.preparation.read(entry / PREPARATION_FILE),
    )


def merge_prepared(
    config: MergeConfiguration,
    settings: Section,
    prepared: Prepared,
    folder: Path,
    options: MergeOptions,
) -> None:
    """mergekit on the prepared checkpoints, with the method's parameters from the plugin
    section (and the built-in method that section names to combine them, if any)."""
    config = with_prepared(config, dict(zip(prepared.inputs, prepared.folders, strict=True)))
    update: dict = {}
    combine = settings.combining_method()
    if combine is not None:
        update["merge_method"] = combine
    extra = settings.merge_parameters()
    if extra:
        update["parameters"] = {**(config.parameters or {}), **extra}
    merge(config.model_copy(update=update), folder, options)


def measure(
    recipe: Recipe,
    prepared: Prepared,
    folder: Path,
    load_test: Callable[[], Split | None],
    options: MergeOptions,
    cache_dir: Path,
) -> Record:
    """The method's report of the merge in ``folder``, with its files copied there: from the
    cache, or measured (running the comparison merges it declares) into a new entry."""
    method, settings = recipe.method, recipe.settings
    merge_config = recipe.config.model_dump(mode="json")
    key = measurement_key(prepared.key, settings, merge_config, options)
    entry = cache_dir / method.name / MEASUREMENTS_DIR / key
    report_file = method.report.file_name
    if not (entry / report_file).is_file():
        with (
            staged_folder(entry, "keep", sweep_siblings=True) as work,
            tempfile.TemporaryDirectory(prefix=".scratch-", dir=work.parent) as scratch,
        ):
            compared = {
                comparison.name: _compare(comparison, recipe, Path(scratch), options, cache_dir)
                for comparison in method.comparisons(settings, prepared.preparation)
            }
            report = method.measure(
                MeasureContext(
                    settings=settings,
                    inputs=prepared.inputs,
                    prepared=prepared.folders,
                    preparation=prepared.preparation,
                    artefacts=prepared.artefacts,
                    merged=folder,
                    comparisons=compared,
                    test=load_test(),
                    options=options,
                    scratch=Path(scratch),
                    files=work,
                )
            )
            report.write(work / report_file)
    shutil.copytree(entry, folder, dirs_exist_ok=True)
    return method.report.read(entry / report_file)


def _compare(
    comparison: Comparison,
    recipe: Recipe,
    scratch: Path,
    options: MergeOptions,
    cache_dir: Path,
) -> Compared:
    """Run one comparison merge into ``scratch``."""
    folder = scratch / comparison.name
    if comparison.merge_method is not None:
        config = recipe.config.model_copy(update={"merge_method": comparison.merge_method})
        merge(config, folder, options)
        return Compared(folder)
    settings = comparison.settings
    other = prepare(recipe.method, settings, recipe.config, options, cache_dir, Processes())
    merge_prepared(recipe.config, settings, other, folder, options)
    return Compared(folder, other.preparation)
