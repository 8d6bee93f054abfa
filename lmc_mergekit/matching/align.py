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

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from lmc_mergekit.evaluation.selfcheck import PROBE_SHAPE
from lmc_mergekit.matching.activation_matching import match_activations
from lmc_mergekit.matching.learned_matching import LearningConfig, LearningResult, learn_symmetries
from lmc_mergekit.matching.starts import (
    CLEAR_MARGIN,
    SCORE_SEQUENCES,
    UNRELATED_EMBEDDINGS,
    StartScorer,
    embeddings_apart,
)
from lmc_mergekit.matching.weight_matching import (
    ROUNDING_FLOOR,
    ROW_CHUNK,
    PartsWriter,
    match_weights,
)
from lmc_mergekit.models.adapters.base import DEFAULT_SHARD_SIZE, CheckpointView
from lmc_mergekit.models.block_mixing import BlockMixer
from lmc_mergekit.models.block_runner import BlockRunner
from lmc_mergekit.models.view import InMemoryView, ModelSpec, ModelView, materialize
from lmc_mergekit.runtime.distributed import Processes
from lmc_mergekit.runtime.memory import release_freed_memory
from lmc_mergekit.symmetry import Transform, apply_transform
from lmc_mergekit.symmetry.transform import load_transform, save_transform

# Inside the state folder: the matching transform of model i (i ≥ 1).
MATCHED_FILE = "weight-matching-{}.safetensors"
#: ``both``: weight matching, then activation matching where a barrier is left (see
#: :mod:`~lmc_mergekit.matching.starts`).
Matching = Literal["none", "weights", "activations", "both"]


@dataclass(frozen=True)
class AlignConfig:
    """``matching``: ``weights`` or ``activations`` (then learned matching when ``learning`` is
    given) or ``none`` (the models as they are: the baseline); ``max_iterations``: most rounds of
    weight matching; ``activation_sequences``: calibration sequences activation matching reads;
    ``keep_tie``: tied embeddings stay tied (the models must tie them). ``both`` tries weight
    matching, then activation matching. ``score``: the starts (the models as they are, then
    each matching) are scored on :data:`~lmc_mergekit.matching.starts.SCORE_SEQUENCES`
    calibration sequences (after the ones activation matching reads) and each model keeps the
    one :mod:`~lmc_mergekit.matching.starts` chooses: which matches better depends on the pair,
    not only on the family, and a base with its fine-tunes is best kept as it is."""

    matching: Matching = "weights"
    max_iterations: int = 30
    learning: LearningConfig | None = None
    keep_tie: bool = False
    activation_sequences: int = 64
    score: bool = False
    #: Whether the models as they are compete as a start (else a matching is always kept).
    one_basin_check: bool = True

    def matching_memory(self, spec: ModelSpec, itemsize: int, seq_len: int) -> int:
        """The bytes matching holds at its peak beyond the process's start, for models of
        ``spec`` stored in ``itemsize``-byte floats (estimate). Weight matching's first round
        writes both models as it goes (:class:`~lmc_mergekit.transform_checkpoint.CheckedWriter`:
        a shard each, and each self-check's float64 and float32 copies of the part it checks),
        and peaks either in a block (both models' block as stored, about five float32 copies
        of one, the neurons' similarity and its assignment costs, ``dff²`` in float32 and
        float64) or in the vocabulary (16 float32 copies of a slice of rows, and each check's
        float64 and float32 probe logits), whichever is larger; activation matching holds
        besides both models' activations of every calibration token (float32). Calibrated on
        the anonymous memory measured beyond the start: 2.36 GB for the 1B scramble pair
        (estimate 2.83), 2.63 GB for the real Qwen2.5-Coder-1.5B pair (2.84); 5.3 GB for the
        7B pair before the first round wrote both (block: 5.8)."""
        if not self.matches:
            return 0
        block = spec.block_parameters * (2 * itemsize + 20) + 8 * spec.intermediate_size**2
        rows = 16 * 4 * min(spec.vocab_size, ROW_CHUNK) * spec.hidden_size
        logits = 2 * 3 * 8 * math.prod(PROBE_SHAPE) * spec.vocab_size
        need = max(block, rows + logits) + 2 * DEFAULT_SHARD_SIZE
        if self.matching in ("activations", "both"):
            tokens = self.activation_sequences * seq_len
            need += 2 * 4 * tokens * (2 * spec.hidden_size + spec.intermediate_size)
        return need

    @property
    def reads_text(self) -> bool:
        """Whether this alignment needs calibration text."""
        matches_on_text = self.matching in ("activations", "both")
        return self.learning is not None or matches_on_text or (self.score and self.matches)

    @property
    def matches(self) -> bool:
        return self.matching != "none"

    @property
    def activations_read(self) -> int:
        """Calibration sequences activation matching reads (0 where it does not run)."""
        return self.activation_sequences if self.matching in ("activations", "both") else 0

    @property
    def calibration_needed(self) -> int:
        """Calibration sequences matching reads (learning reads its own count)."""
        return self.activations_read + (SCORE_SEQUENCES if self.score and self.matches else 0)


