"""The ``subclone_compensate`` pre-merge pass: each donor turned into a smaller model of its
family (see :mod:`lmc_mergekit.subclone.convert`), written as a stock checkpoint of the target
shape, reloaded through ``transformers`` and checked to compute what the conversion computed.
mergekit then writes the converted model (one donor) or their weighted average (several).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.selfcheck import load_fp32, relative_logits_error, tolerance_for
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.adapters.base import DEFAULT_SHARD_SIZE, load_config
from lmc_mergekit.models.block_runner import BlockRunner
from lmc_mergekit.passes.context import FinishContext, PassContext, pass_device
from lmc_mergekit.passes.recipe_data import (
    add_merged_loss,
    load_recipe_split,
    load_test_split,
    model_test_loss,
)
from lmc_mergekit.plugin.recipe import SHAPE_KEYS, SubcloneSettings
from lmc_mergekit.subclone.convert import (
    ConversionConfig,
    compensation_features,
    convert_model,
)
from lmc_mergekit.subclone.target import resolve_target

REPORT_FILE = "subclone_report.json"
EVALUATE_FIX = "set 'evaluate: false' under subclone:"
# Self-check probe: the first calibration sequences, cut to this many tokens.
PROBE = (2, 48)


def run(ctx: PassContext) -> None:
    """Convert every donor into ``ctx.outputs`` and write ``subclone_report.json``."""
    if not ctx.processes.is_main:
        return  # the conversion runs in one process
    settings: SubcloneSettings = ctx.settings
    views = [open_model(path, ctx.options.trust_remote_code) for path in ctx.inputs]
    for view in views[1:]:
        if view.adapter is not views[0].adapter:
            raise LmcError(
                f"subclone_compensate converts donors of one family: {views[0].folder.name} is "
                f"{views[0].spec.architecture}, {view.folder.name} is {view.spec.architecture}"
            )
    sizes = settings.model_dump(include=set(SHAPE_KEYS))
    targets = [
        resolve_target(view.spec, view.adapter, sizes, settings.target_config, _rope_type(view))
        for view in views
    ]
    _check_same_target(views, [target for target, _ in targets])
    # Data before any heavy work, so missing or short text fails first.
    calibration, calibration_data = load_recipe_split(
        ctx.inputs,
        settings,
        "train",
        settings.calibration_sequences,
    )
    if settings.compensate:
        _check_enough_tokens(targets[0][0], calibration_data, settings)
    test = load_test_split(ctx.inputs, settings, EVALUATE_FIX)
    device = pass_device(ctx.options)
    progress = not ctx.options.quiet
    config = ConversionConfig(
        compensate=settings.compensate,
        rescale=settings.rescale,
        selection=settings.selection,
        seed=settings.seed,
        ridge=settings.ridge,
    )
    donors = []
    for view, (target, plan), out in zip(views, targets, ctx.outputs, strict=True):
        started = time.perf_counter()
        conversion = convert_model(
            view,
            target,
            plan,
            calibration,
            config,
            device,
            progress,
            ctx.options.trust_remote_code,
        )
        view.adapter.save(
            conversion.view,
            out,
            view.folder,
            max_shard_size=min(ctx.options.out_shard_size, DEFAULT_SHARD_SIZE),
            progress=progress,
        )
        error = _check_written(view, conversion.view, out, calibration, ctx)
        entry = {
            "donor": str(view.folder),
            "donor_shape": view.spec.shape_summary(),
            "conversion": conversion.record,
            "self_check_error": error,
            "seconds": round(time.perf_counter() - started, 3),
        }
        if test is not None:
            entry["test_loss"] = {
                "donor": model_test_loss(view.folder, test[0], ctx.options),
                "converted": model_test_loss(out, test[0], ctx.options),
            }
        donors.append(entry)
    target = targets[0][0]
    report = {
        "method": "subclone_compensate",
        "settings": settings.model_dump(mode="json"),
        "target_shape": {**target.shape_summary(), "rope_theta": target.rope_theta},
        "calibration": calibration_data,
        "test": None if test is None else test[1],
        "device": str(device),
        "donors": donors,
    }
    ctx.report_dir.mkdir(parents=True, exist_ok=True)
    (ctx.report_dir / REPORT_FILE).write_text(json.dumps(report, indent=2), encoding="utf-8")


def _rope_type(view) -> str | None:
    params = getattr(load_config(view.folder), "rope_parameters", None) or {}
    return params.get("rope_type")


def _check_same_target(views, targets) -> None:
    first = targets[0]
    for view, target in zip(views[1:], targets[1:], strict=True):
        mismatch = first.shape_mismatch(target)
        if mismatch is None and target.rope_theta != first.rope_theta:
            mismatch = ("rope_theta", first.rope_theta, target.rope_theta)
        if mismatch is not None:
            key, a, b = mismatch
            raise LmcError(
                f"the donors convert to different shapes ({key} {a} for {views[0].folder.name}, "
                f"{b} for {view.folder.name}); name every size under subclone: or use "
                "target_config"
            )


def _check_enough_tokens(target, data: dict, settings: SubcloneSettings) -> None:
    """Each compensation fit needs more calibration tokens than it has features."""
    features = compensation_features(target)
    if data["tokens"] < features:
        per_sequence = settings.seq_len - 1
        need = -(-4 * features // per_sequence)
        raise LmcError(
            f"calibration gives {data['tokens']} tokens ({data['sequences']} sequences) but "
            f"compensation fits {features} features per projection; give at least "
            f"{features} tokens, better {need} sequences of {settings.seq_len} "
            "(calibration_sequences, or more text under data:), or set compensate: false"
        )


def _check_written(view, converted, out: Path, calibration, ctx) -> float:
    """Reload the written checkpoint through ``transformers``: it must compute the logits the
    conversion computed block by block (catches any config or layout mismatch)."""
    batch, length = PROBE
    ids = calibration[:batch, :length]
    runner = BlockRunner(
        view.folder,
        view.adapter,
        converted.spec,
        torch.device("cpu"),
        ctx.options.trust_remote_code,
    )
    expected = runner.logits(converted, ids)
    with torch.no_grad():
        actual = load_fp32(out, ctx.options.trust_remote_code)(ids).logits
    error = relative_logits_error(actual, expected)
    tolerance = tolerance_for(out)
    if not error <= tolerance:
        raise LmcError(
            f"self-check failed: the written {out.name} computes logits {error:.2e} (relative) "
            f"away from the conversion's own, above {tolerance:.0e}; nothing was kept"
        )
    return error


def finish(ctx: FinishContext) -> str:
    """Add the merged model's test loss to the report; the card's summary of the conversion."""
    report = add_merged_loss(ctx, REPORT_FILE, SubcloneSettings, EVALUATE_FIX)
    return "" if report is None else card_section(report)


def card_section(report: dict) -> str:
    """Markdown: the target shape, what each donor kept, the calibration and the losses."""
    shape = report["target_shape"]
    settings = report["settings"]
    calibration = report["calibration"]
    lines = [
        "### Size conversion (lmc-mergekit report)\n",
        f"Target: hidden {shape['hidden_size']}, {shape['num_layers']} layers, "
        f"{shape['num_heads']} heads ({shape['num_kv_heads']} key/value) of "
        f"{shape['head_dim']} dims ({shape['rotary_dims']} rotary, base "
        f"{shape['rope_theta']:g}), MLP {shape['intermediate_size']}. "
        f"Selection by {settings['selection'].replace('_', ' ')}; compensation "
        f"{'on' if settings['compensate'] else 'off'}; rescale {settings['rescale']}. "
        f"Calibration: {calibration['sequences']} sequences ({calibration['tokens']} tokens) "
        f"of {calibration['description']}.\n",
    ]
    header = "| donor | kept layers | residual channels | rotary pairs (base) |"
    if report.get("test"):
        header += " donor test loss | converted test loss |"
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for donor in report["donors"]:
        record = donor["conversion"]
        rotary = record["rotary"]
        adjusted = " adjusted" if rotary["adjusted"] else ""
        row = (
            f"| `{Path(donor['donor']).name}` | {record['kept_layers']} | "
            f"{len(record['residual_channels'])} of {donor['donor_shape']['hidden_size']} | "
            f"{rotary['kept_pairs']} ({rotary['rope_theta']:g}{adjusted}) |"
        )
        if "test_loss" in donor:
            loss = donor["test_loss"]
            row += f" {loss['donor']:.3f} | {loss['converted']:.3f} |"
        lines.append(row)
    if "merged" in report:
        lines.append(f"\nMerged model test loss: {report['merged']['test_loss']:.3f}.")
    return "\n".join(lines)
