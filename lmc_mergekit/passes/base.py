"""What the stages of every plugin method share: the recipe section's settings, the context
each stage gets, and the comparison merges a measurement may declare."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from mergekit.options import MergeOptions
from pydantic import BaseModel, ConfigDict, Field
from tqdm.auto import tqdm

from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.loss import DEFAULT_EVAL_SEQUENCES
from lmc_mergekit.models.adapters import CheckpointView, open_model
from lmc_mergekit.passes.text import Split
from lmc_mergekit.runtime.distributed import Processes
from lmc_mergekit.runtime.records import Record


class Section(BaseModel):
    """A plugin section of a recipe: unknown keys are errors (mergekit silently ignores them)."""

    model_config = ConfigDict(extra="forbid")
    #: Keys that only steer mergekit's merge of the prepared inputs.
    merge_only: ClassVar[tuple[str, ...]] = ()
    #: Keys that only steer the measurement after the merge.
    measure_only: ClassVar[tuple[str, ...]] = ()
    #: Keys naming models (a path or a Hub id, or a list of them), and whether the pass reads
    #: their weights (``True``) or only their config.json (``False``): the pipeline resolves
    #: Hub ids among them as it resolves the recipe's models.
    model_keys: ClassVar[dict[str, bool]] = {}

    def preparation_settings(self, inputs: Sequence[Path] = ()) -> dict:
        """The settings that change the prepared checkpoints of ``inputs`` (part of their cache
        key)."""
        return self.model_dump(mode="json", exclude=set(self.merge_only + self.measure_only))

    def merge_parameters(self) -> dict:
        """Parameters this section passes to the registered mergekit method."""
        return {}

    def combining_method(self) -> str | None:
        """The built-in mergekit method that combines the prepared inputs instead of the
        plugin's own (None: the plugin's)."""
        return None

    def needs_plain_weights(self) -> bool:
        """Whether these settings read each model's weight as one number (refused otherwise)."""
        return False

    def dependencies(self) -> list[Path]:
        """Folders besides the recipe's models whose files the pre-merge pass reads (part of
        its cache key)."""
        return []

    def evaluation_inputs(
        self, inputs: tuple[Path, ...], base_model: Path | None
    ) -> tuple[Path, ...]:
        """The inputs whose shared tokenizer tokenises the test split (the merged model's)."""
        return inputs

    def check_inputs(
        self, inputs: list[Path], base_model: Path | None, trust_remote_code: bool = False
    ) -> None:
        """A one-line error for inputs (the recipe's ``base_model`` first) that these settings
        cannot merge, checked before the cache is consulted: what only steers the merge is not
        part of the prepared inputs' key."""


class TextSettings(Section):
    """The text a method calibrates and evaluates on, and whether it measures at all."""

    measure_only: ClassVar[tuple[str, ...]] = ("evaluate", "eval_sequences")

    data: str | list[str] | None = Field(
        None,
        description="calibration and evaluation text (file, folder, .jsonl, datasets folder, "
        "hf:NAME, or a list of these; default: the bundled corpus)",
    )
    field: str = Field("text", description="text field of JSON Lines or datasets rows")
    seq_len: int = Field(128, ge=2, description="tokens per sequence")
    eval_sequences: int = Field(
        DEFAULT_EVAL_SEQUENCES, ge=1, description="most test-split sequences evaluated"
    )
    evaluate: bool = Field(True, description="measure the test losses of the report")


@dataclass(frozen=True)
class StageContext:
    """What both stages of a method get: the section's settings, the inputs (resolved folders,
    recipe order), mergekit's options and the pass's artefacts folder (kept with the prepared
    checkpoints: what the pass leaves for the measurement)."""

    settings: Section
    inputs: tuple[Path, ...]
    options: MergeOptions
    artefacts: Path

    @property
    def progress(self) -> bool:
        """Whether to show progress bars."""
        return not self.options.quiet


