"""``ls_merge``: every input encoded into a weight autoencoder's latent space, merged there.

The pre-merge pass obtains the autoencoder (given, cached, or trained on the recipe's models
and any ``extra_models``) and writes one prepared folder per input
(:func:`lmc_mergekit.latent.prepare.prepare_latents`); mergekit then runs the registered
``ls_merge`` method, which averages the latents per tensor and decodes them. The measurement
reports every input's original and decoded test loss, the merged model's, mergekit's ``linear``
merge of the same recipe and the noise floor (the merge redone with a second autoencoder):
both comparison merges are declared here and run by the pipeline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from pydantic import Field, model_validator

from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.chunks import model_tensors
from lmc_mergekit.latent.prepare import LatentInput, prepare_latents, target_only_pieces
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.checkpoint import model_dir
from lmc_mergekit.models.view import ModelSpec
from lmc_mergekit.passes.autoencoder_cache import check_fits, obtain_autoencoder
from lmc_mergekit.passes.base import (
    Comparison,
    MeasureContext,
    PassContext,
    Report,
    TextSettings,
    untie_where_mixed,
)
from lmc_mergekit.passes.device import pass_device
from lmc_mergekit.passes.text import MergedLoss, SplitRecord, model_test_loss
from lmc_mergekit.runtime.memory import require_memory
from lmc_mergekit.runtime.records import Record

WEIGHT_AVERAGE, NOISE_FLOOR = "weight_average", "noise_floor"


class LatentSettings(TextSettings):
    """``latent:`` for ``ls_merge``."""

    model_keys: ClassVar[dict[str, bool]] = {"extra_models": True}
    merge_only: ClassVar[tuple[str, ...]] = ("samples", "sample_seed", "keep_residuals")
    # The autoencoder trains on weights, not text: the text only evaluates.
    measure_only: ClassVar[tuple[str, ...]] = (
        *TextSettings.measure_only,
        "data",
        "field",
        "seq_len",
        "noise_floor",
    )

    compression_ratio: float = Field(
        1.6,
        ge=1.0,
        le=16.0,
        description="chunk values per latent number (1.6: the paper's working point)",
    )
    chunk_size: int = Field(64, ge=8, le=1024, description="weights per chunk (one token)")
    width: int = Field(128, ge=8, description="autoencoder transformer width")
    depth: int = Field(2, ge=1, description="transformer layers of the encoder and the decoder")
    steps: int = Field(2000, ge=1, description="autoencoder training steps")
    batch_size: int = Field(32, ge=1, description="windows of 16 chunks per training step")
    lr: float = Field(1e-3, gt=0, description="peak AdamW learning rate")
    beta: float = Field(1e-3, ge=0, description="KL weight of the variational stage")
    autoencoder_fraction: float = Field(
        0.5, ge=0, le=1, description="fraction of the steps trained with the KL term off"
    )
    seed: int = Field(0, ge=0, description="seed of the autoencoder's initialisation and batches")
    autoencoder: str | None = Field(
        None,
        description="a trained autoencoder (.safetensors from an earlier run) to use instead "
        "of training one",
    )
    extra_models: list[str] = Field(
        [], description="more checkpoints the autoencoder trains on (not merged)"
    )
    samples: int = Field(
        0,
        ge=0,
        description="posterior samples averaged per model (0: posterior means; a self-merge "
        "of one model needs at least 1)",
    )
    sample_seed: int = Field(0, ge=0, description="seed of the posterior samples")
    keep_residuals: bool = Field(
        True,
        description="add the inputs' reconstruction residuals (original − decoded), averaged "
        "with the merge weights, to the decoded merge (false: the paper's plain decode)",
    )
    shrinkage: float = Field(
        0.1, ge=0, le=1, description="covariance shrinkage of the optimal-transport map"
    )
    noise_floor: bool = Field(
        True,
        description="with evaluate: train a second autoencoder (seed + 1) and report the "
        "merged loss spread",
    )

    @model_validator(mode="after")
    def _fits_chunk(self) -> LatentSettings:
        if self.compression_ratio > self.chunk_size:
            raise ValueError(
                f"compression_ratio {self.compression_ratio:g} leaves less than one latent number "
                f"per chunk of {self.chunk_size}"
            )
        return self

    def dependencies(self) -> list[Path]:
        folders = [model_dir(path) for path in self.extra_models]
        if self.autoencoder is not None and Path(self.autoencoder).expanduser().is_file():
            folders.append(Path(self.autoencoder).expanduser().resolve().parent)
        return folders

    def evaluation_inputs(self, inputs: tuple[Path, ...], base_model: Path | None):
        # A heterogeneous merge has the target's shape and tokenizer (the source may have
        # another): the test split is the target's.
        return inputs[:1] if base_model is not None else inputs

    def check_inputs(
        self, inputs: list[Path], base_model: Path | None, trust_remote_code: bool = False
    ) -> None:
        if len(inputs) == 1 and self.samples == 0:
            raise LmcError(
                "ls_merge got one model and no self-merge setting; set latent: samples: K (a "
                "self-merge of K posterior samples) or list more models"
            )
        views = [open_model(path, trust_remote_code) for path in inputs]
        extra = [open_model(p, trust_remote_code) for p in self.extra_models]
        merge_kind(views, base_model)
        _check_families(views, extra)

    def merge_parameters(self) -> dict:
        """mergekit parameters of the ``ls_merge`` method that this section sets."""
        return {
            "samples": self.samples,
            "seed": self.sample_seed,
            "residuals": self.keep_residuals,
        }


class AutoencoderRecord(Record):
    """An autoencoder: its file, config and where it came from (given, cached or trained, with
    the training record)."""

    path: str
    config: dict
    record: dict


class InputLosses(Record):
    """An input's test loss and that of its plain encode–decode (λ = 0)."""

    original: float
    decoded: float


