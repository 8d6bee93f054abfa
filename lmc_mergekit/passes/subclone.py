"""The ``subclone_compensate`` pre-merge pass: each donor turned into a smaller model of its
family (see :mod:`lmc_mergekit.subclone.convert`), written as a stock checkpoint of the target
shape, reloaded through ``transformers`` and checked to compute what the conversion computed.
mergekit then writes the converted model (one donor) or their weighted average (several).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import torch
from pydantic import Field, model_validator

from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.selfcheck import (
    FunctionCheck,
    judged,
    load_fp32,
    relative_logits_error,
)
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.adapters.base import DEFAULT_SHARD_SIZE
from lmc_mergekit.models.block_runner import BlockRunner
from lmc_mergekit.models.view import ModelSpec
from lmc_mergekit.passes.base import (
    MeasureContext,
    PassContext,
    Report,
    TextSettings,
    untie_where_mixed,
)
from lmc_mergekit.passes.device import pass_device
from lmc_mergekit.passes.text import MergedLoss, SplitRecord, load_recipe_split, model_test_loss
from lmc_mergekit.runtime.memory import release_freed_memory, require_memory
from lmc_mergekit.runtime.records import Record
from lmc_mergekit.subclone.convert import (
    ConversionConfig,
    check_convertible,
    compensation_features,
    convert_model,
)
from lmc_mergekit.subclone.heal import SUBCLONE_REPORT
from lmc_mergekit.subclone.target import resolve_target

# Self-check probe: the first calibration sequences, cut to this many tokens.
PROBE = (2, 48)
SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
)


class SubcloneSettings(TextSettings):
    """``subclone:`` for ``subclone_compensate``."""

    model_keys: ClassVar[dict[str, bool]] = {"target_config": False}

    hidden_size: int | None = Field(None, gt=0, description="target width")
    num_hidden_layers: int | None = Field(None, gt=0, description="target depth")
    num_attention_heads: int | None = Field(None, gt=0, description="target query heads")
    num_key_value_heads: int | None = Field(
        None, gt=0, description="target key/value heads (default: the donor's group size kept)"
    )
    head_dim: int | None = Field(
        None, gt=0, description="target head size where config.json stores it (Llama family)"
    )
    intermediate_size: int | None = Field(None, gt=0, description="target MLP width")
    target_config: str | None = Field(
        None, description="config.json (or its folder) of a model of the target shape"
    )
    compensate: bool = Field(
        True, description="refit attention output and MLP down by least squares"
    )
    rescale: Literal["none", "o_down", "all"] = Field(
        "none",
        description="multiply by sqrt(n/n'): none, attention output + MLP down, all (on a "
        "compensated model it over-corrects: docs/results.md)",
    )
    selection: Literal["weight_norm", "random"] = Field(
        "weight_norm", description="rank heads, dims and units by weight norm, or at random"
    )
    ridge: Annotated[float, Field(gt=0)] | Literal["auto"] = Field(
        "auto",
        description="ridge strength relative to the mean feature energy, or auto: chosen per "
        "fit on held-out calibration batches",
    )
    seed: int = Field(0, ge=0, description="seed of the random selection")
    calibration_sequences: int = Field(
        256, ge=1, description="train-split sequences the conversion calibrates on"
    )

    @model_validator(mode="after")
    def _needs_target(self) -> SubcloneSettings:
        named = [key for key in SHAPE_KEYS if getattr(self, key) is not None]
        if self.target_config is None and not named:
            raise ValueError("name a target shape (hidden_size, ...) or a target_config")
        if self.target_config is not None and named:
            raise ValueError(
                f"give either target_config or shape keys ({', '.join(named)}), not both"
            )
        return self

    def dependencies(self) -> list[Path]:
        path = Path(self.target_config or "").expanduser()
        if self.target_config is None or not path.exists():
            return []  # a missing target_config is the pass's one-line error
        return [path.resolve() if path.is_dir() else path.resolve().parent]


class DonorLosses(Record):
    """A donor's and its converted model's test loss."""

    donor: float
    converted: float


class DonorRecord(Record):
    """What the conversion kept of one donor, how well the written checkpoint checked, and
    (measured) the losses."""

    omit_if_none: ClassVar[tuple[str, ...]] = ("test_loss",)

    donor: str
    donor_shape: dict
    conversion: dict
    #: What the check of the written checkpoint measured (error, noise, tolerance:
    #: :class:`~lmc_mergekit.evaluation.selfcheck.FunctionCheck`).
    self_check: dict
    seconds: float
    test_loss: DonorLosses | None = None


class SubclonePreparation(Record):
    """The target shape, the calibration text and every donor's conversion."""

    target_shape: dict
    calibration: SplitRecord
    device: str
    donors: list[DonorRecord]


