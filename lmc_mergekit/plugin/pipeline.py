"""Running a recipe; the only code that runs mergekit.

A built-in method runs as ``mergekit-yaml`` runs it, on the recipe as written. A plugin method
runs as one straight line: the test split is read (when the recipe evaluates: bad data fails
before any heavy work), the pre-merge pass prepares every input (cached), mergekit combines the
prepared inputs, and the measurement (cached, with any comparison merges it declares) writes
the report. Every merged output is checked for NaN and Inf before it is kept, the card is
written from the recipe as given, and the whole output appears only when complete.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

from mergekit.config import MergeConfiguration
from mergekit.io.tasks import LoaderCache
from mergekit.options import MergeOptions

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.adapters.base import DEFAULT_SHARD_SIZE
from lmc_mergekit.models.checkpoint import first_non_finite
from lmc_mergekit.passes.base import (
    Compared,
    Comparison,
    FinishContext,
    MeasureContext,
    PassContext,
)
from lmc_mergekit.passes.device import pass_device, with_default_device
from lmc_mergekit.plugin.architecture_repairs import repaired_architectures
from lmc_mergekit.plugin.cache import (
    ARTEFACTS_DIR,
    MEASUREMENTS_DIR,
    PREPARATION_FILE,
    cached_record,
    measurement_key,
    preparation_key,
)
from lmc_mergekit.plugin.card import write_card
from lmc_mergekit.plugin.inputs import (
    check_models,
    expand_home,
    with_prepared,
)
from lmc_mergekit.plugin.mergekit_hooks import (
    mergekit_run_merge,
    without_sections,
    without_torch_dtype_notice,
)
from lmc_mergekit.plugin.plan import Plan, plan_recipe
from lmc_mergekit.plugin.recipe import Recipe, average_weights, plain_weights, read_recipe
from lmc_mergekit.runtime.distributed import Processes, close_processes, processes
from lmc_mergekit.runtime.locks import entry_lock
from lmc_mergekit.runtime.memory import release_freed_memory
from lmc_mergekit.runtime.provenance import write_provenance
from lmc_mergekit.runtime.publish import check_output_free, staged_folder
from lmc_mergekit.runtime.records import Record

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """The prepared inputs of one recipe: their cache entry and key, the prepared checkpoint of
    each input (the plan's order) and the pass's record."""

    key: str
    entry: Path
    folders: tuple[Path, ...]
    preparation: Record

    @property
    def artefacts(self) -> Path:
        return self.entry / ARTEFACTS_DIR


def run_recipe(
    recipe: Recipe | str | Path,
    out: str | Path,
    options: MergeOptions,
    cache_dir: Path,
    overwrite: bool = False,
    device_given: bool = True,
) -> Path:
    """Run a recipe (parsed, or the path of its file) into ``out`` (written in a staging
    folder, renamed on success; an existing output is replaced only with ``overwrite``, and
    kept until the new one is complete). A plugin recipe's pass runs on the GPU when there is
    one unless ``device_given`` (the command line chose ``--device`` or ``--cuda``);
    ``options`` as given otherwise."""
    if not isinstance(recipe, Recipe):
        recipe = read_recipe(recipe)
    out = Path(out).expanduser().absolute()
    cache_dir = Path(cache_dir).expanduser().absolute()
    existing = "replace" if overwrite else "refuse"
    check_output_free(out, overwrite)  # in every process of a launcher, before any of them works
    if recipe.method is None:
        check_models(recipe.config)
        if launcher_rank() == 0:  # a built-in merge runs once, even under a launcher
            with staged_folder(out, existing) as folder:
                merge(recipe.config, folder, options)
                if options.write_model_card:
                    write_card(folder, recipe, out.name)
        return out
    options = with_default_device(options, device_given)
    procs = processes(pass_device(options))
    try:
        # Every process resolves and checks the inputs itself; one that fails stops them all.
        with procs.together():
            plan = plan_recipe(recipe, options, cache_dir)
        if not procs.is_main:  # the other processes of a launcher only help with the pass
            prepare(plan, procs)
            return out
        with staged_folder(out, existing) as folder:
            run_plan(plan, folder, out.name, procs)
        return out
    finally:
        close_processes()


def run_plan(plan: Plan, folder: Path, name: str, procs: Processes | None = None) -> None:
    """The plugin recipe's merge, report and card in ``folder`` (the output's name ``name``):
    everything runs on the plan's local folders, the card quotes the recipe as written."""
    procs = procs or Processes()
    prepared = prepare(plan, procs)
    release_freed_memory()  # each stage's peak, not their sum
    merge_prepared(plan, prepared, folder)
    release_freed_memory()
    finished = plan.method.finish(
        FinishContext(
            settings=plan.settings,
            inputs=plan.inputs,
            options=plan.options,
            artefacts=prepared.artefacts,
            prepared=prepared.folders,
            preparation=prepared.preparation,
            merged=folder,
            weights=plain_weights(plan.config),
        )
    )
    release_freed_memory()
    report = measure(plan, prepared, folder, finished)
    if plan.options.write_model_card:
        rows = {
            plan.written.get(source, str(source)): str(target.relative_to(plan.cache_dir))
            for source, target in zip(plan.inputs, prepared.folders, strict=True)
        }
        write_card(folder, plan.recipe, name, rows, report)


