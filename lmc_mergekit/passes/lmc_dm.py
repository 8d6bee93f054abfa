"""``lmc_dm``: move every input into one basin by symmetries, then measure the paths.

The pre-merge pass writes every input with its norms absorbed, moved by weight or activation
matching onto the first (``matching: weights | activations``) and, with ``steps > 0``, by the
continuous symmetries learned matching trained for all of them
(:func:`lmc_mergekit.matching.align.align`); each is self-checked. The measurement evaluates the
loss along the path from the first input to each other one on the test split, for the raw
checkpoints, after matching and after learned matching, and the merged model's own loss; it
writes ``lmc_report.json`` and ``lmc_barrier.png``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator
from tqdm.auto import tqdm

from lmc_mergekit.data.tokenizer import shared_tokenizer
from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.barrier import PathLoss, interpolation_losses, plot_paths
from lmc_mergekit.evaluation.selfcheck import FunctionCheck
from lmc_mergekit.matching.align import MATCHED_FILE, AlignConfig, Matching, align
from lmc_mergekit.matching.learned_matching import LearningConfig, check_learnable
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.adapters.base import DEFAULT_SHARD_SIZE
from lmc_mergekit.models.checkpoint import stored_dtype
from lmc_mergekit.models.view import ModelSpec
from lmc_mergekit.passes.base import (
    FinishContext,
    MeasureContext,
    PassContext,
    Report,
    TextSettings,
    check_one_shape,
)
from lmc_mergekit.passes.device import pass_device
from lmc_mergekit.passes.text import MergedLoss, SplitRecord, load_recipe_split, model_test_loss
from lmc_mergekit.repair import repair_checkpoint
from lmc_mergekit.runtime.memory import require_memory
from lmc_mergekit.runtime.records import Record
from lmc_mergekit.symmetry import Transform
from lmc_mergekit.symmetry.group import DEFAULT_FAMILIES, symmetry_group, untying_gains
from lmc_mergekit.symmetry.transform import load_transform, save_transform
from lmc_mergekit.transform_checkpoint import CheckedWriter, transform_checkpoint

# Learned-matching steps when a recipe does not say (about a minute for a d=128 pair on 2 cores).
DEFAULT_STEPS = 200
PLOT_FILE = "lmc_barrier.png"
ONE_BASIN_LINE = (
    "The inputs already sit in one basin (no matching lowers their mix clearly below that of "
    "the models as they are, as for a base model and its fine-tunes): they are merged as they "
    "are, as mergekit's linear merge would merge them, and nothing is learned."
)
LABELS = {"raw": "raw", "learned": "learned matching", "repaired": "repaired"}
#: Families whose merges are repaired unless a recipe says otherwise: where the repair lowered
#: the barrier of the aligned path on the pairs measured (docs/results.md).
REPAIRED_BY_DEFAULT: frozenset[str] = frozenset()


def shared_text(inputs: Sequence[Path]) -> bool:
    """Whether the models in ``inputs`` can read one text: each has a tokenizer, and they
    agree on their vocabulary."""
    try:
        shared_tokenizer(inputs)
    except LmcError:
        return False
    return True


def path_label(kind: str, matching: list[dict]) -> str:
    """How the report and the plot name the path ``kind`` (raw, matched, learned), the
    matched one by the matching the records say ran."""
    if kind != "matched":
        return LABELS[kind]
    ran = next((r["matching"] for r in matching if r.get("matching", "kept") != "kept"), "weights")
    return f"{ran.removesuffix('s')} matching"  # weight / activation


# Settings that only learned matching reads (they change nothing with steps: 0).
LEARNING_KEYS = (
    "lr",
    "warmup",
    "batch_size",
    "weight_decay",
    "sampler",
    "dual",
    "learn",
    "parametrization",
    "checkpoint_every",
    "seed",
)
# Settings of the calibration text (read by learned and activation matching).
TEXT_KEYS = ("calibration_sequences", "data", "field", "seq_len")


class AlignmentSettings(TextSettings):
    """``alignment:`` for ``lmc_dm``."""

    merge_only: ClassVar[tuple[str, ...]] = ("combine", "repair", "repair_sequences")
    measure_only: ClassVar[tuple[str, ...]] = (*TextSettings.measure_only, "points")

    matching: Literal["auto", "none", "weights", "activations"] = Field(
        "auto",
        description="none: merge the raw checkpoints (the baseline); weights: start from weight "
        "matching; activations: from activation matching on calibration text; auto: both "
        "where the residual group is discrete (post-norm and sandwich-norm families, kept "
        "ties), the one whose mix scores lower on calibration text kept; weights elsewhere",
    )
    steps: int = Field(
        DEFAULT_STEPS,
        ge=0,
        description="learned-matching steps after weight matching (0: weight matching only)",
    )
    max_iterations: int = Field(
        30, ge=1, description="weight matching: most rounds of coordinate descent"
    )
    lr: float = Field(0.01, gt=0, description="learned matching: peak AdamW learning rate")
    warmup: float = Field(
        0.1, ge=0, lt=1, description="learned matching: fraction of the steps warming up"
    )
    batch_size: int = Field(16, ge=1, description="learned matching: sequences per step")
    weight_decay: float = Field(0.0, ge=0, description="learned matching: AdamW weight decay")
    sampler: Literal["uniform", "band", "half"] = Field(
        "uniform",
        description="λ per step: uniform (flat Dirichlet), band (near the centre), half (fixed)",
    )
    dual: bool = Field(
        True, description="learn the first model's symmetries too (false: one-sided)"
    )
    learn: list[Literal["residual", "permutation", "scale", "qk", "ov"]] = Field(
        list(DEFAULT_FAMILIES), description="the symmetry families learned"
    )
    parametrization: Literal["polar", "cayley", "matrix_exp", "unconstrained"] = Field(
        "polar", description="how maps are parametrised (see symmetry.parametrize)"
    )
    activation_sequences: int = Field(
        64, ge=1, description="activation matching: calibration sequences both models read"
    )
    checkpoint_every: int = Field(
        50, ge=1, description="learned matching: steps between resumable checkpoints"
    )
    seed: int = Field(0, ge=0, description="learned matching: seed of batches and λ")
    calibration_sequences: int = Field(
        4096, ge=1, description="most train-split sequences learned matching draws from"
    )
    combine: str | None = Field(
        None,
        description="mergekit method combining the aligned models (default: the recipe's "
        "weighted average)",
    )
    points: int = Field(11, ge=3, description="λ grid points along the path")
    repair: bool | None = Field(
        None,
        description="rescale the merged model's units to the inputs' interpolated statistics "
        "on calibration text (REPAIR); default: per family, as measured",
    )
    repair_sequences: int = Field(
        64, ge=1, description="train-split sequences the statistics repair reads"
    )
    one_basin_check: bool = Field(
        True,
        description="score the models as they are against each matching on calibration text "
        "and merge them as they are (as mergekit's linear) unless a matching clearly does "
        "better (false: a matching is always kept)",
    )
    tied_embeddings: Literal["untie", "keep"] = Field(
        "keep",
        description="models whose head is tied to their embeddings: keep (the inputs' "
        "architecture: residual maps restricted to signed permutations, final norm gain kept, "
        "tied checkpoints) or untie (any residual rotation the family admits; writes a "
        "separate LM head; ignored where the family's stream admits signed permutations only)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> AlignmentSettings:
        if self.matching == "none":
            if self.steps and "steps" in self.model_fields_set:
                raise ValueError(
                    "learned matching (steps > 0) starts from matching; set matching: auto, "
                    "weights or activations, or steps: 0"
                )
            self.steps = 0  # the baseline learns nothing
        if self.steps and not self.learn:
            raise ValueError("learn: is empty; name a symmetry family or set steps: 0")
        return self

    def preparation_settings(self, inputs: Sequence[Path] = ()) -> dict:
        settings = super().preparation_settings(inputs)
        with_text = shared_text(inputs) if inputs else True
        if inputs:  # keyed by what runs
            specs = [open_model(path).spec for path in inputs]
            settings["matching"] = self.resolved_matching(specs, with_text)
            settings["tied_embeddings"] = "keep" if self.keeps_tie(specs) else "untie"
        unread = set()
        if not self.steps:
            unread |= set(LEARNING_KEYS)
        if settings["matching"] not in ("activations", "both", "auto"):
            unread.add("activation_sequences")
            scored = settings["matching"] == "weights" and with_text and self.one_basin_check
            if not self.steps and not scored:
                unread |= set(TEXT_KEYS)  # nothing is matched or scored on text
        for key in unread:
            settings.pop(key, None)
        return settings

    def keeps_tie(self, specs: Sequence[ModelSpec]) -> bool:
        """Whether ties are kept for inputs of ``specs``: every input tied, and ``keep``
        asked for or untying would buy no symmetry (:func:`untying_gains`)."""
        if not all(spec.tied_embeddings for spec in specs):
            return False
        return self.tied_embeddings == "keep" or not untying_gains(specs[0])

    def untie_ignored(self, specs: Sequence[ModelSpec]) -> str | None:
        """The one line saying why ``untie`` is ignored for inputs of ``specs`` (None where it
        is not asked for, or is done)."""
        if self.tied_embeddings != "untie" or not self.keeps_tie(specs):
            return None
        spec = specs[0]
        reason = symmetry_group(spec).why["residual"]
        return (
            f"tied_embeddings: untie ignored: the {spec.architecture} model's residual stream "
            f"admits signed permutations only, tied or not ({reason}); a separate LM head "
            f"({spec.vocab_size * spec.hidden_size:,} parameters) would buy nothing, so the "
            "tie is kept"
        )

    def resolved_matching(self, specs: Sequence[ModelSpec], with_text: bool = True) -> Matching:
        """The matching these settings run on inputs of ``specs`` (``auto`` resolved; models
        without one tokenizer (``with_text`` false) have no text to be matched on)."""
        if self.matching != "auto":
            return self.matching
        group = symmetry_group(specs[0], self.keeps_tie(specs))
        discrete = group.residual in ("signed_permutation", "permutation")
        return "both" if discrete and with_text else "weights"

    def combining_method(self) -> str | None:
        return self.combine

    def needs_plain_weights(self) -> bool:
        return self.repair is True

    def resolved_repair(self, spec: ModelSpec) -> bool:
        """Whether the merged model of inputs of ``spec`` is repaired (``repair`` unset: the
        family's measured default)."""
        if self.repair is not None:
            return self.repair
        return spec.architecture in REPAIRED_BY_DEFAULT

    def check_inputs(
        self, inputs: list[Path], base_model: Path | None, trust_remote_code: bool = False
    ) -> None:
        """Two or more models of one architecture and shape (tied or not), and, when the
        recipe learns, a family of symmetries they admit: refused in seconds, before any
        matching or learning."""
        if len(inputs) < 2:
            raise LmcError("lmc_dm merges two or more models; the recipe lists one")
        views = [open_model(path, trust_remote_code) for path in inputs]
        check_one_shape(views, "lmc_dm")
        if self.steps:
            specs = [view.spec for view in views]
            check_learnable(specs[0], self.learn, self.keeps_tie(specs))

    def align_config(self, specs: Sequence[ModelSpec], with_text: bool = True) -> AlignConfig:
        """What :func:`~lmc_mergekit.matching.align.align` does for these settings on inputs
        of ``specs`` (that have tokenizers, or not: ``with_text``)."""
        keep_tie = self.keeps_tie(specs)
        learning = None
        if self.steps:
            learning = LearningConfig(
                steps=self.steps,
                lr=self.lr,
                warmup=self.warmup,
                batch_size=self.batch_size,
                weight_decay=self.weight_decay,
                sampler=self.sampler,
                dual=self.dual,
                families=tuple(self.learn),
                parametrization=self.parametrization,
                checkpoint_every=self.checkpoint_every,
                seed=self.seed,
                keep_tie=keep_tie,
            )
        return AlignConfig(
            self.resolved_matching(specs, with_text),
            self.max_iterations,
            learning,
            keep_tie,
            self.activation_sequences,
            score=with_text,
            one_basin_check=self.one_basin_check,
        )


class LearningRecord(Record):
    """How learned matching went: its calibration data and per-step losses."""

    data: SplitRecord
    steps: int
    families: list[str] = Field(default_factory=list)
    seconds: float
    first_loss: float | None
    last_loss: float | None
    rollbacks: list[dict]
    resumed_from_step: int | None
    processes: int = 1
    endpoint_mib_per_process: float = 0.0
    parts_held_whole: int = 0
    parts: int = 0
    #: The held-out watch (sequences, scores per step, the step kept; see learned matching).
    held_out: dict | None = None
    losses: list[float]


class TieRecord(Record):
    """What became of inputs that tie their LM head to their embeddings: kept tied, or untied
    (a separate head of ``vocab × hidden`` parameters added to every prepared input and to the
    merged model; bytes as stored). ``inputs_tied`` says which inputs were tied: a tie is kept
    only where every input ties (``tied_embeddings: keep``)."""

    omit_if_none: ClassVar[tuple[str, ...]] = ("inputs_tied", "untie_ignored")

    kept: bool
    added_parameters: int
    added_bytes: int
    inputs_tied: list[bool] | None = None
    #: Why a recipe's ``tied_embeddings: untie`` was ignored (the family gains nothing by it).
    untie_ignored: str | None = None

    def card_line(self) -> str:
        """One sentence for the model card."""
        if self.kept:
            line = (
                "The inputs tie their LM head to their embeddings and the merge keeps it tied, "
                "as the inputs' architecture has it (residual maps restricted to signed "
                "permutations)."
            )
            return line + (f" The recipe's {self.untie_ignored}." if self.untie_ignored else "")
        added = (
            f"adding an LM head of {self.added_parameters:,} parameters "
            f"({self.added_bytes / 2**20:,.0f} MiB as stored) to the merged model."
        )
        if self.inputs_tied is not None and not all(self.inputs_tied):
            tied = [str(i + 1) for i, t in enumerate(self.inputs_tied) if t]
            return (
                f"Input {', '.join(tied)} of the {len(self.inputs_tied)} ties its LM head to "
                "its embeddings and the others store a head of their own; alignment untied "
                f"the tied ones, {added}"
            )
        return (
            "The inputs tie their LM head to their embeddings; alignment untied it "
            f"(`tied_embeddings: untie`), {added}"
        )

    def summary_line(self) -> str:
        """What the command prints: the tie kept, or the head untying adds."""
        if self.untie_ignored:
            return self.untie_ignored
        if self.kept:
            return "tied embeddings kept: the merge has the inputs' architecture"
        return (
            f"LM head untied: the merge adds {self.added_parameters:,} parameters "
            f"({self.added_bytes / 2**20:,.0f} MiB as stored) to the inputs' architecture"
        )


class AlignmentPreparation(Record):
    """What the pass did: each weight match, the learning run, how long each stage took, for
    tied inputs what became of the tie, and whether the inputs already sat in one basin
    (matching found the identity: they are kept as they are and nothing is learned)."""

    omit_if_none: ClassVar[tuple[str, ...]] = ("tied_embeddings",)

    matching: list[dict]
    learning: LearningRecord | None
    seconds: dict[str, float]
    tied_embeddings: TieRecord | None = None
    one_basin: bool = False
    #: Per input, what the self-check of its written checkpoint measured (error, noise,
    #: tolerance: :class:`~lmc_mergekit.evaluation.selfcheck.FunctionCheck`).
    self_check: list[dict] = Field(default_factory=list)


class RepairRecord(Record):
    """What the statistics repair did to the merged model: the calibration it read, how long it
    took, and per kind of unit how many were scaled and the spread of the scales."""

    data: SplitRecord
    weights: list[float]
    seconds: float
    scales: dict

    def card_line(self) -> str:
        """One sentence for the model card."""
        units = sum(kind["units"] for kind in self.scales.values())
        return (
            f"The merged model's statistics were repaired: {units:,} units (value dimensions, "
            "MLP units and post-norm channels) rescaled so that their root mean square on "
            f"{self.data.sequences} calibration sequences is the inputs' weighted mean (REPAIR, "
            "by scales only: the architecture is unchanged)."
        )


class PairPaths(Record):
    """The loss along the path between the first model (``a``) and another (``b``): raw,
    after weight matching and after learned matching (where the recipe did each)."""

    omit_if_none: ClassVar[tuple[str, ...]] = ("matched", "learned", "repaired")

    a: str
    b: str
    raw: PathLoss
    matched: PathLoss | None = None
    learned: PathLoss | None = None
    #: The aligned path (learned, else matched) with each mix's statistics repaired.
    repaired: PathLoss | None = None


class AlignmentReport(Report):
    """``lmc_report.json``."""

    file_name: ClassVar[str] = "lmc_report.json"
    omit_if_none: ClassVar[tuple[str, ...]] = ("merged", "tied_embeddings", "repair")

    method: str = "lmc_dm"
    settings: AlignmentSettings
    inputs: list[str]
    data: SplitRecord | None
    matching: list[dict]
    learning: LearningRecord | None
    pairs: list[PairPaths]
    seconds: dict[str, float]
    merged: MergedLoss | None = None
    tied_embeddings: TieRecord | None = None
    one_basin: bool = False
    repair: RepairRecord | None = None
    #: Per input, what the self-check of its written checkpoint measured.
    self_check: list[dict] = Field(default_factory=list)
    #: Losses taken from another measurement of the same function, not evaluated again.
    reused: list[str] = Field(default_factory=list)

    def card_section(self) -> str:
        """Markdown on the tie of tied inputs and on inputs that already sat in one basin, and
        quoting the barriers before and after alignment and the merged loss."""
        tie = "" if self.tied_embeddings is None else self.tied_embeddings.card_line() + "\n"
        if self.one_basin:
            tie += ONE_BASIN_LINE + "\n"
        if self.repair is not None:
            tie += self.repair.card_line() + "\n"
        if not self.settings.evaluate:
            return tie
        lines = [
            tie,
            "### Loss barrier (lmc-mergekit report)\n",
            f"Test split of {self.data.description} ({self.data.tokens} tokens). Barrier = "
            "highest loss along the straight path between two models minus the mean of their "
            "own losses, for the raw checkpoints and after each alignment stage.\n",
        ]
        if note := self.data.tokenizer_note():
            lines.append(note + "\n")
        repaired = any(pair.repaired is not None for pair in self.pairs)
        lines += [
            f"| models | endpoint losses | raw | {path_label('matched', self.matching)} | "
            "learned matching |" + (" repaired |" if repaired else ""),
            "|---|---|---|---|---|" + ("---|" if repaired else ""),
        ]
        for pair in self.pairs:
            ends = ", ".join(f"{loss:.3f}" for loss in pair.raw.endpoint_losses)
            paths = [pair.raw, pair.matched, pair.learned] + ([pair.repaired] if repaired else [])
            cells = ["–" if path is None else f"{path.barrier:.3f}" for path in paths]
            lines.append(
                f"| `{Path(pair.a).name}` – `{Path(pair.b).name}` | {ends} | "
                + " | ".join(cells)
                + " |"
            )
        if self.merged is not None:
            lines.append(f"\nMerged model test loss: {self.merged.test_loss:.3f}.")
        lines.append(f"\n![loss along the path]({PLOT_FILE})\n")
        return "\n".join(lines)


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
        self_check=[check.as_dict() for check in checks],
    )


def write_moved(
    inputs,
    outputs,
    transforms: list[Transform],
    ctx,
    written: dict[int, CheckedWriter] | None = None,
    progress: bool = True,
) -> tuple[list[ModelSpec], list[FunctionCheck]]:
    """Every input moved by its transform into ``outputs`` (each self-checked), or published
    by the writer in ``written`` that weight matching already handed it to; the written
    specs and what each self-check measured."""
    written = dict(written or {})
    specs, checks = [], []
    try:
        for index, (source, out, transform) in enumerate(
            zip(inputs, outputs, transforms, strict=True)
        ):
            if index in written:
                spec, check = written.pop(index).publish()
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