@dataclass
class Alignment:
    """Per model, its weight-matching transform and its final one (weight matching then learned
    matching), with a record of each match and the learning run."""

    matched: list[Transform]
    final: list[Transform]
    matching: list[dict] = field(default_factory=list)
    learning: LearningResult | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    #: Every model kept its start as it is (no matching clearly lowered its mix with the
    #: first, or, without text, matching moved no unit): they already sit in one basin (a base
    #: and its fine-tunes) and are merged as they are; nothing is learned.
    one_basin: bool = False
    #: By model index, the writer that weight matching's last round handed that model's
    #: final parts to (:func:`align`'s ``writers``): to publish instead of writing it again.
    written: dict[int, PartsWriter] = field(default_factory=dict)

    def discard_unwritten(self) -> None:
        """Discard every writer whose model's final transform is not the one it took."""
        for index in list(self.written):
            if self.final[index] is not self.matched[index]:
                self.written.pop(index).discard()


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
    writers: Callable[[int, ModelSpec], PartsWriter] | None = None,
) -> Alignment:
    """Align ``views`` (one architecture and shape; the first is the reference). Activation
    matching reads and learned matching (``config.learning``) trains on ``calibration`` token ids
    ``(n, L)``. Without learning, ``writers(index, moved spec)`` makes the writer weight
    matching's last round hands model ``index``'s moved parts to (see
    :func:`~lmc_mergekit.matching.weight_matching.match_weights`); the result's ``written``
    holds those whose transform is final."""
    processes = processes or Processes()
    started = time.perf_counter()
    runner = raw_runner = None
    # Before matching: a model that cannot run block by block fails first (in every process, or
    # it stops all).
    with processes.together():
        if config.reads_text:
            absorb = Transform(views[0].spec.num_layers, absorb_norms=True)
            absorbed = apply_transform(views[0], absorb)
            runner = block_runner(views[0], absorbed.spec, torch.device(device), trust_remote_code)
            raw_runner = block_runner(
                views[0], views[0].spec, torch.device(device), trust_remote_code
            )
    keep = state_dir if config.learning is not None else None
    runners = (runner, raw_runner)
    written: dict[int, PartsWriter] = {}  # filled in the main process only: never sent
    if config.learning is not None:
        writers = None  # learning moves every model again: nothing of matching's is final
    # Once, in the main process (the only one that keeps it); every process gets its result.
    matched, matching = processes.from_main(
        lambda: match_all(
            views,
            config,
            state_dir,
            keep,
            progress,
            device,
            runners,
            calibration,
            writers,
            written,
        )
    )
    release_freed_memory()  # matching's working set: not kept beside what comes next
    alignment = Alignment(matched, matched, matching, written=written)
    alignment.seconds["matching"] = time.perf_counter() - started
    if config.matches and all(record["matching"] == "kept" for record in matching):
        # The models as they are (untied alike where their ties differ, so that every head
        # survives the merge): what mergekit's own linear merge would average.
        untie = len({view.spec.tied_embeddings for view in views}) > 1
        kept = [Transform(view.spec.num_layers, absorb_norms=untie) for view in views]
        alignment.final = kept
        alignment.discard_unwritten()
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
    release_freed_memory()  # the endpoints learning held: not kept while the inputs are written
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
    runners: tuple[BlockRunner | None, BlockRunner | None] = (None, None),
    calibration: torch.Tensor | None = None,
    writers: Callable[[int, ModelSpec], PartsWriter] | None = None,
    written: dict[int, PartsWriter] | None = None,
) -> tuple[list[Transform], list[dict]]:
    """Every model's transform onto the first (the first's absorbs its norms) and a record per
    other model; a transform saved in ``reuse_from`` is reused, a new one saved in ``keep_in``
    (weight matching's heavy products run on ``device``; activation matching runs the first
    ``config.activation_sequences`` of ``calibration`` through ``runners``' first, for models
    with absorbed norms; the second runs the models as they are). With calibration
    text each model keeps the start :mod:`~lmc_mergekit.matching.starts` chooses (its record
    says which and why: ``matching`` is ``kept`` for a model left as it is); without, the
    matching, or ``kept`` where it moved no unit. ``writers`` and ``written``: see
    :func:`align` (a writer is kept in ``written`` only where its transform is the one kept)."""
    absorb = config.matches
    keep_tie = absorb and config.keep_tie
    runner, raw_runner = runners
    written = {} if written is None else written
    reference = Transform(views[0].spec.num_layers, absorb_norms=absorb, keep_tie=keep_tie)
    transforms, records = [reference], []
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
        pending: dict[int, PartsWriter] = {}  # by the id of the transform its writer took

        def run(kind, view=view, index=index, pending=pending):
            make = None if writers is None else lambda spec: writers(index, spec)
            # The reference is written once, on the way of its first match.
            first = writers is not None and 0 not in written
            make_reference = (lambda spec: writers(0, spec)) if first else None
            transform, record, writer, reference_writer = match_pair(
                kind,
                views[0],
                view,
                config,
                keep_tie,
                progress,
                device,
                runner,
                calibration,
                make,
                make_reference,
            )
            if writer is not None:
                pending[id(transform)] = writer
            if reference_writer is not None:
                written[0] = reference_writer
            return transform, record

        scored = config.one_basin_check or len(kinds) > 1
        if scored and config.score and calibration is not None and raw_runner is not None:
            scores = score_sequences(calibration, config.activations_read)
            scorer = StartScorer(views[0], view, reference, raw_runner, runner, scores)
            apart = embeddings_apart(views[0], view) if config.one_basin_check else None
            unrelated = apart is not None and apart >= UNRELATED_EMBEDDINGS
            kept = reference if config.one_basin_check and not unrelated else None
            transform, record = choose_start(kinds, run, scorer, kept)
            if apart is not None and math.isfinite(apart):
                record["embeddings_apart"] = round(apart, 6)
            if unrelated:
                note = (
                    f"the models as they are not scored: their token embeddings lie {apart:.3f} "
                    f"apart (relative), at least {UNRELATED_EMBEDDINGS:g}, as unrelated tables do"
                )
                record["decision"] = "; ".join(filter(None, (note, record["decision"])))
        else:  # no text to score on: a matching that moved no unit keeps the models as they are
            transform, record = run(kinds[0])
            if config.one_basin_check and not transform.units_moved():
                transform, record = reference, {**record, "matching": "kept"}
        record["units_moved"] = transform.units_moved()
        for key, writer in pending.items():
            if key == id(transform):
                written[index] = writer
            else:
                writer.discard()
        transforms.append(transform)
        if keep_in is not None:
            keep_in.mkdir(parents=True, exist_ok=True)
            save_transform(transform, keep_in / MATCHED_FILE.format(index))
        records.append({"model": str(view.folder), **record})
    return transforms, records