def launcher_rank() -> int:
    """This process's rank under a launcher (``torchrun``, ``accelerate launch``), else 0."""
    return int(os.environ.get("RANK", "0"))


def merge(config: MergeConfiguration, folder: Path, options: MergeOptions) -> None:
    """mergekit's executor into ``folder`` (the card is the caller's; mergekit's architecture
    definitions repaired while it runs), then every merged tensor checked: nothing non-finite
    is ever kept. Unless the user set ``--out-shard-size``, the
    output is written in shards of the size prepared checkpoints use: mergekit's own default
    (5 GB) holds a whole merged model of today's sizes in one shard plus its serialised copy."""
    update: dict = {"write_model_card": False}
    if options.out_shard_size == MergeOptions.model_fields["out_shard_size"].default:
        update["out_shard_size"] = DEFAULT_SHARD_SIZE
    no_card = options.model_copy(update=update)
    try:
        run_merge = mergekit_run_merge()
        plain = without_sections(expand_home(config)).model_copy(deep=True)
        with repaired_architectures(), without_torch_dtype_notice():
            try:
                run_merge(plain, str(folder), no_card)
            finally:
                # mergekit keeps each input's last shard open, mapped: the pages its merge
                # read would count as this process's memory for the rest of the run.
                LoaderCache().flush_all()
    except LmcError:
        raise
    except (RuntimeError, ValueError, OSError) as error:
        if options.verbosity:
            raise
        message = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise LmcError(f"mergekit: {message} (-v shows where)") from None
    bad = first_non_finite(folder)
    if bad is not None:
        tensor, count = bad
        raise LmcError(
            f"the merged tensor {tensor!r} holds {count} NaN/Inf values (weights that sum to "
            "zero under normalize give 0/0): check the recipe's weights and filters; nothing "
            "was written"
        )


def prepare(plan: Plan, procs: Processes) -> Prepared | None:
    """The prepared inputs of a plugin recipe: from the cache, or by running the method's
    pre-merge pass into a new entry (which loads the plan's test split before its heavy work).
    Resumable state of an interrupted pass lives next to the entry until the pass succeeds. In
    the other processes of a launcher the pass only helps, writing nothing, and None is
    returned."""
    method, settings, inputs = plan.method, plan.settings, plan.inputs
    device = pass_device(plan.options)
    key = preparation_key(method.name, settings, list(inputs), device.type)
    root = plan.cache_dir / method.name
    entry, state_dir = root / key, root / f".{key}.state"
    names = tuple(f"model-{index}" for index in range(len(inputs)))

    def context(folder: Path) -> PassContext:
        return PassContext(
            settings=settings,
            inputs=inputs,
            options=plan.options,
            artefacts=folder / ARTEFACTS_DIR,
            method=method.name,
            outputs=tuple(folder / name for name in names),
            state_dir=state_dir,
            cache_dir=root,
            base_model=plan.base_model,
            processes=procs,
            load_test=plan.load_test,
        )

    def record() -> Record | None:
        return cached_record(entry, PREPARATION_FILE, method.preparation)

    with ExitStack() as held:

        def locked_or_complete() -> Record | None:
            # A complete entry needs no lock (a read-only cache works); otherwise another run
            # on it finishes first, and this one then reuses what it wrote.
            found = record()
            if found is None:
                held.enter_context(entry_lock(entry))
                found = record()
            return found

        # The main process decides for all (each looking for itself could see different
        # things), and a failure there (a cache it cannot lock) stops them all.
        preparation = procs.from_main(locked_or_complete)
        if not procs.is_main:  # helps the main process; anything it wrote would be discarded
            if preparation is None:
                with tempfile.TemporaryDirectory(prefix="lmc-helper-") as scratch:
                    method.prepare(context(Path(scratch)))
            return None
        if preparation is not None:
            LOG.info("reusing prepared inputs from %s", entry)
        else:
            staged = staged_folder(entry, "keep", sweep_siblings=True, complete=PREPARATION_FILE)
            with staged as work:
                ctx = context(work)
                written = method.prepare(ctx)
                for source, folder in zip(inputs, ctx.outputs, strict=True):
                    write_provenance(folder, method.name, {"source": str(source), "cache_key": key})
                written.write(work / PREPARATION_FILE)
            shutil.rmtree(state_dir, ignore_errors=True)
            # As a later run reads it: every run measures the same record.
            preparation = method.preparation.read(entry / PREPARATION_FILE)
    return Prepared(key=key, entry=entry, folders=context(entry).outputs, preparation=preparation)