class SubcloneReport(Report):
    """``subclone_report.json`` (:data:`~lmc_mergekit.subclone.heal.SUBCLONE_REPORT`: healing
    reads the donor it names)."""

    file_name: ClassVar[str] = SUBCLONE_REPORT
    omit_if_none: ClassVar[tuple[str, ...]] = ("merged",)

    method: str = "subclone_compensate"
    settings: SubcloneSettings
    target_shape: dict
    calibration: SplitRecord
    test: SplitRecord | None
    device: str
    donors: list[DonorRecord]
    merged: MergedLoss | None = None

    def card_section(self) -> str:
        """Markdown: the target shape, what each donor kept, the calibration and the losses."""
        shape, settings, calibration = self.target_shape, self.settings, self.calibration
        lines = [
            "### Size conversion (lmc-mergekit report)\n",
            f"Target: hidden {shape['hidden_size']}, {shape['num_layers']} layers, "
            f"{shape['num_heads']} heads ({shape['num_kv_heads']} key/value) of "
            f"{shape['head_dim']} dims ({shape['rotary_dims']} rotary, base "
            f"{shape['rope_theta']:g}), MLP {shape['intermediate_size']}. "
            f"Selection by {settings.selection.replace('_', ' ')}; compensation "
            f"{'on' if settings.compensate else 'off'}; rescale {settings.rescale}. "
            f"Calibration: {calibration.sequences} sequences ({calibration.tokens} tokens) "
            f"of {calibration.description}.\n",
        ]
        if note := calibration.tokenizer_note():
            lines.append(note + "\n")
        header = "| donor | kept layers | residual channels | rotary pairs (base) |"
        if self.test is not None:
            header += " donor test loss | converted test loss |"
        lines += [header, "|" + "---|" * (header.count("|") - 1)]
        for donor in self.donors:
            record = donor.conversion
            rotary = record["rotary"]
            adjusted = " adjusted" if rotary["adjusted"] else ""
            row = (
                f"| `{Path(donor.donor).name}` | {record['kept_layers']} | "
                f"{len(record['residual_channels'])} of {donor.donor_shape['hidden_size']} | "
                f"{rotary['kept_pairs']} ({rotary['rope_theta']:g}{adjusted}) |"
            )
            if donor.test_loss is not None:
                row += f" {donor.test_loss.donor:.3f} | {donor.test_loss.converted:.3f} |"
            lines.append(row)
        if self.merged is not None:
            lines.append(f"\nMerged model test loss: {self.merged.test_loss:.3f}.")
        return "\n".join(lines)


def prepare(ctx: PassContext) -> SubclonePreparation | None:
    """Convert every donor into ``ctx.outputs``, each written checkpoint checked."""
    if not ctx.processes.is_main:
        return None  # the conversion runs in one process
    settings: SubcloneSettings = ctx.settings
    views = [open_model(path, ctx.options.trust_remote_code) for path in ctx.inputs]
    untie_where_mixed(views, ctx.progress)
    for view in views[1:]:
        if view.adapter is not views[0].adapter:
            raise LmcError(
                f"subclone_compensate converts donors of one family: {views[0].folder.name} is "
                f"{views[0].spec.architecture}, {view.folder.name} is {view.spec.architecture}"
            )
    sizes = settings.model_dump(include=set(SHAPE_KEYS))
    targets = [
        resolve_target(view.spec, view.adapter, sizes, settings.target_config, view.folder)
        for view in views
    ]
    _check_same_target(views, [target for target, _ in targets])
    config = ConversionConfig(
        compensate=settings.compensate,
        rescale=settings.rescale,
        selection=settings.selection,
        seed=settings.seed,
        ridge=settings.ridge,
    )
    check_convertible(views[0].spec, config)
    # Data before any heavy work, so missing or short text fails first.
    calibration = load_recipe_split(
        ctx.inputs, settings, "train", settings.calibration_sequences, spread=True
    )
    if settings.compensate:
        _check_enough_tokens(targets[0][0], calibration.record, settings)
    ctx.load_test()
    fits = "fewer calibration_sequences, or run it on a machine with more memory"
    require_memory(conversion_memory(views[0].spec), "the conversion", fits)
    device = pass_device(ctx.options)
    donors = []
    for view, (target, plan), out in zip(views, targets, ctx.outputs, strict=True):
        started = time.perf_counter()
        conversion = convert_model(
            view,
            target,
            plan,
            calibration.sequences,
            config,
            device,
            ctx.progress,
            ctx.options.trust_remote_code,
        )
        view.adapter.save(
            conversion.view,
            out,
            view.folder,
            max_shard_size=min(ctx.options.out_shard_size, DEFAULT_SHARD_SIZE),
            progress=ctx.progress,
        )
        expected, ids = _conversion_logits(view, conversion.view, calibration.sequences, ctx)
        record = conversion.record
        del conversion  # the small model, before transformers loads its written copy
        release_freed_memory()
        check = _check_written(expected, ids, out, ctx)
        donors.append(
            DonorRecord(
                donor=str(view.folder),
                donor_shape=view.spec.shape_summary(),
                conversion=record,
                self_check=check.as_dict(),
                seconds=round(time.perf_counter() - started, 3),
            )
        )
    target = targets[0][0]
    return SubclonePreparation(
        target_shape={**target.shape_summary(), "rope_theta": target.rope_theta},
        calibration=calibration.record,
        device=str(device),
        donors=donors,
    )