class InputRecord(Record):
    """One input's role, shape and reconstruction error per tensor, and (measured) its losses
    and prepared folder."""

    omit_if_none: ClassVar[tuple[str, ...]] = ("test_loss", "prepared")

    model: str
    role: str
    shape: dict
    reconstruction_error: dict[str, float]
    mean_reconstruction_error: float
    seconds: float
    test_loss: InputLosses | None = None
    prepared: str | None = None


class LatentPreparation(Record):
    """What the pass did: the merge kind, the autoencoder, each input, the transport."""

    kind: str
    autoencoder: AutoencoderRecord
    device: str
    inputs: list[InputRecord]
    transport: dict | None


class WeightAverage(Record):
    """The same recipe merged by plain weight averaging (None where that is impossible)."""

    test_loss: float | None
    note: str


class NoiseFloor(Record):
    """The merged loss with the two autoencoder seeds, and their spread."""

    seeds: list[int | None]
    merged_test_losses: list[float]
    spread: float


class LatentReport(Report):
    """``ls_report.json``."""

    file_name: ClassVar[str] = "ls_report.json"
    omit_if_none: ClassVar[tuple[str, ...]] = ("merged", "weight_average")

    method: str = "ls_merge"
    kind: str
    settings: LatentSettings
    autoencoders: list[AutoencoderRecord]
    device: str
    test: SplitRecord | None
    inputs: list[InputRecord]
    transport: dict | None
    merged: MergedLoss | None = None
    weight_average: WeightAverage | None = None
    noise_floor: NoiseFloor | None = None

    def card_section(self) -> str:
        """Markdown: the autoencoder, each input's reconstruction and losses, the merge against
        weight averaging, the noise floor."""
        settings, first = self.settings, self.autoencoders[0]
        record = first.record
        samples = settings.samples or "none (posterior means)"
        trained = ""
        if "steps" in record:
            trained = f", {record['steps']} steps in {record['seconds']:.0f} s"
        lines = [
            "### Latent-space merge (lmc-mergekit report)\n",
            f"A {self.kind} merge through a weight autoencoder (chunks of "
            f"{first.config['chunk_size']}, compression ratio "
            f"{first.config['compression_ratio']:g}, {record.get('source', 'given')}"
            + f"{trained}). Posterior samples per model: {samples}; "
            + (
                "the inputs' reconstruction residuals added back to the decoded merge.\n"
                if settings.keep_residuals
                else "plain decode (reconstruction residuals not kept).\n"
            ),
        ]
        if self.test is not None and (note := self.test.tokenizer_note()):
            lines.append(note + "\n")
        header = "| input | role | mean reconstruction error |"
        if self.test is not None:
            header += " original test loss | decoded test loss (λ = 0) |"
        lines += [header, "|" + "---|" * (header.count("|") - 1)]
        for entry in self.inputs:
            row = (
                f"| `{Path(entry.model).name}` | {entry.role} | "
                f"{entry.mean_reconstruction_error:.3f} |"
            )
            if entry.test_loss is not None:
                row += f" {entry.test_loss.original:.3f} | {entry.test_loss.decoded:.3f} |"
            lines.append(row)
        if self.kind == "heterogeneous" and self.test is not None:
            lines.append(
                "\nThe source's decoded loss is that of its latents moved onto the target "
                "(optimal transport only, no interpolation)."
            )
        if self.merged is not None:
            lines.append(f"\nMerged model test loss: {self.merged.test_loss:.3f}.")
        average = self.weight_average
        if average is not None and average.test_loss is not None:
            lines.append(f"Plain weight averaging ({average.note}): {average.test_loss:.3f}.")
        noise = self.noise_floor
        if noise is not None:
            lines.append(
                f"Noise floor (autoencoder seeds {noise.seeds[0]} and {noise.seeds[1]}): "
                f"merged losses {noise.merged_test_losses[0]:.3f} and "
                f"{noise.merged_test_losses[1]:.3f}, spread {noise.spread:.3f}."
            )
        return "\n".join(lines)


