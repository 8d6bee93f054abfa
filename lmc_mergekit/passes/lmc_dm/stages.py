"""The ``lmc_dm`` stages: the pre-merge pass (``prepare``: every input aligned, written and
self-checked), the statistics repair of the merged model (``finish``) and the measurement of
the paths (``measure``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.barrier import interpolation_losses, plot_paths
from lmc_mergekit.evaluation.selfcheck import FunctionCheck
from lmc_mergekit.matching.align import MATCHED_FILE, align
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.adapters.base import DEFAULT_SHARD_SIZE
from lmc_mergekit.models.checkpoint import link_checkpoint, stored_dtype
from lmc_mergekit.models.view import ModelSpec
from lmc_mergekit.passes.base import FinishContext, MeasureContext, PassContext
from lmc_mergekit.passes.device import pass_device
from lmc_mergekit.passes.lmc_dm.records import (
    LINKED,
    ONE_BASIN_LINE,
    PLOT_FILE,
    AlignmentPreparation,
    AlignmentReport,
    LearningRecord,
    PairPaths,
    RepairRecord,
    TieRecord,
    path_label,
)
from lmc_mergekit.passes.lmc_dm.settings import AlignmentSettings, shared_text
from lmc_mergekit.passes.text import MergedLoss, load_recipe_split, model_test_loss
from lmc_mergekit.repair import repair_checkpoint
from lmc_mergekit.runtime.memory import require_memory
from lmc_mergekit.symmetry import Transform
from lmc_mergekit.symmetry.transform import load_transform, save_transform
from lmc_mergekit.transform_checkpoint import CheckedWriter, transform_checkpoint


def prepare(ctx: PassContext) -> AlignmentPreparation:
    """Write one aligned, self-checked checkpoint per input (only the main process writes)."""
    settings: AlignmentSettings = ctx.settings
    # Each process reads on its own: one that fails stops every one with its message.
    with ctx.processes.together():
        views = ctx.open_inputs()
        if len(views) < 2:
            raise LmcError("lmc_dm merges two or more models; the recipe lists one")
        specs = [view.spec for view in views]
        config = settings.align_config(specs, shared_text(ctx.inputs))
        ctx.load_test()  # data before any heavy work
        calibration = None
        if config.reads_text:
            fix = "use matching: weights and steps: 0"
            most = max(
                settings.calibration_sequences if config.learning is not None else 0,
                config.calibration_needed,
            )
            calibration = load_recipe_split(ctx.inputs, settings, "train", most, fix)
        itemsize = max(stored_dtype(view.folder).itemsize for view in views)
        fits = "run it on a machine with more memory"
        if config.matching in ("activations", "both"):
            fits = "use matching: weights, or fewer activation_sequences, or " + fits
        require_memory(
            config.matching_memory(specs[0], itemsize, settings.seq_len), "matching", fits
        )

    def writer(index: int, spec: ModelSpec) -> CheckedWriter:
        # Where weight matching's last round moves a model as it would be written.
        return CheckedWriter(
            views[index],
            spec,
            ctx.outputs[index],
            max_shard_size=_shard_size(ctx),
            progress=ctx.progress and not ctx.options.quiet,
            trust_remote_code=ctx.options.trust_remote_code,
        )

    alignment = align(
        views,
        config,
        None if calibration is None else calibration.sequences,
        device=pass_device(ctx.options),
        state_dir=ctx.state_dir,
        processes=ctx.processes,
        progress=ctx.progress,
        trust_remote_code=ctx.options.trust_remote_code,
        writers=writer,
    )
    seconds = dict(alignment.seconds)
    learning = None
    if alignment.learning is not None:
        result = alignment.learning
        learning = LearningRecord(data=calibration.record, **result.summary(), losses=result.losses)
        if ctx.progress and ctx.processes.is_main:
            tqdm.write(result.outcome())
    if alignment.one_basin and ctx.progress and ctx.processes.is_main:
        tqdm.write(ONE_BASIN_LINE)
    untie_ignored = settings.untie_ignored(specs)
    if not ctx.processes.is_main:
        return AlignmentPreparation(matching=alignment.matching, learning=learning, seconds={})
    started = time.perf_counter()
    written, checks = write_moved(ctx.inputs, ctx.outputs, alignment.final, ctx, alignment.written)
    seconds["writing_and_self_check"] = time.perf_counter() - started
    if learning is not None:  # the measurement walks the weight-matched paths too (same files)
        ctx.artefacts.mkdir(parents=True, exist_ok=True)
        for index, transform in enumerate(alignment.matched):
            save_transform(transform, ctx.artefacts / MATCHED_FILE.format(index))
    tie = _tie_record(specs, written[0], ctx.outputs[0], untie_ignored)
    if tie is not None and ctx.progress:
        tqdm.write(tie.summary_line())
    return AlignmentPreparation(
        matching=alignment.matching,
        learning=learning,
        seconds={key: round(value, 3) for key, value in seconds.items()},
        tied_embeddings=tie,
        one_basin=alignment.one_basin,
        self_check=[LINKED if check is None else check.as_dict() for check in checks],
    )


def write_moved(
    inputs,
    outputs,
    transforms: list[Transform],
    ctx,
    written: dict[int, CheckedWriter] | None = None,
    progress: bool = True,
) -> tuple[list[ModelSpec], list[FunctionCheck | None]]:
    """Every input moved by its transform into ``outputs`` (each self-checked), or published
    by the writer in ``written`` that weight matching already handed it to, or, where its
    transform moves nothing, linked as it is stored (nothing written, nothing to check: None);
    the written specs and what each self-check measured."""
    written = dict(written or {})
    specs, checks = [], []
    try:
        for index, (source, out, transform) in enumerate(
            zip(inputs, outputs, transforms, strict=True)
        ):
            if index in written:
                spec, check = written.pop(index).publish()
            elif transform.is_identity():
                # A copy would only be read by mergekit as the input itself is: a fine-tune
                # and its base (one basin), or a recipe that moves nothing.
                link_checkpoint(source, out)
                spec = open_model(source, ctx.options.trust_remote_code).spec
                check = None
            else:
                spec, check = transform_checkpoint(
                    source,
                    out,
                    transform,
                    max_shard_size=_shard_size(ctx),
                    progress=progress and not ctx.options.quiet,
                    trust_remote_code=ctx.options.trust_remote_code,
                )
            specs.append(spec)
            checks.append(check)
    finally:
        for writer in written.values():  # not reached: nothing half-written stays
            writer.discard()
    return specs, checks


def _shard_size(ctx) -> int:
    """The shards prepared inputs are written in (mergekit's ``--out-shard-size``, at most
    :data:`DEFAULT_SHARD_SIZE`: mergekit holds one whole shard while it merges)."""
    return min(ctx.options.out_shard_size, DEFAULT_SHARD_SIZE)


def _tie_record(
    sources: Sequence[ModelSpec], written: ModelSpec, folder: Path, untie_ignored: str | None
) -> TieRecord | None:
    """What became of tied inputs' ties (None where no input is tied)."""
    tied = [spec.tied_embeddings for spec in sources]
    if not any(tied):
        return None
    source = sources[0]
    parameters = 0 if written.tied_embeddings else source.vocab_size * source.hidden_size
    return TieRecord(
        kept=written.tied_embeddings,
        added_parameters=parameters,
        added_bytes=parameters * stored_dtype(folder).itemsize,
        inputs_tied=None if all(tied) else tied,
        untie_ignored=untie_ignored,
    )


