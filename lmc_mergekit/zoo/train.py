"""Training a zoo model from scratch, reproducibly per seed.

The seed fixes both the initialisation and the order of the training batches, so two seeds give
two independently trained models (the setting of linear mode connectivity) and one seed always
gives the same weights, bit for bit, on the same machine and software.
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Callable, Collection
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from lmc_mergekit.data.sequences import DataConfig, load_split
from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.loss import DEFAULT_EVAL_SEQUENCES, mean_token_loss
from lmc_mergekit.runtime.publish import scratch_folder
from lmc_mergekit.runtime.rollback import TrainingState, rollbacks_for_json
from lmc_mergekit.runtime.schedule import warmup_cosine

# Tuned on the bundled corpus for a 4-layer d=128 GPT-NeoX, batch 16x128, 1500 steps.
DEFAULT_LR = 6e-3
DEFAULT_WARMUP = 100
WEIGHT_DECAY = 0.1
MIN_LR_FRACTION = 0.1  # the cosine decays to this fraction of the peak rate
SMOOTHING = 0.98  # of the reported training loss (an exponential moving average)
#: Steps between snapshots (rollback targets and, given a file, resumable checkpoints).
CHECKPOINT_EVERY = 100
#: Rollbacks after a diverged step before the training stops with an error.
MAX_ROLLBACKS = 3
#: Bumped when the checkpoint's contents change: an older checkpoint is not resumed.
STATE_FORMAT = 2


def train_model(
    config: PretrainedConfig,
    tokenizer,
    data: DataConfig,
    *,
    seed: int,
    steps: int,
    batch_size: int = 16,
    lr: float = DEFAULT_LR,
    warmup: int = DEFAULT_WARMUP,
    progress: bool = True,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, dict]:
    """Train a model of ``config`` from scratch on the train split of ``data`` for ``steps``
    AdamW steps of ``batch_size`` sequences; return it (in eval mode) and a record of the run:
    settings, smoothed final training loss, validation and test loss (on up to
    :data:`DEFAULT_EVAL_SEQUENCES` sequences each), wall time, tokens per second and parameter
    count.

    The learning rate warms up linearly over ``warmup`` steps (at most a fifth of training) and
    then decays along a cosine to a tenth of ``lr``. The model is initialised on the CPU and
    trained on ``device`` (bitwise reproducibility holds for one device and thread count).
    """
    if steps < 1 or batch_size < 1:
        raise LmcError(f"steps ({steps}) and batch size ({batch_size}) must be at least 1")
    if not lr > 0:
        raise LmcError(f"learning rate must be positive, not {lr}")
    train = load_split(data, tokenizer, "train")
    # Held-out text is loaded first: too little of it is better found before training.
    held_out = {
        split: load_split(data, tokenizer, split, max_sequences=DEFAULT_EVAL_SEQUENCES)
        for split in ("validation", "test")
    }
    torch.manual_seed(seed)  # the initialisation
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    record = continue_training(
        model,
        train,
        seed=seed,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        warmup=warmup,
        progress=progress,
        desc=f"training seed {seed}",
    )
    validation, test = (
        mean_token_loss(model, held_out[split], batch_size=16) for split in ("validation", "test")
    )
    record.update(
        {
            "validation_loss": float(validation.loss),
            "validation_tokens": int(validation.tokens),
            "test_loss": float(test.loss),
            "test_tokens": int(test.tokens),
            "parameters": sum(p.numel() for p in model.parameters()),
        }
    )
    return model, record


def continue_training(
    model: PreTrainedModel,
    train: torch.Tensor,
    *,
    seed: int,
    steps: int,
    batch_size: int = 16,
    lr: float = DEFAULT_LR,
    warmup: int = DEFAULT_WARMUP,
    progress: bool = True,
    desc: str = "training",
    after_step: Callable[[int], None] | None = None,
    evaluate: Callable[[PreTrainedModel], dict[str, float]] | None = None,
    evaluate_at: Collection[int] = (),
    checkpoint: Path | None = None,
    identity=None,
    checkpoint_every: int = CHECKPOINT_EVERY,
    objective: Objective | None = None,
) -> dict:
    """Train ``model`` in place for ``steps`` AdamW steps on batches of the ``(n, length)``
    sequences ``train`` and leave it in eval mode; return a record of the run.

    The batch order depends on ``seed`` alone, so models trained with one seed see the same
    data in the same order whatever their starting weights. The learning rate warms up
    linearly over ``warmup`` steps (at most a fifth of training), then decays along a cosine
    to a tenth of ``lr``. ``after_step(n)`` is called after the ``n``-th step (1-based), e.g.
    to evaluate part-way; ``evaluate(model)`` (named held-out losses) runs before the steps listed
    in ``evaluate_at`` (0: before training; ``steps``: at the end) and its results are the
    record's ``evaluations``.

    A diverged step (non-finite or exploding loss) rolls back to the last snapshot with half
    the learning rate (:mod:`lmc_mergekit.runtime.rollback`). Every ``checkpoint_every`` steps
    a snapshot is kept and, with ``checkpoint``, saved there under ``identity`` (everything
    that defines the run besides these settings); an interrupted run given the same file and
    identity resumes from it, to the same weights, and the file is removed at the end. The kept
    snapshots are files (beside ``checkpoint``, else in the system's temporary folder), so a
    large model's rollback costs disk, not memory.

    ``objective(model, batch)`` computes a step's loss, accumulates its gradient and returns its
    value (default :func:`next_token_step`, the text's next-token loss).
    """
    spill_parent = Path(tempfile.gettempdir()) if checkpoint is None else checkpoint.parent
    with scratch_folder(spill_parent, "snapshots") as spill:
        return _train(
            model, train, spill, seed=seed, steps=steps, batch_size=batch_size, lr=lr,
            warmup=warmup, progress=progress, desc=desc, after_step=after_step,
            evaluate=evaluate, evaluate_at=evaluate_at, checkpoint=checkpoint,
            identity=identity, checkpoint_every=checkpoint_every,
            objective=objective or next_token_step,
        )  # fmt: skip


#: One step's loss: computed on ``(model, batch)``, its gradient accumulated, its value returned.
Objective = Callable[[PreTrainedModel, torch.Tensor], float]


def next_token_step(model: PreTrainedModel, batch: torch.Tensor) -> float:
    """The mean next-token loss of ``model`` on ``batch``, backpropagated; its value."""
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    return loss.item()


def _train(
    model, train, spill: Path, *, seed, steps, batch_size, lr, warmup, progress, desc,
    after_step, evaluate, evaluate_at, checkpoint, identity, checkpoint_every, objective,
) -> dict:  # fmt: skip
    """:func:`continue_training`'s loop, its kept snapshots written to ``spill``."""
    warmup = max(0, min(warmup, steps // 5))
    device = next(model.parameters()).device
    model.train()
    train = train.to(device)
    optimizer = _adamw(model, lr)
    batches = _Batches(len(train), batch_size, seed)
    state = _ModelState(model, optimizer, batches, lr, spill)
    settings = {"seed": seed, "steps": steps, "batch": batch_size, "lr": lr, "warmup": warmup}
    identity = {"run": identity, "settings": settings, "format": STATE_FORMAT}
    start = state.load(checkpoint, identity) or 0  # None also for a checkpoint of another run
    state.keep()
    tokens_per_step = batch_size * train.shape[1]
    evaluate_at = set(evaluate_at) if evaluate is not None else set()

    def evaluate_if_due(step: int) -> None:
        # A resumed run has the evaluations its checkpoint holds: each step is measured once.
        if step in evaluate_at and step not in state.evaluated:
            seconds = round(state.train_seconds, 2)  # of training so far, not evaluating
            state.evaluations.append({"step": step, "seconds": seconds, **evaluate(model)})
            model.train()

    bar = tqdm(total=steps, initial=start, desc=desc, unit="step", disable=not progress)
    started = time.perf_counter()
    while state.step < steps:
        step = state.step
        evaluate_if_due(step)
        stepped = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr * warmup_cosine(step, steps, warmup, MIN_LR_FRACTION) * state.lr_scale
        batch = train[batches.next().to(device)]
        value = objective(model, batch)
        if state.diverged(value):
            optimizer.zero_grad(set_to_none=True)
            state.roll_back(step, value)
            bar.n = state.step
            bar.refresh()
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.accept(value)
        state.train_seconds += time.perf_counter() - stepped
        bar.update()
        if state.step % checkpoint_every == 0 and state.step < steps:
            snapshot = state.keep()
            if checkpoint is not None:
                state.save(checkpoint, identity, snapshot)
        if after_step is not None:
            after_step(state.step)
            model.train()
        if step % 10 == 0 or state.step == steps:
            elapsed = time.perf_counter() - started
            bar.set_postfix(
                loss=f"{_smoothed(state.losses):.3f}",
                tok_s=f"{tokens_per_step * (state.step - start) / elapsed:.0f}",
            )
    bar.close()
    evaluate_if_due(steps)
    state.forget_kept()
    wall = time.perf_counter() - started
    model.eval()
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)
    return {
        "seed": seed,
        "steps": steps,
        "batch_size": batch_size,
        "seq_len": int(train.shape[1]),
        "lr": lr,
        "warmup": warmup,
        "weight_decay": WEIGHT_DECAY,
        "train_sequences": len(train),
        "tokens_seen": tokens_per_step * steps,
        "first_train_loss": state.losses[0] if state.losses else None,
        "train_loss": _smoothed(state.losses),
        "wall_time_s": round(wall, 2),
        "tokens_per_s": round(tokens_per_step * max(1, steps - start) / wall, 1),
        "resumed_at": start,
        "rollbacks": rollbacks_for_json(state.rollbacks),
        "evaluations": list(state.evaluations),
    }


def _smoothed(losses: list[float]) -> float:
    """The bias-corrected exponential moving average of ``losses`` (NaN for none)."""
    average = 0.0
    for loss in losses:
        average = SMOOTHING * average + (1 - SMOOTHING) * loss
    return average / (1 - SMOOTHING ** len(losses)) if losses else float("nan")


class _ModelState(TrainingState):
    """A model training's state: the weights, the optimiser, the batch order and the held-out
    evaluations so far."""

    def __init__(self, model, optimizer, batches: _Batches, lr: float, spill: Path):
        super().__init__("training", lr, MAX_ROLLBACKS, "set a smaller learning rate", spill=spill)
        self.model, self.optimizer, self.batches = model, optimizer, batches
        self.evaluations: list[dict] = []
        #: Seconds of the accepted steps so far (resumed runs go on counting).
        self.train_seconds = 0.0

    @property
    def evaluated(self) -> set[int]:
        return {e["step"] for e in self.evaluations}

    def capture(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "batches": self.batches.capture(),
            "rng": torch.get_rng_state(),
            "evaluations": [dict(e) for e in self.evaluations],
            "train_seconds": self.train_seconds,
        }

    def apply(self, parts: dict) -> None:
        self.model.load_state_dict(parts["model"])
        self.optimizer.load_state_dict(copy.deepcopy(parts["optimizer"]))
        self.batches.restore(parts["batches"])
        torch.set_rng_state(parts["rng"])
        self.evaluations = [dict(e) for e in parts["evaluations"]]
        self.train_seconds = parts["train_seconds"]


def _adamw(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norm gains and biases), fused: the
    multi-tensor step makes a temporary the size of the model (its ``sqrt`` of the second
    moments), which a large model's training cannot spare."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


class _Batches:
    """Row indices of the training batches: epochs of random permutations drawn from a
    generator seeded with ``seed``, so each sequence is seen once per epoch. Its position
    can be captured and restored, so a resumed run sees the batches it would have seen."""

    def __init__(self, count: int, batch_size: int, seed: int):
        self.count, self.batch_size = count, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.pending = torch.empty(0, dtype=torch.long)

    def next(self) -> torch.Tensor:
        while len(self.pending) < self.batch_size:
            self.pending = torch.cat(
                [self.pending, torch.randperm(self.count, generator=self.generator)]
            )
        batch, self.pending = self.pending[: self.batch_size], self.pending[self.batch_size :]
        return batch

    def capture(self) -> dict:
        return {"generator": self.generator.get_state(), "pending": self.pending.clone()}

    def restore(self, parts: dict) -> None:
        self.generator.set_state(parts["generator"])
        self.pending = parts["pending"].clone()