@dataclass(frozen=True)
class PassContext(StageContext):
    """What a pre-merge pass gets besides: the method's name, where to write each prepared
    checkpoint, a folder for resumable state that survives an interrupted run (removed once the
    pass succeeds), the method's cache folder (for artefacts that recipes over the same models
    share), the recipe's base model, and the processes of a distributed run (only the main one
    writes). ``load_test`` loads the test split the measurement will use (once): a pass calls it
    after its own cheap checks, so that bad evaluation data fails before any heavy work."""

    method: str
    outputs: tuple[Path, ...]
    state_dir: Path
    cache_dir: Path
    base_model: Path | None = None
    processes: Processes = field(default_factory=Processes)
    load_test: Callable[[], Split | None] = lambda: None

    @property
    def progress(self) -> bool:
        """Whether this process shows progress bars."""
        return not self.options.quiet and self.processes.is_main

    def open_inputs(self) -> list[CheckpointView]:
        """Views of every input, refused unless they share one architecture and shape."""
        views = [open_model(path, self.options.trust_remote_code) for path in self.inputs]
        check_one_shape(views, self.method)
        return views


def untie_where_mixed(views: list[CheckpointView], progress: bool = False) -> bool:
    """Where some inputs tie their LM head to their embeddings and others store one of their
    own (a tied base and a fine-tune saved untied), the tied ones are read untied (their head
    is their embedding), so that every checkpoint written or merged keeps a head of its own
    and no input's head is dropped; whether any was (said in one line with ``progress``)."""
    if len({view.spec.tied_embeddings for view in views}) < 2:
        return False
    for view in views:
        if view.spec.tied_embeddings:
            view.spec = replace(view.spec, tied_embeddings=False)
    if progress:
        tqdm.write("the inputs tie their LM heads differently: the tied ones are read untied")
    return True


def check_one_shape(views: list[CheckpointView], method: str) -> None:
    """A one-line error unless ``views`` share one architecture and shape."""
    first = views[0]
    for view in views[1:]:
        if view.spec.architecture != first.spec.architecture:
            raise LmcError(
                f"{method} needs models of one architecture: {first.folder.name} is "
                f"{first.spec.architecture}, {view.folder.name} is {view.spec.architecture}"
            )
        mismatch = first.spec.shape_mismatch(view.spec)
        if mismatch is not None:
            key, a, b = mismatch
            raise LmcError(
                f"{method} needs models of one shape: {key} is {a} in "
                f"{first.folder.name} but {b} in {view.folder.name}"
            )


@dataclass(frozen=True)
class Comparison:
    """A merge a measurement compares the recipe's merge against, run by the pipeline: the
    recipe merged by the built-in mergekit method ``merge_method`` on the original checkpoints,
    or the recipe run as written with the plugin section's ``settings`` instead."""

    name: str
    merge_method: str | None = None
    settings: Section | None = None


@dataclass(frozen=True)
class Compared:
    """A comparison merge's output folder and, where the pre-merge pass ran for it, the pass's
    record."""

    folder: Path
    preparation: Record | None = None


@dataclass(frozen=True)
class FinishContext(StageContext):
    """What a method's finishing step gets once mergekit has written the merged model (before
    the measurement): the prepared checkpoint of each input, the pass's record, the merged
    model's folder (still staged: the step may rewrite its weights) and each input's weight
    (normalised; None where the recipe weighs tensors by filters or gradients)."""

    prepared: tuple[Path, ...]
    preparation: Record
    merged: Path
    weights: tuple[float, ...] | None


def no_finish(ctx: FinishContext) -> Record | None:
    """The finishing step of a method that has none."""
    return None


@dataclass(frozen=True)
class MeasureContext(StageContext):
    """What a measurement gets besides, once mergekit has written the merged model: the
    prepared checkpoint of each input and the pass's record, the merged model, the comparison
    merges it declared, the test split (None when the recipe does not evaluate; tokenised for
    the merged model), a scratch folder (removed afterwards), the folder for files that go next
    to the merged model, the test split as any one checkpoint tokenises it, what the
    finishing step did to the merged model, and each input's weight in it."""

    prepared: tuple[Path, ...]
    preparation: Record
    merged: Path
    comparisons: dict[str, Compared]
    test: Split | None
    scratch: Path
    files: Path
    #: The test split tokenised by the tokenizer of the checkpoint in a folder.
    split_for: Callable[[Path], Split]
    #: The finishing step's record (None where it has none or did nothing).
    finished: Record | None = None
    #: Each input's weight in the weighted average the merge is (None where weights are not
    #: one number per model).
    weights: tuple[float, ...] | None = None


class Report(Record):
    """A method's report: written next to the merged model as ``file_name``, quoted in the card."""

    file_name: ClassVar[str] = "report.json"

    def card_section(self) -> str:
        """Markdown for the model card ("" for nothing to say)."""
        return ""
