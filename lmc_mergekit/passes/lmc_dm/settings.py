"""The ``alignment:`` section of an ``lmc_dm`` recipe: its settings, their checks, and what
they resolve to for given inputs (the matching, the tie, the repair, the align config)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from lmc_mergekit.data.tokenizer import shared_tokenizer
from lmc_mergekit.errors import LmcError
from lmc_mergekit.matching.align import AlignConfig, Matching
from lmc_mergekit.matching.learned_matching import LearningConfig, check_learnable
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.view import ModelSpec
from lmc_mergekit.passes.base import TextSettings, check_one_shape
from lmc_mergekit.symmetry.group import DEFAULT_FAMILIES, symmetry_group, untying_gains

# Learned-matching steps when a recipe does not say (about a minute for a d=128 pair on 2 cores).
DEFAULT_STEPS = 200
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