def measure(ctx: MeasureContext) -> SubcloneReport:
    """Each donor's and converted model's test loss, and the merged model's."""
    preparation: SubclonePreparation = ctx.preparation
    report = SubcloneReport(
        settings=ctx.settings,
        test=None if ctx.test is None else ctx.test.record,
        **preparation.model_dump(),
    )
    if ctx.test is None:
        return report
    for donor, converted in zip(report.donors, ctx.prepared, strict=True):
        donor.test_loss = DonorLosses(
            donor=model_test_loss(Path(donor.donor), ctx.test, ctx.options),
            converted=model_test_loss(converted, ctx.test, ctx.options),
        )
    report.merged = MergedLoss(
        test_loss=model_test_loss(ctx.merged, ctx.test, ctx.options),
        tokens=ctx.test.record.tokens,
    )
    return report


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


def _check_enough_tokens(target, data: SplitRecord, settings: SubcloneSettings) -> None:
    """Each compensation fit needs more calibration tokens than it has features."""
    features = compensation_features(target)
    if data.tokens < features:
        per_sequence = settings.seq_len - 1
        need = -(-4 * features // per_sequence)
        raise LmcError(
            f"calibration gives {data.tokens} tokens ({data.sequences} sequences) but "
            f"compensation fits {features} features per projection; give at least "
            f"{features} tokens, better {need} sequences of {settings.seq_len} "
            "(calibration_sequences, or more text under data:), or set compensate: false"
        )


#: What a conversion holds at its peak beyond the process's start, as a multiple of its donor
#: in float32 (measured: 1.0–1.2 on SmolLM2-135M at d=192 and d=384).
CONVERSION_MEMORY = 1.2


def conversion_memory(donor: ModelSpec) -> int:
    """The bytes converting a donor of ``donor`` holds at its peak (estimate: see
    :data:`CONVERSION_MEMORY`)."""
    return int(CONVERSION_MEMORY * 4 * donor.parameters)


def _conversion_logits(view, converted, calibration, ctx) -> tuple[dict, torch.Tensor]:
    """The logits the conversion ``converted`` of ``view`` computes block by block on a probe
    batch of ``calibration`` in float32 and in float64 (by dtype), and the probe batch."""
    batch, length = PROBE
    ids = calibration[:batch, :length]
    logits = {}
    for dtype in (torch.float32, torch.float64):
        runner = BlockRunner(
            view.folder,
            view.adapter,
            converted.spec,
            torch.device("cpu"),
            ctx.options.trust_remote_code,
            dtype,
        )
        logits[dtype] = runner.logits(converted, ids)
    return logits, ids


def _check_written(expected: dict, ids: torch.Tensor, out: Path, ctx) -> FunctionCheck:
    """Reload the written checkpoint through ``transformers``: on ``ids`` it must compute the
    conversion's float64 logits ``expected[torch.float64]`` within the tolerance of the
    conversion's float32 noise there (catches any config or layout mismatch)."""
    with torch.no_grad():
        actual = load_fp32(out, ctx.options.trust_remote_code)(ids).logits
    # The conversion's view holds exactly the written values (in their dtype): both sides
    # compute one set of weights, whatever the storage dtype.
    wide = expected[torch.float64]
    return judged(
        relative_logits_error(actual, wide),
        relative_logits_error(expected[torch.float32], wide),
        f"the written {out.name}",
        "the conversion's own",
        "its config or layout is not the conversion's",
    )
