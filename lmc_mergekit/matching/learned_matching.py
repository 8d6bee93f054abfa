"""Learned matching: train every endpoint's continuous symmetries so that their mixes are good.

Each step draws mixing weights ``λ`` (a flat Dirichlet over the N endpoints: ``U(0,1)`` for two)
and a batch of calibration sequences, and takes one AdamW step on the loss of the mix
(:class:`~lmc_mergekit.matching.interpolation.InterpolationObjective`). The learning rate warms up
linearly and decays on a cosine.

Long runs are safe to interrupt: every ``checkpoint_every`` steps the parameters, the optimiser
state and the step are written atomically to ``state_dir``; a rerun resumes from there. The
batch and ``λ`` of step ``k`` come from a generator seeded by ``(seed, k)``, so a resumed run
draws what an uninterrupted one would and ends with the same result.

Learning never makes the merge worse than the matching it starts from. A few calibration
sequences are held out of training; the loss of fixed mixes on them (the highest of λ = ¼, ½,
¾ for two models, the centre for more) is measured at the start (matching's result, the floor)
and every fifth of the run (at every checkpoint at least). The best state is kept; a score far
above it sends the run back there with half the learning rate (so the step size comes down to
what the model takes), as a non-finite loss or one far above the start's score does; when the
rollbacks run out the run stops there; and the result is the last state if it scored within
the held-out noise of the best, else the best (:mod:`lmc_mergekit.runtime.rollback`, shared by
every training loop).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm.auto import tqdm

from lmc_mergekit.errors import LmcError
from lmc_mergekit.matching.interpolation import (
    InterpolationObjective,
    Precision,
    autocast_dtype,
    endpoint_dtype,
)
from lmc_mergekit.matching.step_memory import device_shortfall, step_memory
from lmc_mergekit.models.block_mixing import BlockMixer
from lmc_mergekit.models.view import ModelSpec, ModelView
from lmc_mergekit.runtime.distributed import Processes
from lmc_mergekit.runtime.memory import require_memory, trim_heap
from lmc_mergekit.runtime.rollback import TrainingState
from lmc_mergekit.runtime.schedule import warmup_cosine
from lmc_mergekit.symmetry.group import DEFAULT_FAMILIES, symmetry_group
from lmc_mergekit.symmetry.parametrize import (
    FAMILIES,
    Diverged,
    LearnedSymmetry,
    Parametrization,
)
from lmc_mergekit.symmetry.transform import Transform

Sampler = Literal["uniform", "band", "half"]
LOG = logging.getLogger(__name__)
CHECKPOINT_FILE = "learned_matching.pt"
# ``band`` keeps λ within this distance of the centre (for two models: U(0.4, 0.6)).
BAND = 0.2


@dataclass(frozen=True)
class LearningConfig:
    """What learned matching does; see the ``alignment:`` recipe keys for each field."""

    steps: int
    lr: float = 0.01
    warmup: float = 0.1
    batch_size: int = 16
    weight_decay: float = 0.0
    sampler: Sampler = "uniform"
    dual: bool = True
    families: tuple[str, ...] = DEFAULT_FAMILIES
    parametrization: Parametrization = "polar"
    checkpoint_every: int = 50
    seed: int = 0
    max_rollbacks: int = 3
    #: Keep tied embeddings tied (the residual map then stays weight matching's).
    keep_tie: bool = False
    #: bf16 autocast or float32; ``auto``: bf16 on a GPU, float32 elsewhere.
    precision: Precision = "auto"
    #: Calibration sequences held out of training to score the mixes (a quarter of the
    #: sequences when there are fewer than four times as many).
    heldout_sequences: int = 16


@dataclass
class LearningResult:
    """The learned symmetries (float64, to compose after weight matching) and how it went."""

    transforms: list[Transform]
    losses: list[float]
    seconds: float
    rollbacks: list[dict] = field(default_factory=list)
    resumed_from: int | None = None
    #: The symmetry families learned (those asked for that the model admits).
    families: tuple[str, ...] = ()
    #: Processes the endpoints were sharded over, and the endpoint MiB each one held.
    processes: int = 1
    endpoint_mib_per_process: float = 0.0
    #: Of the model's parts (embeddings, blocks, head), the most held whole at once.
    parts_held_whole: int = 0
    parts: int = 0
    #: The held-out watch: sequences, scores per step, the step whose state was kept.
    held_out: dict | None = None

    def summary(self) -> dict:
        """JSON-ready facts for the report."""
        window = max(1, len(self.losses) // 10)
        return {
            "steps": len(self.losses),
            "families": list(self.families),
            "seconds": round(self.seconds, 3),
            "first_loss": _mean(self.losses[:window]),
            "last_loss": _mean(self.losses[-window:]),
            "rollbacks": self.rollbacks,
            "resumed_from_step": self.resumed_from,
            "processes": self.processes,
            "endpoint_mib_per_process": round(self.endpoint_mib_per_process, 3),
            "parts_held_whole": self.parts_held_whole,
            "parts": self.parts,
            "held_out": self.held_out,
        }

    def outcome(self) -> str:
        """One line on what learning gained over the matching it started from."""
        if not self.held_out:
            return f"learned matching: {len(self.losses)} steps (no held-out sequences)"
        watch = self.held_out
        start, best = watch["start"], watch["best"]
        if watch["kept_step"] == 0:
            return (
                f"learned matching did not improve on matching (held-out mix loss {start:.4f} "
                "at the start): kept the matched alignment"
            )
        kept = watch["kept_score"]
        return (
            f"learned matching: held-out mix loss {start:.4f} -> {kept:.4f} "
            f"(kept step {watch['kept_step']}; best {best:.4f})"
        )


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def mixing_weights(count: int, sampler: Sampler, generator: torch.Generator) -> torch.Tensor:
    """``λ`` over ``count`` endpoints: flat Dirichlet (``uniform``), the same shrunk towards the
    centre (``band``), or the centre itself (``half``)."""
    centre = torch.full((count,), 1.0 / count)
    if sampler == "half":
        return centre
    # Normalised exponentials are a flat Dirichlet draw.
    draw = -torch.rand(count, generator=generator).log()
    draw = draw / draw.sum()
    return draw if sampler == "uniform" else centre + BAND * (draw - centre)


def check_learnable(spec: ModelSpec, families: Sequence[str], keep_tie: bool) -> None:
    """A one-line error unless models of ``spec`` admit one of ``families`` (before any
    matching or learning runs)."""
    admitted = symmetry_group(spec, keep_tie).learnable
    if not set(families) & set(admitted):
        raise LmcError(
            f"alignment learns nothing: of the families asked for ({', '.join(families)}) "
            f"the {spec.architecture} model admits none as a continuous symmetry (it admits "
            f"{', '.join(admitted)}); change learn: or set steps: 0"
        )


def learning_rate(step: int, config: LearningConfig) -> float:
    """Linear warm-up over ``warmup`` of the steps, then cosine decay to zero."""
    warmup = max(1, round(config.warmup * config.steps))
    return config.lr * warmup_cosine(step, config.steps, warmup)


def learn_symmetries(
    endpoints: list[ModelView],
    runner: BlockMixer,
    sequences: torch.Tensor,
    config: LearningConfig,
    *,
    state_dir: Path | None = None,
    processes: Processes | None = None,
    progress: bool = True,
    on_checkpoint: Callable[[int, list[Transform]], None] | None = None,
) -> LearningResult:
    """Learn each endpoint's continuous symmetries (the first one's too, unless one-sided) on
    ``sequences`` (``(n, L)`` token ids), the mixes run block by block through ``runner``; the
    endpoints are read one part at a time (and sharded under several processes). Returns them
    as transforms to apply after the ones that produced ``endpoints``.
    ``on_checkpoint(step, transforms)`` is called at every checkpoint (benchmarks use it to
    follow the barrier during a run)."""
    processes = processes or Processes()
    if config.batch_size % processes.world_size:
        raise LmcError(
            f"alignment batch_size {config.batch_size} does not split evenly over "
            f"{processes.world_size} processes; use a multiple of {processes.world_size}"
        )
    spec = endpoints[0].spec
    learned = [
        None
        if (index == 0 and not config.dual)
        else LearnedSymmetry(
            spec,
            # The first endpoint's scale is redundant with the others': only ratios matter.
            tuple(f for f in config.families if index > 0 or f != "scale"),
            config.parametrization,
            config.keep_tie,
        )
        for index in range(len(endpoints))
    ]
    device = runner.device
    autocast = autocast_dtype(config.precision, device)
    sequences, heldout = heldout_split(sequences, config.heldout_sequences)
    free = None
    held = endpoint_dtype(autocast, [endpoints[0].block(0)]).itemsize
    memory = step_memory(
        spec,
        len(endpoints),
        held,
        config.batch_size // processes.world_size * sequences.shape[-1],
        sequences.shape[-1],
        processes=processes.world_size,
        scores=runner.keeps_attention_scores,
        reads_tokens=spec.tied_embeddings and processes.world_size == 1,
        casts=autocast is None and held < 4,
    )
    # Before any endpoint is loaded: fail before heavy work.
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        problem = device_shortfall(memory, free)
        if problem is not None:
            raise LmcError(problem)
    else:
        fits = "lower alignment batch_size, or set steps: 0 (matching alone)"
        require_memory(memory.need(0), "learned matching", fits)
    objective = InterpolationObjective(endpoints, learned, runner, processes, autocast)
    objective.free = free
    objective.symmetries.to(device)
    params = [p for p in objective.symmetries.parameters()]
    if not params:
        check_learnable(spec, config.families, config.keep_tie)
        raise LmcError("alignment learns nothing; change learn: or set steps: 0")
    for param in params:  # every process reduces the same gradient list, even after a failure
        param.grad = torch.zeros_like(param)
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    state = _State(objective, optimizer, config)
    checkpoint = None if state_dir is None else state_dir / CHECKPOINT_FILE
    resumed_from = state.load(checkpoint, asdict(config), processes) if checkpoint else None
    start = time.perf_counter()
    mixes = watched_mixes(len(endpoints))

    def score() -> float:
        """The held-out score of the current symmetries (infinite for maps too close to
        singular to be written)."""
        started = time.perf_counter()
        try:
            for transform in _transforms(learned, spec.num_layers, config.keep_tie):
                transform.check_fits(spec)
        except LmcError:
            return math.inf
        with torch.no_grad(), torch.autocast(device.type, autocast, enabled=autocast is not None):
            batch = processes.shard(heldout).to(device)
            values = torch.stack([objective(w.to(device), batch) for w in mixes]).float()
        processes.mean([values])
        trim_heap()  # the scoring's pieces: not kept by the heap for the steps
        state.watch_seconds += time.perf_counter() - started
        return float(values.max())

    watching = heldout is not None
    # Often enough that a rise costs a fifth of the run at most, at every checkpoint at least.
    watch_every = max(1, min(config.checkpoint_every, math.ceil(config.steps / 5)))
    if watching and not state.scores:  # the start, matching's result: the floor
        state.watch(score())
    state.keep()
    tell = progress and processes.is_main
    bar = tqdm(total=config.steps, initial=state.step, desc="learned matching", disable=not tell)
    timed = False
    while state.step < config.steps and not state.stopped:
        step, stepped = state.step, time.perf_counter()
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        batch = sequences[torch.randint(len(sequences), (config.batch_size,), generator=generator)]
        weights = mixing_weights(len(endpoints), config.sampler, generator).to(device)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, config) * state.lr_scale
        optimizer.zero_grad(set_to_none=False)
        try:
            # One code path: the precision is a parameter (bf16 autocast runs on the CPU too).
            with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                loss = objective(weights, processes.shard(batch).to(device))
            loss.backward()
            reduced = loss.detach().clone()
        except (torch.linalg.LinAlgError, Diverged):  # a map went singular: like a NaN loss
            reduced = torch.tensor(math.nan, device=device)
        processes.mean([reduced] + [p.grad for p in params])
        trim_heap()  # a step's pieces, freed: each step's peak, not their sum
        value = float(reduced)
        state.steps_run += 1
        if state.diverged(value):
            state.roll_back(step, value)
            bar.n = state.step
            bar.refresh()
            continue
        optimizer.step()
        state.accept(value)
        bar.update()
        bar.set_postfix(loss=f"{value:.4f}", lr=f"{group['lr']:.2e}")
        if not timed and tell:
            timed = True
            _say_how_long(bar, config.steps - state.step, time.perf_counter() - stepped)
        last = state.step == config.steps
        if watching and (state.step % watch_every == 0 or last) and not state.watch(score()):
            state.roll_back(state.step, state.scores[-1][1], to_best=True)
            bar.n = state.step
            bar.refresh()
            continue
        if state.step % config.checkpoint_every == 0 or last:
            snapshot = state.keep()
            if checkpoint is not None and processes.is_main:
                state.save(checkpoint, asdict(config), snapshot)
                # A line a supervisor (or a test) can act on: safe to stop from here on.
                LOG.info("learned matching: step %d checkpointed", state.step)
            if on_checkpoint is not None:
                on_checkpoint(state.step, _transforms(learned, spec.num_layers, config.keep_tie))
    bar.close()
    kept = state.settle()  # the best state measured: never worse than the start
    processes.barrier()
    return LearningResult(
        transforms=_transforms(learned, spec.num_layers, config.keep_tie),
        losses=state.losses,
        seconds=time.perf_counter() - start,
        rollbacks=state.rollbacks,
        resumed_from=resumed_from,
        families=tuple(f for f in FAMILIES if any(s and f in s.families for s in learned)),
        processes=processes.world_size,
        endpoint_mib_per_process=objective.held_bytes() / 2**20,
        parts_held_whole=objective.most_gathered,
        parts=len(objective.parts()),
        held_out=None if kept is None else _watch_record(state, kept, len(heldout), mixes),
    )


def heldout_split(sequences: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The training sequences and the last ``count`` held out (a quarter where there are fewer
    than four times ``count``; none of fewer than four sequences)."""
    count = min(count, len(sequences) // 4)
    if count == 0:
        return sequences, None
    return sequences[:-count], sequences[-count:]


def watched_mixes(count: int) -> list[torch.Tensor]:
    """The fixed mixing weights the held-out score is measured at: λ = ¼, ½, ¾ between two
    models (the path's middle, where its barrier is), the centre of more."""
    if count == 2:
        return [torch.tensor([1 - lam, lam]) for lam in (0.25, 0.5, 0.75)]
    return [torch.full((count,), 1.0 / count)]


def _watch_record(state: TrainingState, kept: int, sequences: int, mixes) -> dict:
    return {
        "sequences": sequences,
        "mixes": [[round(float(w), 4) for w in mix] for mix in mixes],
        "scores": [[int(step), score] for step, score in state.scores],
        "seconds": round(state.watch_seconds, 3),
        "steps_run": state.steps_run,
        "start": state.scores[0][1],
        "best": state.best["score"],
        "kept_score": next(s for step, s in reversed(state.scores) if step == kept),
        "kept_step": kept,
        "stopped_early": state.stopped,
    }


def _say_how_long(bar, steps: int, seconds: float) -> None:
    """One line, before the run goes on, on how long its remaining steps will take."""
    total = steps * seconds
    when = f"{total / 60:.0f} min" if total >= 90 else f"{total:.0f} s"
    bar.write(
        f"learned matching: {seconds:.2f} s a step measured; {steps} more steps take about "
        f"{when} (set alignment steps: to trade time for quality)"
    )


def _transforms(
    learned: list[LearnedSymmetry | None], num_layers: int, keep_tie: bool
) -> list[Transform]:
    """The current symmetries (an endpoint held fixed gets the identity)."""
    return [
        Transform(num_layers, absorb_norms=True, keep_tie=keep_tie)
        if s is None
        else s.frozen_transform()
        for s in learned
    ]


class _State(TrainingState):
    """Learned matching's training state: the symmetries' parameters and the optimiser."""

    def __init__(
        self,
        objective: InterpolationObjective,
        optimizer: torch.optim.Optimizer,
        config: LearningConfig,
    ):
        super().__init__(
            "learned matching", config.lr, config.max_rollbacks, "set a smaller alignment lr"
        )
        self.objective, self.optimizer = objective, optimizer
        self.watch_seconds = 0.0  # spent on held-out scores
        self.steps_run = 0  # steps taken, those rolled back included

    def capture(self) -> dict:
        return {
            "symmetries": self.objective.symmetries.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def apply(self, parts: dict) -> None:
        self.objective.symmetries.load_state_dict(parts["symmetries"])
        self.optimizer.load_state_dict(copy.deepcopy(parts["optimizer"]))