#: How a decision names each start's mix.
MIXES = {
    "kept": "the mix of the models as they are",
    "weights": "the weight-matched mix",
    "activations": "the activation-matched mix",
}


def score_sequences(calibration: torch.Tensor, read: int) -> torch.Tensor:
    """The calibration sequences that score the starts: those after the ``read`` activation
    matching reads (the last ones of a short text)."""
    scores = calibration[read:][:SCORE_SEQUENCES]
    return scores if len(scores) else calibration[-SCORE_SEQUENCES:]


def choose_start(
    kinds: tuple[str, ...],
    run: Callable[[str], tuple[Transform, dict]],
    scorer: StartScorer,
    kept: Transform | None,
) -> tuple[Transform, dict]:
    """The start one model keeps: ``kept`` (the models as they are; None: not a candidate, a
    matching is kept), or the matching among ``kinds`` (run in order by ``run``) that
    :mod:`~lmc_mergekit.matching.starts` chooses, with its record (every matching run under
    ``tried``, the scores, and the decision in words)."""
    current, transform, record = "kept", kept, {}
    tried, notes = {}, []
    if kept is not None:
        scorer.score("kept", None)
    for kind in kinds:
        if current in scorer.scores and scorer.leaves_no_barrier(current):
            barrier = scorer.barrier(current)
            notes.append(
                f"{kind.removesuffix('s')} matching not run: at ½, {MIXES[current]} lies "
                f"{abs(barrier):.4f} nats {'above' if barrier > 0 else 'below'} the mean of "
                f"the models' own losses (no barrier above {CLEAR_MARGIN} left to remove)"
            )
            break
        found, found_record = run(kind)
        tried[kind] = found_record
        if found_record.get("at_rounding_floor"):
            # The other model is the reference moved and rounded: their mix is the reference
            # itself to that rounding, and no start can do better. Nothing to score.
            notes.append(
                f"{kind.removesuffix('s')} matching kept without scoring: it brought the model "
                f"within {ROUNDING_FLOOR:g} × its storage rounding of the reference"
            )
            current, transform, record = kind, found, found_record
            break
        found_record["mix_loss"] = scorer.score(kind, found)
        if transform is None:  # the models as they are do not compete: the first is kept
            current, transform, record = kind, found, found_record
            continue
        better, figures = scorer.compare(current, kind)
        found_record["against"] = {"start": current, **figures}
        notes.append(
            f"{kind.removesuffix('s')} matching {'kept' if better else 'not kept'}: "
            f"{MIXES[kind]} is lower than {MIXES[current]} by {figures['lower_by']:.4f} nats "
            f"(needed: more than {figures['threshold']:.4f})"
        )
        if better:
            current, transform, record = kind, found, found_record
    for kind, found_record in tried.items():  # a score may have read more sequences since
        if kind in scorer.scores:
            found_record["mix_loss"] = scorer.scores[kind]
    record = {
        **record,
        "matching": current,
        "tried": tried,
        "scores": dict(scorer.scores),
        "scored_sequences": dict(scorer.read),
        "decision": "; ".join(notes),
    }
    return transform, record


