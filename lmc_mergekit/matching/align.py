"""Aligning several models into one basin: weight or activation matching onto the first, then
(optionally) learned matching of every model at once. The ``lmc_dm`` pass and the benchmarks both
run this.

Every model is compared with its norms absorbed. The first is the reference: matching moves each
other one onto it (by its weights, or by its activations on calibration text); learned matching
then trains continuous symmetries of all of them (the first too, unless one-sided) on calibration
sequences, starting from the matched models. With a ``state_dir``, matching's result is kept
there so that a run interrupted during learning resumes without matching again (learned matching
checkpoints itself there too). Under several processes matching runs in the main process and its
result reaches the others.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from lmc_mergekit.evaluation.blockwise import MixedView, blockwise_loss
from lmc_mergekit.matching.activation_matching import match_activations
from lmc_mergekit.matching.learned_matching import LearningConfig, LearningResult, learn_symmetries
from lmc_mergekit.matching.weight_matching import match_weights
from lmc_mergekit.models.adapters.base import CheckpointView
from lmc_mergekit.models.block_runner import BlockRunner
from lmc_mergekit.models.view import InMemoryView, ModelSpec, ModelView, materialize
from lmc_mergekit.runtime.distributed import Processes
from lmc_mergekit.symmetry import Transform, apply_transform
from lmc_mergekit.symmetry.transform import load_transform, save_transform

# Inside the state folder: the matching transform of model i (i ≥ 1).
MATCHED_FILE = "weight-matching-{}.safetensors"
#: ``both``: weight and activation matching, the one whose mix scores lower kept.
Matching = Literal["none", "weights", "activations", "both"]
#: Calibration sequences (after those activation matching reads) that score the two matchings.
SCORE_SEQUENCES = 16


@dataclass(frozen=True)
class AlignConfig:
    """``matching``: ``weights`` or ``activations`` (then learned matching when ``learning`` is
    given) or ``none`` (the models as they are: the baseline); ``max_iterations``: most rounds of
    weight matching; ``activation_sequences``: calibration sequences activation matching reads;
    ``keep_tie``: tied embeddings stay tied (the models must tie them). ``both`` runs weight
    and activation matching and keeps, per model, the one whose mix with the reference at
    λ = ½ has the lower loss on :data:`SCORE_SEQUENCES` calibration sequences (after the ones
    activation matching reads): which matches better depends on the pair, not only on the
    family (models trained on different texts correlate weakly on each other's text)."""

    matching: Matching = "weights"
    max_iterations: int = 30
    learning: LearningConfig | None = None
    keep_tie: bool = False
    activation_sequences: int = 64

    @property
    def reads_text(self) -> bool:
        """Whether this alignment needs calibration text."""
        return self.learning is not None or self.matching in ("activations", "both")

    @property
    def calibration_needed(self) -> int:
        """Calibration sequences matching reads (learning reads its own count)."""
        if self.matching == "activations":
            return self.activation_sequences
        return self.activation_sequences + SCORE_SEQUENCES if self.matching == "both" else 0


@dataclass
class Alignment:
    """Per model, its weight-matching transform and its final one (weight matching then learned
    matching), with a record of each match and the learning run."""

    matched: list[Transform]
    final: list[Transform]
    matching: list[dict] = field(default_factory=list)
    learning: LearningResult | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    #: Matching permuted no unit of any model (no head, neuron or residual channel): they
    #: already sit in one basin (a base and its fine-tunes) and are kept as they are; nothing
    #: is learned.
    one_basin: bool = False


def align(
    views: list[CheckpointView],
    config: AlignConfig,
    calibration: torch.Tensor | None = None,
    *,
    device: torch.device | str = "cpu",
    state_dir: Path | None = None,
    processes: Processes | None = None,
    progress: bool = True,
    trust_remote_code: bool = False,
    on_checkpoint: Callable[[int, list[Transform]], None] | None = None,
) -> Alignment:
    """Align ``views`` (one architecture and shape; the first is the reference). Activation
    matching reads and learned matching (``config.learning``) trains on ``calibration`` token ids
    ``(n, L)``."""
    processes = processes or Processes()
    started = time.perf_counter()
    runner = None
    # Before matching: a model that cannot run block by block fails first (in every process, or
    # it stops all).
    with processes.together():
        if config.reads_text:
            absorb = Transform(views[0].spec.num_layers, absorb_norms=True)
            absorbed = apply_transform(views[0], absorb)
            runner = block_runner(views[0], absorbed.spec, torch.device(device), trust_remote_code)
    keep = state_dir if config.learning is not None else None
    # Once, in the main process (the only one that keeps it); every process gets its result.
    matched, matching = processes.from_main(
        lambda: match_all(views, config, state_dir, keep, progress, device, runner, calibration)
    )
    alignment = Alignment(matched, matched, matching)
    alignment.seconds["matching"] = time.perf_counter() - started
    if config.matching != "none" and not any(t.units_moved() for t in matched[1:]):
        # The models as they are (untied alike where their ties differ, so that every head
        # survives the merge): what mergekit's own linear merge would average.
        untie = len({view.spec.tied_embeddings for view in views}) > 1
        kept = [Transform(view.spec.num_layers, absorb_norms=untie) for view in views]
        return Alignment(kept, kept, matching, seconds=alignment.seconds, one_basin=True)
    if config.learning is None:
        return alignment
    started = time.perf_counter()
    result = learn_symmetries(
        [apply_transform(v, t) for v, t in zip(views, matched, strict=True)],
        runner,
        calibration,
        config.learning,
        state_dir=state_dir,
        processes=processes,
        progress=progress,
        on_checkpoint=on_checkpoint,
    )
    alignment.final = [t.then(u) for t, u in zip(matched, result.transforms, strict=True)]
    alignment.learning = result
    alignment.seconds["learning"] = time.perf_counter() - started
    return alignment


def match_all(
    views: list[CheckpointView],
    config: AlignConfig,
    reuse_from: Path | None = None,
    keep_in: Path | None = None,
    progress: bool = False,
    device: torch.device | str = "cpu",
    runner: BlockRunner | None = None,
    calibration: torch.Tensor | None = None,
) -> tuple[list[Transform], list[dict]]:
    """Every model's transform onto the first (the first's absorbs its norms) and a record per
    other model; a transform saved in ``reuse_from`` is reused, a new one saved in ``keep_in``
    (weight matching's heavy products run on ``device``; activation matching runs the first
    ``config.activation_sequences`` of ``calibration`` through ``runner``)."""
    absorb = config.matching != "none"
    keep_tie = absorb and config.keep_tie
    transforms = [Transform(views[0].spec.num_layers, absorb_norms=absorb, keep_tie=keep_tie)]
    records = []
    for index, view in enumerate(views[1:], start=1):
        if not absorb:
            transforms.append(Transform(view.spec.num_layers))
            continue
        saved = None if reuse_from is None else reuse_from / MATCHED_FILE.format(index)
        if saved is not None and saved.is_file():
            transforms.append(load_transform(saved))
            records.append(
                {"model": str(view.folder), "matching": config.matching, "reused": str(saved)}
            )
            continue
        kinds = ("weights", "activations") if config.matching == "both" else (config.matching,)
        found = {
            kind: _match(
                kind, views[0], view, config, keep_tie, progress, device, runner, calibration
            )
            for kind in kinds
        }
        if len(found) > 1:
            scores = calibration[config.activation_sequences :][:SCORE_SEQUENCES]
            if len(scores) == 0:  # a short text: score on what activation matching read
                scores = calibration[-SCORE_SEQUENCES:]
            reference = apply_transform(views[0], transforms[0])
            for transform, record in found.values():
                mix = MixedView(reference, apply_transform(view, transform), 0.5)
                record["mix_loss"] = round(blockwise_loss(mix, runner, scores).loss, 6)
            best = min(found, key=lambda kind: found[kind][1]["mix_loss"])
            transform, record = found[best]
            record = {**record, "tried": {k: r for k, (_, r) in found.items()}}
        else:
            ((transform, record),) = found.values()
        record["units_moved"] = transform.units_moved()
        transforms.append(transform)
        if keep_in is not None:
            keep_in.mkdir(parents=True, exist_ok=True)
            save_transform(transform, keep_in / MATCHED_FILE.format(index))
        records.append({"model": str(view.folder), **record})
    return transforms, records


def _match(
    kind: Matching,
    reference: CheckpointView,
    view: CheckpointView,
    config: AlignConfig,
    keep_tie: bool,
    progress: bool,
    device: torch.device | str,
    runner: BlockRunner | None,
    calibration: torch.Tensor | None,
) -> tuple[Transform, dict]:
    """``view``'s transform onto ``reference`` by weight or activation matching, and its
    record."""
    if kind == "activations":
        sequences = calibration[: config.activation_sequences]
        found = match_activations(
            reference, view, runner, sequences, keep_tie=keep_tie, progress=progress
        )
        return found.transform, found.record()
    result = match_weights(
        reference,
        view,
        max_iterations=config.max_iterations,
        device=device,
        progress=progress,
        keep_tie=keep_tie,
    )
    return result.transform, {
        "matching": "weights",
        "iterations": result.iterations,
        "layers_solved": list(result.solved),
        "seconds": round(result.seconds, 3),
        "relative_distance": {"before": result.distances[0], "after": result.distance},
    }


def moved(views: list[ModelView], transforms: list[Transform]) -> list[InMemoryView]:
    """Each model moved by its transform, in memory."""
    return [materialize(apply_transform(v, t)) for v, t in zip(views, transforms, strict=True)]


def block_runner(
    source: CheckpointView, spec: ModelSpec, device: torch.device, trust_remote_code: bool = False
) -> BlockRunner:
    """What learned matching runs the mixes' blocks through: one-layer stock modules of
    ``source``'s architecture with the moved models' ``spec`` (their norms absorbed)."""
    return BlockRunner(source.folder, source.adapter, spec, device, trust_remote_code)
