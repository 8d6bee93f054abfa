"""Learned matching: train every endpoint's continuous symmetries so that their mixes are good.

Each step draws mixing weights ``λ`` (a flat Dirichlet over the N endpoints: ``U(0,1)`` for two)
and a batch of calibration sequences, and takes one AdamW step on the loss of the mix
(:class:`~lmc_mergekit.matching.interpolation.InterpolationObjective`). The learning rate warms up
linearly and decays on a cosine.

Long runs are safe to interrupt: every ``checkpoint_every`` steps the parameters, the optimiser
state and the step are written atomically to ``state_dir``; a rerun resumes from there. The
batch and ``λ`` of step ``k`` come from a generator seeded by ``(seed, k)``, so a resumed run
draws what an uninterrupted one would and ends with the same result. A non-finite or exploding
loss rolls back to the last checkpoint with half the learning rate; after ``max_rollbacks`` the
run stops with an error (:mod:`lmc_mergekit.runtime.rollback`, shared by every training loop).
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
)
from lmc_mergekit.models.block_runner import BlockRunner
from lmc_mergekit.models.view import ModelSpec, ModelView
from lmc_mergekit.runtime.distributed import Processes
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
        }


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
    runner: BlockRunner,
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
    objective = InterpolationObjective(endpoints, learned, runner, processes, autocast)
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
    state.keep()
    start = time.perf_counter()
    bar = tqdm(
        total=config.steps,
        initial=state.step,
        desc="learned matching",
        disable=not (progress and processes.is_main),
    )
    while state.step < config.steps:
        step = state.step
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
        value = float(reduced)
        if state.diverged(value):
            state.roll_back(step, value)
            bar.n = state.step
            bar.refresh()
            continue
        optimizer.step()
        state.accept(value)
        bar.update()
        bar.set_postfix(loss=f"{value:.4f}", lr=f"{group['lr']:.2e}")
        if state.step % config.checkpoint_every == 0 or state.step == config.steps:
            snapshot = state.keep()
            if checkpoint is not None and processes.is_main:
                state.save(checkpoint, asdict(config), snapshot)
                # A line a supervisor (or a test) can act on: safe to stop from here on.
                LOG.info("learned matching: step %d checkpointed", state.step)
            if on_checkpoint is not None:
                on_checkpoint(state.step, _transforms(learned, spec.num_layers, config.keep_tie))
    bar.close()
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

    def capture(self) -> dict:
        return {
            "symmetries": {k: v.clone() for k, v in self.objective.symmetries.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
        }

    def apply(self, parts: dict) -> None:
        self.objective.symmetries.load_state_dict(parts["symmetries"])
        self.optimizer.load_state_dict(copy.deepcopy(parts["optimizer"]))
