"""The ``lmc_dm`` pre-merge pass: move every input into one basin by symmetries.

Every input is written with its norms absorbed. Weight matching moves every input after the
first onto the first (``matching: weights``); with ``steps > 0`` learned matching then trains
continuous symmetries of every input (the first too, unless ``dual: false``) so that the mixes
of all of them have a low loss, and each input is written moved by both. With ``evaluate`` the
pass measures the loss along the path from the first input to each other one, on the test
split, for the raw checkpoints, after weight matching and after learned matching, and writes
``lmc_report.json`` and ``lmc_barrier.png``; :func:`finish` adds the merged model's own loss.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.barrier import PathLoss, interpolation_losses, plot_paths
from lmc_mergekit.matching import match_weights
from lmc_mergekit.matching.learned_matching import LearningConfig, learn_symmetries
from lmc_mergekit.models.adapters.base import DEFAULT_SHARD_SIZE
from lmc_mergekit.models.functional import FunctionalModel
from lmc_mergekit.models.view import materialize
from lmc_mergekit.passes.context import FinishContext, PassContext, pass_device
from lmc_mergekit.passes.recipe_data import add_merged_loss, load_recipe_split
from lmc_mergekit.plugin.recipe import AlignmentSettings
from lmc_mergekit.symmetry import Transform, apply_transform
from lmc_mergekit.symmetry.transform import load_transform, save_transform
from lmc_mergekit.transform_checkpoint import transform_checkpoint

REPORT_FILE = "lmc_report.json"
PLOT_FILE = "lmc_barrier.png"
LABELS = {"raw": "raw", "matched": "weight matching", "learned": "learned matching"}
EVALUATE_FIX = "set 'evaluate: false' under alignment:"
# Inside the state folder: the weight-matching transforms, so a resumed run skips matching.
MATCHED_FILE = "weight-matching-{}.safetensors"


def run(ctx: PassContext) -> None:
    """Write one aligned checkpoint per input and the report (with the measured paths when
    ``evaluate`` is set); in a distributed run only the main process writes."""
    settings: AlignmentSettings = ctx.settings
    views = ctx.open_inputs()
    if len(views) < 2:
        raise LmcError("lmc_dm merges two or more models; the recipe lists one")
    # Data first, so bad data fails before any heavy work.
    test = _load_split(ctx.inputs, settings, "test") if settings.evaluate else None
    calibration = _load_split(ctx.inputs, settings, "train") if settings.steps else None
    progress = not ctx.options.quiet and ctx.processes.is_main
    started = time.perf_counter()
    matched, matching = _weight_matching(ctx, views, progress)
    seconds = {"matching": time.perf_counter() - started}
    final, learning = matched, None
    if settings.steps:
        started = time.perf_counter()
        matched_views = zip(views, matched, strict=True)
        endpoints = [materialize(apply_transform(view, t)) for view, t in matched_views]
        result = learn_symmetries(
            endpoints,
            FunctionalModel(
                views[0].folder,
                views[0].adapter,
                endpoints[0].spec,
                pass_device(ctx.options),
                ctx.options.trust_remote_code,
            ),
            calibration[0],
            learning_config(settings),
            state_dir=ctx.state_dir,
            processes=ctx.processes,
            progress=progress,
        )
        final = [t.then(u) for t, u in zip(matched, result.transforms, strict=True)]
        learning = {"data": calibration[1], **result.summary(), "losses": result.losses}
        seconds["learning"] = time.perf_counter() - started
    if not ctx.processes.is_main:
        return
    started = time.perf_counter()
    _write_all(ctx, ctx.outputs, final, progress)
    seconds["writing_and_self_check"] = time.perf_counter() - started
    pairs, curves, data = [], {}, None
    if test is not None:
        started = time.perf_counter()
        sequences, data = test
        pairs, curves = _measure_paths(ctx, sequences, matched if learning else None, progress)
        seconds["evaluation"] = time.perf_counter() - started
    report = {
        "method": "lmc_dm",
        "settings": settings.model_dump(mode="json"),
        "inputs": [str(path) for path in ctx.inputs],
        "data": data,
        "matching": matching,
        "learning": learning,
        "pairs": pairs,
        "seconds": {key: round(value, 3) for key, value in seconds.items()},
    }
    ctx.report_dir.mkdir(parents=True, exist_ok=True)
    (ctx.report_dir / REPORT_FILE).write_text(json.dumps(report, indent=2), encoding="utf-8")
    if curves:
        plot_paths(ctx.report_dir / PLOT_FILE, curves, "lmc_dm: test loss along the path")


def learning_config(settings: AlignmentSettings) -> LearningConfig:
    """The learned-matching part of the recipe's settings."""
    return LearningConfig(
        steps=settings.steps,
        lr=settings.lr,
        warmup=settings.warmup,
        batch_size=settings.batch_size,
        weight_decay=settings.weight_decay,
        sampler=settings.sampler,
        dual=settings.dual,
        families=tuple(settings.learn),
        parametrization=settings.parametrization,
        checkpoint_every=settings.checkpoint_every,
        seed=settings.seed,
    )