def match_pair(
    kind: Matching,
    reference: CheckpointView,
    view: CheckpointView,
    config: AlignConfig,
    keep_tie: bool,
    progress: bool,
    device: torch.device | str,
    runner: BlockRunner | None,
    calibration: torch.Tensor | None,
    writer: Callable[[ModelSpec], PartsWriter] | None = None,
    reference_writer: Callable[[ModelSpec], PartsWriter] | None = None,
) -> tuple[Transform, dict, PartsWriter | None, PartsWriter | None]:
    """``view``'s transform onto ``reference`` by weight or activation matching, its record,
    and the writers weight matching handed ``view``'s moved parts and ``reference``'s to
    (``writer``, ``reference_writer``: see
    :func:`~lmc_mergekit.matching.weight_matching.match_weights`), where it did."""
    if kind == "activations":
        sequences = calibration[: config.activation_sequences]
        found = match_activations(
            reference, view, runner, sequences, keep_tie=keep_tie, progress=progress
        )
        return found.transform, found.record(), None, None
    result = match_weights(
        reference,
        view,
        max_iterations=config.max_iterations,
        device=device,
        progress=progress,
        keep_tie=keep_tie,
        writer=writer,
        reference_writer=reference_writer,
    )
    record = {
        "matching": "weights",
        "iterations": result.iterations,
        "stopped": result.stopped,
        "layers_solved": list(result.solved),
        "seconds": round(result.seconds, 3),
        "relative_distance": {"before": result.distances[0], "after": result.distance},
    }
    if result.written is not None:
        record["written_by_last_round"] = True
    if result.at_rounding_floor:
        record["at_rounding_floor"] = True
    return result.transform, record, result.written, result.written_reference


def moved(views: list[ModelView], transforms: list[Transform]) -> list[InMemoryView]:
    """Each model moved by its transform, in memory."""
    return [materialize(apply_transform(v, t)) for v, t in zip(views, transforms, strict=True)]


def block_runner(
    source: CheckpointView, spec: ModelSpec, device: torch.device, trust_remote_code: bool = False
) -> BlockMixer:
    """What learned matching runs the mixes' blocks through: one-layer stock modules of
    ``source``'s architecture with the moved models' ``spec`` (their norms absorbed)."""
    return BlockMixer(source.folder, source.adapter, spec, device, trust_remote_code)