def finish(ctx: FinishContext) -> RepairRecord | None:
    """The statistics repair of the merged model, where the recipe (or the family's default)
    asks for it; None where it does not. A family's default was measured on aligned pairs, so
    it passes over inputs already in one basin; an explicit ``repair: true`` repairs their merge
    too (a base and its fine-tunes, merged as mergekit's linear would)."""
    settings: AlignmentSettings = ctx.settings
    preparation: AlignmentPreparation = ctx.preparation
    spec = open_model(ctx.merged, ctx.options.trust_remote_code).spec
    if not settings.resolved_repair(spec) or (preparation.one_basin and settings.repair is None):
        return None
    if ctx.weights is None:  # only a default asks: an explicit repair was refused up front
        if ctx.progress:
            tqdm.write("no statistics repair: the recipe's weights are not one number per model")
        return None
    started = time.perf_counter()
    calibration = load_recipe_split(
        ctx.inputs, settings, "train", settings.repair_sequences, "set repair: false"
    )
    repair = repair_checkpoint(
        ctx.merged,
        ctx.prepared,
        ctx.weights,
        calibration.sequences,
        pass_device(ctx.options),
        min(ctx.options.out_shard_size, DEFAULT_SHARD_SIZE),
        ctx.options.trust_remote_code,
        ctx.progress,
    )
    return RepairRecord(
        data=calibration.record,
        weights=list(ctx.weights),
        seconds=round(time.perf_counter() - started, 3),
        scales=repair.summary(),
    )