#: What latent merging holds at its peak beyond the process's start, as a multiple of its
#: models in float32 (measured: 1.24 for SmolLM2-135M merged with itself).
LATENT_MEMORY = 1.3


def latent_memory(specs: list[ModelSpec]) -> int:
    """The bytes latent merging of models of ``specs`` holds at its peak (estimate: see
    :data:`LATENT_MEMORY`)."""
    return int(LATENT_MEMORY * 4 * sum(spec.parameters for spec in specs))


def prepare(ctx: PassContext) -> LatentPreparation | None:
    """Encode every input into ``ctx.outputs``."""
    if not ctx.processes.is_main:
        return None  # the pass runs in one process
    settings: LatentSettings = ctx.settings
    views = [open_model(path, ctx.options.trust_remote_code) for path in ctx.inputs]
    extra = [open_model(path, ctx.options.trust_remote_code) for path in settings.extra_models]
    kind = merge_kind(views, ctx.base_model)
    _check_families(views, extra)
    if kind == "homogeneous":  # onto a target, the target's layout (and tie) is written
        untie_where_mixed(views, ctx.progress)
    ctx.load_test()  # data before any heavy work
    fits = "fewer models (extra_models), or run it on a machine with more memory"
    require_memory(latent_memory([v.spec for v in views + extra]), "latent merging", fits)
    models = [LatentInput.read(view) for view in views]
    if kind == "heterogeneous":  # before any training: every target block tensor needs a source
        for model in models[1:]:
            if model.moves_onto(models[0]):
                target_only_pieces(models[0], model)
    device = pass_device(ctx.options)
    path, autoencoder, record = obtain_autoencoder(
        settings,
        [view.folder for view in views + extra],
        lambda: [t for view in views + extra for t in model_tensors(view)],
        ctx.cache_dir,
        ctx.state_dir,
        device,
        ctx.progress,
    )
    for model in models:
        check_fits(autoencoder, model.canonical, model.view.folder.name)
    entries, transport = prepare_latents(
        autoencoder,
        path,
        models,
        list(ctx.outputs),
        kind == "heterogeneous",
        settings.shrinkage,
        ctx.progress,
    )
    return LatentPreparation(
        kind=kind,
        autoencoder=AutoencoderRecord(
            path=str(path), config=json.loads(autoencoder.config.to_json()), record=record
        ),
        device=str(device),
        inputs=entries,
        transport=transport,
    )


def comparisons(settings: LatentSettings, preparation: LatentPreparation) -> list[Comparison]:
    """With evaluation: mergekit's ``linear`` on the originals (where the inputs share one
    shape) and the merge with a second autoencoder (seed + 1) for the noise floor."""
    if not settings.evaluate:
        return []
    found = []
    if preparation.kind == "homogeneous":
        found.append(Comparison(WEIGHT_AVERAGE, merge_method="linear"))
    if settings.noise_floor and settings.autoencoder is None:
        second = settings.model_copy(update={"seed": settings.seed + 1})
        found.append(Comparison(NOISE_FLOOR, settings=second))
    return found