def _weight_matching(ctx: PassContext, views, progress: bool) -> tuple[list[Transform], list]:
    """Every input's transform onto the first (reused from the state folder after a restart)."""
    settings: AlignmentSettings = ctx.settings
    # The baseline merges the checkpoints as they are; aligned ones all have their norms absorbed.
    absorb = settings.matching != "none"
    transforms = [Transform(views[0].spec.num_layers, absorb_norms=absorb)]
    matching = []
    for index, view in enumerate(views[1:], start=1):
        saved = ctx.state_dir / MATCHED_FILE.format(index)
        if not absorb:
            transforms.append(Transform(view.spec.num_layers))
            continue
        if saved.is_file():
            transforms.append(load_transform(saved))
            matching.append({"model": str(view.folder), "reused": str(saved)})
            continue
        result = match_weights(
            views[0], view, max_iterations=settings.max_iterations, progress=progress
        )
        transforms.append(result.transform)
        if settings.steps and ctx.processes.is_main:
            ctx.state_dir.mkdir(parents=True, exist_ok=True)
            save_transform(result.transform, saved)
        matching.append(
            {
                "model": str(view.folder),
                "iterations": result.iterations,
                "seconds": round(result.seconds, 3),
                "relative_distance": {"before": result.distances[0], "after": result.distance},
            }
        )
    return transforms, matching


def _write_all(ctx: PassContext, outputs, transforms: list[Transform], progress: bool) -> None:
    """Every input moved by its transform into ``outputs`` (each self-checked)."""
    for source, out, transform in zip(ctx.inputs, outputs, transforms, strict=True):
        transform_checkpoint(
            source,
            out,
            transform,
            max_shard_size=min(ctx.options.out_shard_size, DEFAULT_SHARD_SIZE),
            progress=progress,
            trust_remote_code=ctx.options.trust_remote_code,
        )


def _measure_paths(
    ctx: PassContext,
    sequences: torch.Tensor,
    matched: list[Transform] | None,
    progress: bool,
) -> tuple[list[dict], dict[str, PathLoss]]:
    """The loss along the path from the first input to each other one: raw, aligned (the
    outputs) and, when ``matched`` is given, after weight matching alone (written to a scratch
    folder for the measurement)."""
    folders = {"raw": ctx.inputs}
    scratch = ctx.report_dir.parent / "weight-matching"
    if ctx.settings.matching != "none":
        if matched is not None:
            outputs = tuple(scratch / out.name for out in ctx.outputs)
            _write_all(ctx, outputs, matched, progress=False)
            folders["matched"] = outputs
        folders["learned" if matched is not None else "matched"] = ctx.outputs
    pairs, curves = [], {}
    try:
        for index in range(1, len(ctx.inputs)):
            pair = {"a": str(ctx.inputs[0]), "b": str(ctx.inputs[index])}
            for kind, ends in folders.items():
                path = interpolation_losses(
                    ends[0],
                    ends[index],
                    sequences,
                    points=ctx.settings.points,
                    device=pass_device(ctx.options),
                    progress=progress,
                )
                pair[kind] = path.to_dict()
                label = LABELS[kind]
                curves[label if len(ctx.inputs) == 2 else f"{label}, 1→{index + 1}"] = path
            pairs.append(pair)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return pairs, curves


def finish(ctx: FinishContext) -> str:
    """Add the merged model's test loss to the report; the card's summary of the barriers."""
    report = add_merged_loss(ctx, REPORT_FILE, AlignmentSettings, EVALUATE_FIX)
    if report is None or not report["settings"]["evaluate"]:
        return ""
    return card_section(report)


def card_section(report: dict) -> str:
    """Markdown quoting the barriers before and after alignment and the merged model's loss."""
    lines = [
        "### Loss barrier (lmc-mergekit report)\n",
        f"Test split of {report['data']['description']} ({report['data']['tokens']} tokens). "
        "Barrier = highest loss along the straight path between two models minus the mean of "
        "their own losses, for the raw checkpoints and after each alignment stage.\n",
        "| models | endpoint losses | raw | weight matching | learned matching |",
        "|---|---|---|---|---|",
    ]
    for pair in report["pairs"]:
        raw = pair["raw"]
        ends = ", ".join(f"{loss:.3f}" for loss in raw["endpoint_losses"])
        cells = [
            f"{pair[kind]['barrier']:.3f}" if kind in pair else "–"
            for kind in ("raw", "matched", "learned")
        ]
        lines.append(
            f"| `{Path(pair['a']).name}` – `{Path(pair['b']).name}` | {ends} | "
            + " | ".join(cells)
            + " |"
        )
    if "merged" in report:
        lines.append(f"\nMerged model test loss: {report['merged']['test_loss']:.3f}.")
    lines.append(f"\n![loss along the path]({PLOT_FILE})\n")
    return "\n".join(lines)


def _load_split(
    inputs: tuple[Path, ...], settings: AlignmentSettings, split: str
) -> tuple[torch.Tensor, dict]:
    """Test sequences for evaluation, or train sequences for learned matching."""
    if split == "test":
        return load_recipe_split(inputs, settings, split, settings.eval_sequences, EVALUATE_FIX)
    return load_recipe_split(
        inputs, settings, split, settings.calibration_sequences, "use steps: 0"
    )
