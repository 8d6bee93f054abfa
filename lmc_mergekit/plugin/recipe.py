"""Recipe parsing: mergekit's own configuration plus one validated section per plugin method."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import yaml
from mergekit.config import MergeConfiguration
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.loss import DEFAULT_EVAL_SEQUENCES

# Learned-matching steps when a recipe does not say (about a minute for a d=128 pair on 2 cores).
DEFAULT_STEPS = 200


class Section(BaseModel):
    """A plugin section: unknown keys are errors (mergekit silently ignores them)."""

    model_config = ConfigDict(extra="forbid")
    #: Keys that only steer mergekit's merge after the pre-merge pass (not its cache key).
    merge_only: ClassVar[tuple[str, ...]] = ()

    def merge_parameters(self) -> dict:
        """Parameters this section passes to the registered mergekit method."""
        return {}

    def dependencies(self) -> list[Path]:
        """Folders besides the merged models whose files the pre-merge pass reads (part of its
        cache key)."""
        return []


class TextSettings(Section):
    """The text a method calibrates and evaluates on (shared by the plugin sections)."""

    data: str | None = Field(
        None,
        description="calibration and evaluation text (file, folder, .jsonl, datasets folder; "
        "default: the bundled corpus)",
    )
    field: str = Field("text", description="text field of JSON Lines or datasets rows")
    seq_len: int = Field(128, ge=2, description="tokens per sequence")
    eval_sequences: int = Field(
        DEFAULT_EVAL_SEQUENCES, ge=1, description="most test-split sequences evaluated"
    )


class AlignmentSettings(TextSettings):
    """``alignment:`` for ``lmc_dm``."""

    merge_only: ClassVar[tuple[str, ...]] = ("combine",)

    matching: Literal["none", "weights"] = Field(
        "weights",
        description="none: merge the raw checkpoints (the baseline); weights: start from weight "
        "matching",
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
    learn: list[Literal["residual", "scale", "qk", "ov"]] = Field(
        ["residual", "scale", "qk", "ov"], description="the symmetry families learned"
    )
    parametrization: Literal["polar", "cayley", "matrix_exp", "unconstrained"] = Field(
        "polar", description="how maps are parametrised (see symmetry.parametrize)"
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
    evaluate: bool = Field(
        True, description="measure the loss along the path before and after alignment"
    )
    points: int = Field(11, ge=3, description="λ grid points along the path")

    @model_validator(mode="after")
    def _consistent(self) -> AlignmentSettings:
        if self.matching == "none":
            if self.steps and "steps" in self.model_fields_set:
                raise ValueError(
                    "learned matching (steps > 0) starts from weight matching; set matching: "
                    "weights or steps: 0"
                )
            self.steps = 0  # the baseline learns nothing
        if self.steps and not self.learn:
            raise ValueError("learn: is empty; name a symmetry family or set steps: 0")
        if self.combine is not None:
            from mergekit import merge_methods

            known = sorted(m.spec.name for m in merge_methods.registered_methods())
            if self.combine not in known or self.combine in PLUGIN_METHODS:
                raise ValueError(
                    f"combine: {self.combine!r} is not a mergekit method (use one of: "
                    f"{', '.join(k for k in known if k not in PLUGIN_METHODS)})"
                )
        return self


class SubcloneSettings(TextSettings):
    """``subclone:`` for ``subclone_compensate``."""

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
        "o_down", description="multiply by sqrt(n/n'): none, attention output + MLP down, all"
    )
    selection: Literal["weight_norm", "random"] = Field(
        "weight_norm", description="rank heads, dims and units by weight norm, or at random"
    )
    ridge: float = Field(
        0.01, gt=0, description="ridge strength relative to the mean feature energy"
    )
    seed: int = Field(0, ge=0, description="seed of the random selection")
    calibration_sequences: int = Field(
        256, ge=1, description="train-split sequences the conversion calibrates on"
    )
    evaluate: bool = Field(True, description="measure donor and converted test losses")

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


SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
)


class LatentSettings(TextSettings):
    """``latent:`` for ``ls_merge``."""

    merge_only: ClassVar[tuple[str, ...]] = ("samples", "sample_seed", "keep_residuals")

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
    evaluate: bool = Field(True, description="measure the test losses of the report")

    @model_validator(mode="after")
    def _fits_chunk(self) -> LatentSettings:
        if self.compression_ratio > self.chunk_size:
            raise ValueError(
                f"compression_ratio {self.compression_ratio:g} leaves less than one latent number "
                f"per chunk of {self.chunk_size}"
            )
        return self

    def dependencies(self) -> list[Path]:
        from lmc_mergekit.models.checkpoint import model_dir

        folders = [model_dir(path) for path in self.extra_models]
        if self.autoencoder is not None and Path(self.autoencoder).expanduser().is_file():
            folders.append(Path(self.autoencoder).expanduser().resolve().parent)
        return folders

    def merge_parameters(self) -> dict:
        """mergekit parameters of the ``ls_merge`` method that this section sets."""
        return {
            "samples": self.samples,
            "seed": self.sample_seed,
            "residuals": self.keep_residuals,
        }


@dataclass(frozen=True)
class PluginMethod:
    name: str
    section: str
    settings: type[Section]


PLUGIN_METHODS = {
    m.name: m
    for m in (
        PluginMethod("lmc_dm", "alignment", AlignmentSettings),
        PluginMethod("subclone_compensate", "subclone", SubcloneSettings),
        PluginMethod("ls_merge", "latent", LatentSettings),
    )
}
SECTION_OWNERS = {m.section: m.name for m in PLUGIN_METHODS.values()}


@dataclass(frozen=True)
class Recipe:
    """A parsed recipe: the user's text, mergekit's config and the plugin settings (if any)."""

    source: str
    config: MergeConfiguration
    settings: Section | None

    @property
    def plugin_method(self) -> PluginMethod | None:
        return PLUGIN_METHODS.get(self.config.merge_method)


def parse_recipe(text: str) -> Recipe:
    """Parse recipe text; local model paths (relative to the working directory) become absolute."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise LmcError(f"recipe is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise LmcError("recipe must be a YAML mapping with at least merge_method and models")
    method = PLUGIN_METHODS.get(raw.get("merge_method"))
    settings = None
    for section, owner in SECTION_OWNERS.items():
        if section in raw and (method is None or method.section != section):
            raise LmcError(
                f"recipe section '{section}:' belongs to merge_method: {owner}, but this recipe "
                f"uses {raw.get('merge_method')!r}; remove the section or change the method"
            )
    if method is not None:
        body = raw.pop(method.section, None) or {}
        if not isinstance(body, dict):
            raise LmcError(f"recipe section '{method.section}:' must be a mapping of settings")
        settings = _validated(method.settings, body, f"'{method.section}:'")
    _absolutize_local_paths(raw)
    try:
        config = MergeConfiguration.model_validate(raw)
    except ValidationError as error:
        raise LmcError(f"invalid recipe: {_first_error(error)}") from None
    return Recipe(source=text, config=config, settings=settings)


