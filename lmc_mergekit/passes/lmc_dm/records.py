"""What ``lmc_dm`` records: the preparation (matching, learning, tie), the statistics repair,
the loss along each pair's paths, the report ``lmc_report.json``, and their model-card prose."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field

from lmc_mergekit.evaluation.barrier import PathLoss
from lmc_mergekit.passes.base import Report
from lmc_mergekit.passes.lmc_dm.settings import AlignmentSettings
from lmc_mergekit.passes.text import MergedLoss, SplitRecord
from lmc_mergekit.runtime.records import Record

PLOT_FILE = "lmc_barrier.png"
#: The self-check record of an input whose transform moves nothing: linked as it is stored,
#: nothing written, nothing to check.
LINKED = {"linked": "the input as it is stored"}
ONE_BASIN_LINE = (
    "The inputs already sit in one basin (no matching lowers their mix clearly below that of "
    "the models as they are, as for a base model and its fine-tunes): they are merged as they "
    "are, as mergekit's linear merge would merge them, and nothing is learned."
)
LABELS = {"raw": "raw", "learned": "learned matching", "repaired": "repaired"}


def path_label(kind: str, matching: list[dict]) -> str:
    """How the report and the plot name the path ``kind`` (raw, matched, learned), the
    matched one by the matching the records say ran."""
    if kind != "matched":
        return LABELS[kind]
    ran = next((r["matching"] for r in matching if r.get("matching", "kept") != "kept"), "weights")
    return f"{ran.removesuffix('s')} matching"  # weight / activation


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
    #: tolerance: :class:`~lmc_mergekit.evaluation.selfcheck.FunctionCheck`), or
    #: :data:`LINKED` for an input linked as it is stored.
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