def measure(ctx: MeasureContext) -> LatentReport:
    """Every input's original and decoded test loss, the merged model's, weight averaging's
    and the noise floor's."""
    preparation: LatentPreparation = ctx.preparation
    report = LatentReport(
        kind=preparation.kind,
        settings=ctx.settings,
        autoencoders=[preparation.autoencoder],
        device=preparation.device,
        test=None if ctx.test is None else ctx.test.record,
        inputs=preparation.inputs,
        transport=preparation.transport,
    )
    for entry, prepared in zip(report.inputs, ctx.prepared, strict=True):
        entry.prepared = str(prepared)
    if ctx.test is None:
        return report
    loss = {}

    def test_loss(folder: Path) -> float:
        if folder not in loss:
            loss[folder] = model_test_loss(folder, ctx.test, ctx.options)
        return loss[folder]

    for entry, prepared in zip(report.inputs, ctx.prepared, strict=True):
        original = Path(entry.model)  # tokenised by its own tokenizer, which may be another
        entry.test_loss = InputLosses(
            original=model_test_loss(original, ctx.split_for(original), ctx.options),
            decoded=test_loss(prepared),
        )
    merged = test_loss(ctx.merged)
    report.merged = MergedLoss(test_loss=merged, tokens=ctx.test.record.tokens)
    if report.kind == "heterogeneous":
        report.weight_average = WeightAverage(
            test_loss=None, note="weights of different shapes cannot be averaged"
        )
    elif report.kind == "self-merge":
        report.weight_average = WeightAverage(
            test_loss=report.inputs[0].test_loss.original,
            note="one model: weight averaging returns it unchanged",
        )
    else:
        report.weight_average = WeightAverage(
            test_loss=test_loss(ctx.comparisons[WEIGHT_AVERAGE].folder),
            note="mergekit linear with the recipe's weights",
        )
    if NOISE_FLOOR in ctx.comparisons:
        compared = ctx.comparisons[NOISE_FLOOR]
        second: LatentPreparation = compared.preparation
        report.autoencoders.append(second.autoencoder)
        other = test_loss(compared.folder)
        report.noise_floor = NoiseFloor(
            seeds=[a.record.get("seed") for a in report.autoencoders],
            merged_test_losses=[merged, other],
            spread=abs(merged - other),
        )
    return report


def _check_families(views, extra) -> None:
    """``extra_models`` of a family the merge has (:func:`merge_kind` checks the inputs)."""
    families = {view.spec.architecture for view in views}
    for view in extra:
        if view.spec.architecture not in families:
            raise LmcError(
                f"extra model {view.folder.name} is {view.spec.architecture}, not of one family "
                f"with a merged model ({', '.join(sorted(families))}); the autoencoder trains on "
                "the families it merges"
            )


def merge_kind(views, base_model: Path | None) -> str:
    """``self-merge``, ``homogeneous`` or ``heterogeneous`` (models of different shapes or
    families; then the target, the recipe's ``base_model``, comes first)."""
    if len(views) == 1:
        return "self-merge"
    first = views[0]
    targeted = base_model is not None and base_model == first.folder
    for view in views[1:]:
        if view.spec.architecture != first.spec.architecture and not targeted:
            raise LmcError(
                f"ls_merge merges models of one family, unless one is the target of a "
                f"heterogeneous merge: {first.folder.name} is {first.spec.architecture}, "
                f"{view.folder.name} is {view.spec.architecture}; name the target as base_model"
            )
        mismatch = first.spec.shape_mismatch(view.spec)
        if mismatch is not None and not targeted:
            key, a, b = mismatch
            raise LmcError(
                f"models of different shapes ({key} {a} in {first.folder.name}, {b} in "
                f"{view.folder.name}) need a heterogeneous merge: name the target as base_model"
            )
        if mismatch is not None or view.spec.architecture != first.spec.architecture:
            return "heterogeneous"
    return "homogeneous"