def _validated(model: type[Section], body: dict, where: str) -> Section:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        # The method's own keys first, then the shared text keys.
        fields = sorted(model.model_fields, key=lambda key: key in TextSettings.model_fields)
        allowed = ", ".join(fields)
        detail = error.errors()[0]
        if detail["type"] == "extra_forbidden":
            raise LmcError(
                f"recipe section {where}: unknown key {detail['loc'][0]!r} (allowed: {allowed})"
            ) from None
        raise LmcError(f"recipe section {where}: {_first_error(error)}") from None


def _first_error(error: ValidationError) -> str:
    detail = error.errors()[0]
    where = ".".join(str(part) for part in detail["loc"])
    return f"{where}: {detail['msg']}" if where else detail["msg"]


def _absolutize(value):
    if isinstance(value, str) and os.path.exists(os.path.expanduser(value)):
        return os.path.abspath(os.path.expanduser(value))
    return value


def _absolutize_local_paths(raw: dict) -> None:
    """Absolute local paths keep mergekit's card writer from asking the Hub about them."""
    if "base_model" in raw:
        raw["base_model"] = _absolutize(raw["base_model"])
    for entry in raw.get("models") or []:
        if isinstance(entry, dict) and "model" in entry:
            entry["model"] = _absolutize(entry["model"])
    for piece in raw.get("slices") or []:
        for source in (piece or {}).get("sources") or []:
            if isinstance(source, dict) and "model" in source:
                source["model"] = _absolutize(source["model"])
