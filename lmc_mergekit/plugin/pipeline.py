"""Running a recipe: the pre-merge pass (cached), then mergekit's own executor."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from mergekit.common import ModelReference
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions

from lmc_mergekit.distributed import Processes, close_processes, processes
from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.checkpoint import model_dir
from lmc_mergekit.passes import PASSES, FinishContext, PassContext
from lmc_mergekit.passes.context import pass_device
from lmc_mergekit.plugin.cache import COMPLETE_FILE, cache_key
from lmc_mergekit.plugin.card import write_card
from lmc_mergekit.plugin.methods import write_provenance
from lmc_mergekit.plugin.recipe import Recipe, parse_recipe
from lmc_mergekit.staging import staged_output

LOG = logging.getLogger(__name__)
# Inside a cache entry: the pass's report files, copied next to every merged model.
REPORT_DIR = "report"


def run_recipe_file(
    recipe_path: str | Path,
    out: str | Path,
    options: MergeOptions,
    cache_dir: Path,
    overwrite: bool = False,
) -> Path:
    """Run a recipe file into ``out`` (written in a staging folder, renamed on success)."""
    path = Path(recipe_path)
    if not path.is_file():
        raise LmcError(f"recipe {str(recipe_path)!r} does not exist")
    recipe = parse_recipe(path.read_text(encoding="utf-8"))
    out = Path(out).expanduser().absolute()
    procs = processes(pass_device(options))
    try:
        if not procs.is_main:
            # Under torchrun / accelerate launch the other processes only help with the pass.
            if recipe.plugin_method is not None:
                prepare_inputs(recipe, options, cache_dir, procs)
            return out
        with staged_output(out, overwrite) as staging:
            run_recipe(recipe, staging, out.name, options, cache_dir, procs)
        return out
    finally:
        close_processes()


def run_recipe(
    recipe: Recipe,
    folder: Path,
    name: str,
    options: MergeOptions,
    cache_dir: Path,
    procs: Processes | None = None,
) -> None:
    """Merge into ``folder``: built-in methods as ``mergekit-yaml`` would; plugin methods after
    their pre-merge pass, on the prepared checkpoints, with a card from the original recipe."""
    if recipe.plugin_method is None:
        run_merge(recipe.config.model_copy(deep=True), str(folder), options, recipe.source)
        return
    prepared, report_dir = prepare_inputs(recipe, options, cache_dir, procs or Processes())
    merge_prepared(recipe, prepared, folder, options)
    if report_dir.is_dir():
        shutil.copytree(report_dir, folder, dirs_exist_ok=True)
    premerge = PASSES[recipe.plugin_method.name]
    summary = ""
    if premerge.finish is not None:
        inputs = tuple(Path(source) for source in prepared)
        summary = premerge.finish(FinishContext(folder, recipe, inputs, options, prepared))
    if options.write_model_card:
        write_card(folder, recipe, name, prepared, summary, premerge.checked)


def merge_prepared(
    recipe: Recipe, prepared: dict[str, Path], folder: Path, options: MergeOptions
) -> None:
    """mergekit's executor on the prepared checkpoints (no card: the caller writes its own),
    with the method's parameters from the plugin section."""
    config = _with_prepared_models(recipe.config, prepared)
    combine = getattr(recipe.settings, "combine", None)
    if combine is not None:
        config = config.model_copy(update={"merge_method": combine})
    extra = recipe.settings.merge_parameters()
    if extra:
        config = config.model_copy(update={"parameters": {**(config.parameters or {}), **extra}})
    run_merge(
        config,
        str(folder),
        options.model_copy(update={"write_model_card": False}),
        recipe.source,
    )


def recipe_inputs(config: MergeConfiguration, method: str) -> list[Path]:
    """The distinct local checkpoint folders a plugin recipe names, in recipe order."""
    if config.slices or config.modules or not config.models:
        raise LmcError(
            f"{method} recipes list whole models under 'models:'; slices are not supported"
        )
    refs = [entry.model for entry in config.models]
    if config.base_model is not None:
        refs.insert(0, config.base_model)
    paths: list[Path] = []
    for ref in refs:
        if ref.lora is not None:
            raise LmcError(f"{method} does not take LoRA inputs ({ref}); merge the adapter first")
        path = model_dir(ref.model.path)
        if path not in paths:
            paths.append(path)
    return paths


def prepare_inputs(
    recipe: Recipe, options: MergeOptions, cache_dir: Path, procs: Processes
) -> tuple[dict[str, Path], Path]:
    """Prepared checkpoints for every input (from the cache, or by running the method's pass),
    and the folder holding the pass's report files. Resumable state of an interrupted pass
    lives next to the entry until the pass succeeds."""
    method = recipe.plugin_method.name
    inputs = recipe_inputs(recipe.config, method)
    key = cache_key(method, recipe.settings, inputs + recipe.settings.dependencies())
    entry = cache_dir / method / key
    state_dir = cache_dir / method / f".{key}.state"
    outputs = [entry / f"model-{i}" for i in range(len(inputs))]
    if (entry / COMPLETE_FILE).is_file():
        LOG.info("reusing prepared inputs from %s", entry)
    else:
        entry.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{key}.partial-", dir=entry.parent))
        try:
            ctx = PassContext(
                method=method,
                inputs=tuple(inputs),
                outputs=tuple(work / out.name for out in outputs),
                settings=recipe.settings,
                options=options,
                report_dir=work / REPORT_DIR,
                state_dir=state_dir,
                cache_dir=cache_dir / method,
                base_model=None
                if recipe.config.base_model is None
                else model_dir(recipe.config.base_model.model.path),
                processes=procs,
            )
            PASSES[method].run(ctx)
            if not procs.is_main:
                return {}, entry / REPORT_DIR
            for source, folder in zip(inputs, ctx.outputs, strict=True):
                write_provenance(folder, method, {"source": str(source), "cache_key": key})
            (work / COMPLETE_FILE).write_text(
                json.dumps({"inputs": [str(p) for p in inputs]}, indent=2), encoding="utf-8"
            )
            if entry.exists():  # an interrupted or concurrent run left one behind
                shutil.rmtree(entry)
            work.rename(entry)
            shutil.rmtree(state_dir, ignore_errors=True)
        finally:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)
    prepared = {str(source): out for source, out in zip(inputs, outputs, strict=True)}
    return prepared, entry / REPORT_DIR


def _with_prepared_models(
    config: MergeConfiguration, prepared: dict[str, Path]
) -> MergeConfiguration:
    def swap(ref: ModelReference) -> ModelReference:
        target = prepared[str(model_dir(ref.model.path))]
        return ModelReference.model_validate(str(target))

    update = {"models": [m.model_copy(update={"model": swap(m.model)}) for m in config.models]}
    if config.base_model is not None:
        update["base_model"] = swap(config.base_model)
    return config.model_copy(update=update, deep=True)
