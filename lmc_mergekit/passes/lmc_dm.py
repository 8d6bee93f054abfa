"""The ``lmc_dm`` pre-merge pass: move every input into the first input's basin by symmetries.

Every input is written with its norms absorbed; every input after the first is moved by the
symmetry weight matching finds against the first (``matching: weights``). With ``evaluate`` the
pass measures the loss along the path from the first input to each other one, on the test split,
for the raw checkpoints and for the aligned ones, and writes ``lmc_report.json`` and
``lmc_barrier.png``; :func:`finish` adds the merged model's own loss.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.barrier import PathLoss, interpolation_losses, plot_paths
from lmc_mergekit.matching import match_weights
from lmc_mergekit.models.adapters.base import DEFAULT_SHARD_SIZE
from lmc_mergekit.passes.context import FinishContext, PassContext, pass_device
from lmc_mergekit.plugin.recipe import AlignmentSettings
from lmc_mergekit.symmetry import Transform
from lmc_mergekit.transform_checkpoint import transform_checkpoint

REPORT_FILE = "lmc_report.json"
PLOT_FILE = "lmc_barrier.png"
ALIGNED_LABEL = "weight matching"


def run(ctx: PassContext) -> None:
    """Write one aligned checkpoint per input, and the report when ``evaluate`` is set."""
    settings: AlignmentSettings = ctx.settings
    views = ctx.open_inputs()
    if len(views) < 2:
        raise LmcError("lmc_dm merges two or more models; the recipe lists one")
    if settings.steps:
        raise LmcError(
            "lmc_dm: learned matching (steps > 0) is not implemented yet in this version; use "
            "'steps: 0' for weight matching alone"
        )
    test = _load_test(ctx.inputs, settings) if settings.evaluate else None
    progress = not ctx.options.quiet
    reference, others = views[0], views[1:]
    started = time.perf_counter()
    # The baseline merges the checkpoints as they are; aligned ones all have their norms absorbed.
    transforms = [Transform(reference.spec.num_layers, absorb_norms=settings.matching != "none")]
    matching = []
    for view in others:
        if settings.matching == "none":
            transforms.append(Transform(view.spec.num_layers))
            continue
        result = match_weights(
            reference, view, max_iterations=settings.max_iterations, progress=progress
        )
        transforms.append(result.transform)
        matching.append(
            {
                "model": str(view.folder),
                "iterations": result.iterations,
                "seconds": round(result.seconds, 3),
                "relative_distance": {"before": result.distances[0], "after": result.distance},
            }
        )
    matched = time.perf_counter()
    for view, out, transform in zip(views, ctx.outputs, transforms, strict=True):
        transform_checkpoint(
            view.folder,
            out,
            transform,
            max_shard_size=min(ctx.options.out_shard_size, DEFAULT_SHARD_SIZE),
            progress=progress,
            trust_remote_code=ctx.options.trust_remote_code,
        )
    written = time.perf_counter()
    if test is None:
        return
    sequences, data = test
    pairs, curves = _measure_paths(ctx, sequences)
    report = {
        "method": "lmc_dm",
        "settings": settings.model_dump(mode="json"),
        "inputs": [str(path) for path in ctx.inputs],
        "data": data,
        "matching": matching,
        "pairs": pairs,
        "seconds": {
            "matching": round(matched - started, 3),
            "writing_and_self_check": round(written - matched, 3),
            "evaluation": round(time.perf_counter() - written, 3),
        },
    }
    ctx.report_dir.mkdir(parents=True, exist_ok=True)
    (ctx.report_dir / REPORT_FILE).write_text(json.dumps(report, indent=2), encoding="utf-8")
    plot_paths(ctx.report_dir / PLOT_FILE, curves, "lmc_dm: test loss along the path")


def _measure_paths(
    ctx: PassContext, sequences: torch.Tensor
) -> tuple[list[dict], dict[str, PathLoss]]:
    """The loss along the path from the first input to each other one, raw and aligned."""
    aligned = ctx.settings.matching != "none"
    pairs, curves = [], {}
    for index in range(1, len(ctx.inputs)):
        pair = {"a": str(ctx.inputs[0]), "b": str(ctx.inputs[index])}
        ends = {"raw": (ctx.inputs[0], ctx.inputs[index])}
        if aligned:
            ends["aligned"] = (ctx.outputs[0], ctx.outputs[index])
        for kind, (a, b) in ends.items():
            path = interpolation_losses(
                a,
                b,
                sequences,
                points=ctx.settings.points,
                device=pass_device(ctx.options),
                progress=not ctx.options.quiet,
            )
            pair[kind] = path.to_dict()
            label = "raw" if kind == "raw" else ALIGNED_LABEL
            curves[label if len(ctx.inputs) == 2 else f"{label}, 1→{index + 1}"] = path
        pairs.append(pair)
    return pairs, curves


def finish(ctx: FinishContext) -> str:
    """Add the merged model's test loss to the report; the card's summary of the barriers."""
    path = ctx.folder / REPORT_FILE
    if not path.is_file():
        return ""
    report = json.loads(path.read_text(encoding="utf-8"))
    settings = AlignmentSettings.model_validate(report["settings"])
    sequences, _ = _load_test(ctx.inputs, settings)
    from lmc_mergekit.evaluation.loss import mean_token_loss
    from lmc_mergekit.evaluation.selfcheck import load_fp32

    model = load_fp32(ctx.folder, ctx.options.trust_remote_code).to(pass_device(ctx.options))
    loss = mean_token_loss(model, sequences, progress=not ctx.options.quiet)
    report["merged"] = {"test_loss": loss.loss, "tokens": loss.tokens}
    path.write_text(json.dumps(report, indent=2), encoding="utf-8")
    return card_section(report)


def card_section(report: dict) -> str:
    """Markdown quoting the barriers before and after alignment and the merged model's loss."""
    lines = [
        "### Loss barrier (lmc-mergekit report)\n",
        f"Test split of {report['data']['description']} ({report['data']['tokens']} tokens). "
        "Barrier = highest loss along the straight path between two models minus the mean of "
        "their own losses.\n",
        "| models | endpoint losses | barrier before | barrier after |",
        "|---|---|---|---|",
    ]
    for pair in report["pairs"]:
        raw = pair["raw"]
        after = pair.get("aligned", raw)
        ends = ", ".join(f"{loss:.3f}" for loss in raw["endpoint_losses"])
        lines.append(
            f"| `{Path(pair['a']).name}` – `{Path(pair['b']).name}` | {ends} | "
            f"{raw['barrier']:.3f} | {after['barrier']:.3f} |"
        )
    if "merged" in report:
        lines.append(f"\nMerged model test loss: {report['merged']['test_loss']:.3f}.")
    lines.append(f"\n![loss along the path]({PLOT_FILE})\n")
    return "\n".join(lines)


def _load_test(inputs: tuple[Path, ...], settings: AlignmentSettings) -> tuple[torch.Tensor, dict]:
    """The evaluation sequences, loaded before any heavy work so bad data fails fast."""
    from lmc_mergekit.data import DataConfig, load_split, load_tokenizer

    try:
        tokenizer = load_tokenizer(inputs)
    except LmcError as error:
        raise LmcError(f"{error} (or set 'evaluate: false' under alignment:)") from None
    config = DataConfig(source=settings.data, field=settings.field, seq_len=settings.seq_len)
    sequences = load_split(config, tokenizer, "test", settings.eval_sequences)
    data = {
        "description": config.describe(),
        "split": "test",
        "sequences": int(sequences.shape[0]),
        "seq_len": settings.seq_len,
        "tokens": int(sequences.shape[0] * (settings.seq_len - 1)),
    }
    return sequences, data