def measure(ctx: MeasureContext) -> AlignmentReport:
    """The paths, the merged model's loss and the plot."""
    settings: AlignmentSettings = ctx.settings
    preparation: AlignmentPreparation = ctx.preparation
    report = AlignmentReport(
        settings=settings,
        inputs=[str(path) for path in ctx.inputs],
        data=None if ctx.test is None else ctx.test.record,
        matching=preparation.matching,
        learning=preparation.learning,
        pairs=[],
        seconds=dict(preparation.seconds),
        tied_embeddings=preparation.tied_embeddings,
        one_basin=preparation.one_basin,
        repair=ctx.finished,
        self_check=preparation.self_check,
    )
    if ctx.test is None:
        return report
    started = time.perf_counter()
    folders = {"raw": ctx.inputs}
    if settings.matching != "none" and not preparation.one_basin:  # else: the raw path
        if preparation.learning is not None:
            folders["matched"] = _weight_matched(ctx)
            folders["learned"] = ctx.prepared
        else:
            folders["matched"] = ctx.prepared
    repair_on = None
    if ctx.finished is not None:  # the merge was repaired: so is the path it comes from
        folders["repaired"] = folders.get("learned", folders.get("matched", ctx.inputs))
        repair_on = load_recipe_split(
            ctx.inputs, settings, "train", settings.repair_sequences
        ).sequences
    merged = model_test_loss(ctx.merged, ctx.test, ctx.options)
    report.merged = MergedLoss(test_loss=merged, tokens=ctx.test.record.tokens)
    # Each distinct function is evaluated once: the moved endpoints are checked symmetries of
    # their inputs (the raw path's endpoints), the merged model is a point of its path.
    final, on_path = list(folders)[-1], merge_lambda(ctx, settings)
    ends: dict[int, float] = {}
    curves = {}
    for index in range(1, len(ctx.inputs)):
        paths = {}
        for kind, models in folders.items():
            known = {0.0: ends[0]} if 0 in ends else {}
            if index in ends:
                known[1.0] = ends[index]
            if kind == final and on_path is not None:
                known[on_path] = merged
            paths[kind] = interpolation_losses(
                models[0],
                models[index],
                ctx.test.sequences,
                points=settings.points,
                device=pass_device(ctx.options),
                progress=ctx.progress,
                repair_on=repair_on if kind == "repaired" else None,
                known=known,
            )
            ends[0], ends[index] = paths[kind].endpoint_losses
            label = path_label(kind, preparation.matching)
            curves[label if len(ctx.inputs) == 2 else f"{label}, 1→{index + 1}"] = paths[kind]
        report.pairs.append(PairPaths(a=str(ctx.inputs[0]), b=str(ctx.inputs[index]), **paths))
    report.reused = reused_losses(folders, final, on_path)
    report.seconds["evaluation"] = round(time.perf_counter() - started, 3)
    plot_paths(ctx.files / PLOT_FILE, curves, "lmc_dm: test loss along the path")
    return report


def merge_lambda(ctx: MeasureContext, settings: AlignmentSettings) -> float | None:
    """Where on its path the merged model of two inputs lies (the second's weight), where it
    is their weighted average; None for more inputs, other weights or another method."""
    weights = ctx.weights
    if settings.combine is not None or weights is None or len(weights) != 2:
        return None
    return weights[1] if abs(sum(weights) - 1) < 1e-9 else None


def reused_losses(folders: dict, final: str, on_path: float | None) -> list[str]:
    """What the evaluation took from elsewhere instead of evaluating again, in words."""
    notes = []
    if len(folders) > 1:
        notes.append(
            f"the endpoints of the {', '.join(list(folders)[1:])} path(s) are the raw path's: "
            "each moved input is a checked symmetry of its source (the same logits)"
        )
    if on_path is not None:
        notes.append(
            f"the {final} path at λ = {on_path:g} is the merged model's own loss (the "
            "checkpoint as written, in its dtype)"
        )
    return notes


def _weight_matched(ctx: MeasureContext) -> tuple[Path, ...]:
    """The inputs moved by weight matching alone (from the pass's artefacts), in scratch."""
    outputs = tuple(ctx.scratch / f"weight-matching-{i}" for i in range(len(ctx.inputs)))
    transforms = [
        load_transform(ctx.artefacts / MATCHED_FILE.format(i)) for i in range(len(ctx.inputs))
    ]
    write_moved(ctx.inputs, outputs, transforms, ctx, progress=False)
    return outputs
