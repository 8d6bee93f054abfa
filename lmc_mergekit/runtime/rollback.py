"""Rolling a training loop back when its loss diverges: one mechanism for every loop of the tool.

A loop's :class:`TrainingState` holds the step, the accepted losses, the learning-rate scale and
the rollbacks so far, next to the loop's own parts (its model or parameters, optimiser, random
generators: :meth:`TrainingState.capture` and :meth:`TrainingState.apply`). Its snapshots are
kept in memory as rollback targets, and the newest is what the loop writes as its resumable
checkpoint (:mod:`lmc_mergekit.runtime.resumable`), so a resumed run knows its rollbacks too.

A non-finite loss, or one that explodes, sends the loop back to the last snapshot with half the
learning rate (one further back if it fails again from there); after ``max_rollbacks`` the run
stops with a one-line error. An explosion is judged against the largest of the recent accepted
losses, not against the first: where the loss varies by design from step to step (learned
matching draws λ each step, and a λ near an endpoint gives a far smaller loss than one
mid-path), the first step is one draw, and the recent maximum is the level the run has shown.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from lmc_mergekit.errors import LmcError
from lmc_mergekit.runtime.distributed import Processes
from lmc_mergekit.runtime.resumable import load_state, save_state

#: A step whose loss exceeds this multiple of the largest recent loss counts as exploding.
EXPLODE_FACTOR = 2.0
#: How many accepted losses are recent, and how many there must be before explosions count
#: (the learning rate warms up, so the first steps cannot explode; NaN and Inf always count).
WINDOW = 20
MIN_HISTORY = 5
#: One snapshot taken just before a blow-up may already hold bad values: keep a few.
KEPT_SNAPSHOTS = 3


def exploded(loss: float, losses: Sequence[float], factor: float = EXPLODE_FACTOR) -> bool:
    """Whether ``loss`` exceeds ``factor`` times the largest of the last :data:`WINDOW`
    accepted ``losses`` (never while there are fewer than :data:`MIN_HISTORY`)."""
    recent = losses[-WINDOW:]
    return len(recent) >= MIN_HISTORY and loss > factor * max(recent)


def rollbacks_for_json(rollbacks: list[dict]) -> list[dict]:
    """``rollbacks`` with the losses JSON has no number for (NaN, Inf) as strings."""
    return [
        {**r, "loss": r["loss"] if math.isfinite(r["loss"]) else str(r["loss"])} for r in rollbacks
    ]


class TrainingState:
    """A training loop's progress, snapshots and rollbacks. Subclasses say what else a snapshot
    holds (:meth:`capture`, :meth:`apply`).

    ``what`` names the loop in the error after too many rollbacks and ``fix`` says what to do
    then; ``explode_factor`` None counts only non-finite losses as divergence (for a loss that
    legitimately jumps, like the autoencoder's when its KL term switches on)."""

    def __init__(
        self,
        what: str,
        lr: float,
        max_rollbacks: int,
        fix: str,
        explode_factor: float | None = EXPLODE_FACTOR,
    ):
        self.what, self.lr, self.max_rollbacks, self.fix = what, lr, max_rollbacks, fix
        self.explode_factor = explode_factor
        self.step = 0
        self.lr_scale = 1.0
        self.losses: list[float] = []
        self.rollbacks: list[dict] = []
        self.kept: deque[dict] = deque(maxlen=KEPT_SNAPSHOTS)

    def capture(self) -> dict:
        """Copies of the loop's own parts (a snapshot must not change as training goes on)."""
        raise NotImplementedError

    def apply(self, parts: dict) -> None:
        """Put back the parts :meth:`capture` returned."""
        raise NotImplementedError

    def snapshot(self) -> dict:
        """The whole state: progress, rollbacks and the loop's parts."""
        return {
            "step": self.step,
            "lr_scale": self.lr_scale,
            "losses": list(self.losses),
            "rollbacks": list(self.rollbacks),
            **self.capture(),
        }

    def restore(self, snapshot: dict) -> None:
        """Go back to ``snapshot``."""
        self.step = snapshot["step"]
        self.lr_scale = snapshot["lr_scale"]
        self.losses = list(snapshot["losses"])
        self.rollbacks = list(snapshot["rollbacks"])
        self.apply(snapshot)

    def keep(self) -> dict:
        """Take a snapshot and keep it as a rollback target."""
        self.kept.append(self.snapshot())
        return self.kept[-1]

    def accept(self, loss: float) -> None:
        """Count a step that ended with the (not diverged) ``loss``."""
        self.step += 1
        self.losses.append(loss)

    def diverged(self, loss: float) -> bool:
        """Whether ``loss`` is non-finite or (with an ``explode_factor``) explodes."""
        if not math.isfinite(loss):
            return True
        return self.explode_factor is not None and exploded(loss, self.losses, self.explode_factor)

    def roll_back(self, step: int, loss: float) -> None:
        """Back to the last kept snapshot (one further back if that one failed already) with
        half the learning rate; a one-line error after too many tries."""
        if self.rollbacks and self.rollbacks[-1]["back_to"] == self.kept[-1]["step"]:
            if len(self.kept) > 1:
                self.kept.pop()
        saved = self.kept[-1]
        record = {"step": step, "loss": loss, "back_to": saved["step"]}
        rollbacks = [*self.rollbacks, record]
        if len(rollbacks) > self.max_rollbacks:
            raise LmcError(
                f"{self.what} diverged {len(rollbacks)} times (loss {loss:.3g} at step {step}) "
                f"even after lowering the learning rate to {self.lr_scale * self.lr:.2e}; "
                f"{self.fix}"
            )
        scale = self.lr_scale * 0.5
        self.restore(saved)
        self.rollbacks, self.lr_scale = rollbacks, scale

    def save(self, path: Path, identity, snapshot: dict) -> None:
        """Write ``snapshot`` as the resumable checkpoint of the run ``identity``."""
        save_state(path, identity, snapshot)

    def load(self, path: Path | None, identity, processes: Processes | None = None) -> int | None:
        """Resume from the checkpoint at ``path`` if the run ``identity`` wrote it; the step
        resumed from, or None. Under several ``processes`` the main one (the one that writes
        checkpoints) reads it and every process resumes from what it read."""
        # None also when the settings changed.
        saved = (processes or Processes()).from_main(lambda: load_state(path, identity))
        if saved is None:
            return None
        self.restore(saved)
        return self.step