def merge_prepared(plan: Plan, prepared: Prepared, folder: Path) -> None:
    """mergekit on the prepared checkpoints, with the method's parameters from the plugin
    section (and the built-in method that section names to combine them, if any)."""
    config = with_prepared(plan.config, dict(zip(plan.inputs, prepared.folders, strict=True)))
    update: dict = {}
    combine = plan.settings.combining_method()
    if combine is not None:
        update["merge_method"] = combine
    extra = plan.settings.merge_parameters()
    if extra:
        update["parameters"] = {**(config.parameters or {}), **extra}
    merge(config.model_copy(update=update), folder, plan.options)


def measure(plan: Plan, prepared: Prepared, folder: Path, finished: Record | None = None) -> Record:
    """The method's report of the merge in ``folder``, with its files copied there: from the
    cache, or measured (running the comparison merges it declares) into a new entry;
    ``finished`` is what the method's finishing step did to the merge."""
    method, report_type = plan.method, plan.method.report
    merge_config = plan.config.model_dump(mode="json")
    key = measurement_key(prepared.key, plan.settings, merge_config, plan.options)
    entry = plan.cache_dir / method.name / MEASUREMENTS_DIR / key
    report = cached_record(entry, report_type.file_name, report_type)  # complete: no lock needed
    if report is None:
        with entry_lock(entry):  # a concurrent run measuring the same merge finishes first
            report = cached_record(entry, report_type.file_name, report_type)
            if report is None:
                _measure_into(entry, plan, prepared, folder, finished)
                report = report_type.read(entry / report_type.file_name)
    shutil.copytree(entry, folder, dirs_exist_ok=True)
    return report


def _measure_into(
    entry: Path, plan: Plan, prepared: Prepared, folder: Path, finished: Record | None = None
) -> None:
    """Measure the merge in ``folder`` into the new cache entry ``entry`` (its report and
    files), running the comparison merges the method declares."""
    method, settings = plan.method, plan.settings
    report_file = method.report.file_name
    with (
        staged_folder(entry, "keep", sweep_siblings=True, complete=report_file) as work,
        tempfile.TemporaryDirectory(prefix=".scratch-", dir=work.parent) as scratch,
    ):
        compared = {
            comparison.name: _compare(comparison, plan, Path(scratch))
            for comparison in method.comparisons(settings, prepared.preparation)
        }
        report = method.measure(
            MeasureContext(
                settings=settings,
                inputs=plan.inputs,
                prepared=prepared.folders,
                preparation=prepared.preparation,
                artefacts=prepared.artefacts,
                merged=folder,
                comparisons=compared,
                test=plan.load_test(),
                options=plan.options,
                scratch=Path(scratch),
                files=work,
                split_for=plan.split_for,
                finished=finished,
                weights=average_weights(plan.config),
            )
        )
        report.write(work / report_file)


def _compare(comparison: Comparison, plan: Plan, scratch: Path) -> Compared:
    """Run one comparison merge into ``scratch``."""
    folder = scratch / comparison.name
    if comparison.merge_method is not None:
        # The plugin's methods weigh every model 1 unless told; a built-in method may not.
        models = [
            entry.model_copy(update={"parameters": {"weight": 1.0, **(entry.parameters or {})}})
            for entry in plan.config.models
        ]
        update = {"merge_method": comparison.merge_method, "models": models}
        merge(plan.config.model_copy(update=update), folder, plan.options)
        return Compared(folder)
    other = replace(plan, settings=comparison.settings)
    prepared = prepare(other, Processes())
    merge_prepared(other, prepared, folder)
    return Compared(folder, prepared.preparation)
