"""Rolling a training loop back when its loss diverges: one mechanism for every loop of the tool.

A loop's :class:`TrainingState` holds the step, the accepted losses, the learning-rate scale and
the rollbacks so far, next to the loop's own parts (its model or parameters, optimiser, random
generators: :meth:`TrainingState.capture` and :meth:`TrainingState.apply`). Its snapshots are
kept as rollback targets, and the newest is what the loop writes as its resumable checkpoint
(:mod:`lmc_mergekit.runtime.resumable`), so a resumed run knows its rollbacks too. A loop whose
parts are small keeps its snapshots in memory; a model's training (model and AdamW state:
12 bytes a parameter, 12 GB a snapshot at 1B) writes them to files in a ``spill`` folder and
holds none, so rollback costs disk, not memory.

A non-finite loss, or one that explodes, sends the loop back to the last snapshot with half the
learning rate (one further back if it fails again from there); after ``max_rollbacks`` the run
stops with a one-line error. An explosion is judged against the largest of the recent accepted
losses, not against the first: where the loss varies by design from step to step (learned
matching draws λ each step, and a λ near an endpoint gives a far smaller loss than one
mid-path), the first step is one draw, and the recent maximum is the level the run has shown.

A loop that can score itself on held-out data (:meth:`TrainingState.watch`) keeps its best
state so far: a score that rises above the best sends it back there with half the learning
rate, a loss far above the start's score counts as an explosion from the first step on, and
when the rollbacks run out the loop stops at its best instead of failing (learned matching:
never worse than the matching it started from).
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch

from lmc_mergekit.errors import LmcError
from lmc_mergekit.runtime.distributed import Processes
from lmc_mergekit.runtime.resumable import link_state, load_state, save_state

#: The key of a kept snapshot written to a file: its path.
SPILLED = "spilled"

#: A step whose loss exceeds this multiple of the largest recent loss counts as exploding.
EXPLODE_FACTOR = 2.0
#: How many accepted losses are recent, and how many there must be before explosions count
#: (the learning rate warms up, so the first steps cannot explode; NaN and Inf always count).
WINDOW = 20
MIN_HISTORY = 5
#: One snapshot taken just before a blow-up may already hold bad values: keep a few.
KEPT_SNAPSHOTS = 3
#: A held-out score this fraction above the best one counts as a rise: a learning run's scores
#: wander on the way (a few per cent on the zoo's pairs while the rate warms up) and the best
#: is kept in any case; a step size the model does not take shows as far more (+65 % on
#: SmolLM2 at the default rate).
RISE_TOLERANCE = 0.1
#: A run ends on its last state when that state scored within this fraction of the best (a
#: difference that small is the held-out sample's noise, and the later state is what the
#: run learned); otherwise on the best.
SETTLE_TOLERANCE = 0.005


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
    legitimately jumps, like the autoencoder's when its KL term switches on); with ``spill``
    (an existing folder) the kept snapshots are files there, not copies in memory."""

    def __init__(
        self,
        what: str,
        lr: float,
        max_rollbacks: int,
        fix: str,
        explode_factor: float | None = EXPLODE_FACTOR,
        spill: Path | None = None,
    ):
        self.what, self.lr, self.max_rollbacks, self.fix = what, lr, max_rollbacks, fix
        self.explode_factor = explode_factor
        self.spill = spill
        self._written = 0
        #: The run's identity (:meth:`load`), written into spilled snapshots: the newest is
        #: then the resumable checkpoint as it stands, linked rather than written again.
        self.identity = None
        self.step = 0
        self.lr_scale = 1.0
        self.losses: list[float] = []
        self.rollbacks: list[dict] = []
        self.kept: deque[dict] = deque(maxlen=KEPT_SNAPSHOTS)
        #: Held-out scores as ``[step, score]``; the best state so far (a snapshot and its
        #: score); whether the rollbacks ran out and the loop stopped at its best.
        self.scores: list[list[float]] = []
        self.best: dict | None = None
        self.stopped = False

    def capture(self) -> dict:
        """The loop's own parts as they are now (live tensors: :meth:`keep` copies or writes
        them)."""
        raise NotImplementedError

    def apply(self, parts: dict) -> None:
        """Put back the parts :meth:`capture` returned."""
        raise NotImplementedError

    def snapshot(self) -> dict:
        """The whole state: progress, rollbacks, held-out scores, the best state and the
        loop's parts."""
        return {**self._progress(), "scores": [list(s) for s in self.scores], "best": self.best}

    def _progress(self) -> dict:
        return {
            "step": self.step,
            "lr_scale": self.lr_scale,
            "losses": list(self.losses),
            "rollbacks": list(self.rollbacks),
            **self.capture(),
        }

    def restore(self, snapshot: dict) -> None:
        """Go back to ``snapshot`` (a best state leaves the score history and the best as
        they are)."""
        self.step = snapshot["step"]
        self.lr_scale = snapshot["lr_scale"]
        self.losses = list(snapshot["losses"])
        self.rollbacks = list(snapshot["rollbacks"])
        if "best" in snapshot:
            self.scores = [list(s) for s in snapshot.get("scores", [])]
            self.best = snapshot["best"]
        self.apply(snapshot)

    def keep(self) -> dict:
        """Take a snapshot and keep it as a rollback target: a copy in memory or, with a
        ``spill`` folder, a file there. Returns the snapshot of the live parts (to be saved
        before training goes on)."""
        snapshot = self.snapshot()
        if self.spill is None:
            kept = copy.deepcopy(snapshot)
        else:
            path = self.spill / f"snapshot-{self._written}.pt"
            self._written += 1
            save_state(path, self.identity, snapshot)
            kept = {"step": snapshot["step"], SPILLED: path}
        if len(self.kept) == self.kept.maxlen:
            _forget(self.kept[0])
        self.kept.append(kept)
        return snapshot

    def accept(self, loss: float) -> None:
        """Count a step that ended with the (not diverged) ``loss``."""
        self.step += 1
        self.losses.append(loss)

    def diverged(self, loss: float) -> bool:
        """Whether ``loss`` is non-finite or (with an ``explode_factor``) explodes: against the
        recent losses, and from the first step on against the first held-out score."""
        if not math.isfinite(loss):
            return True
        if self.explode_factor is None:
            return False
        if self.scores and loss > self.explode_factor * self.scores[0][1]:
            return True
        return exploded(loss, self.losses, self.explode_factor)

    def watch(self, score: float) -> bool:
        """Record the held-out ``score`` of the current state: the best so far is kept; False
        when it rose above the best by more than :data:`RISE_TOLERANCE` (then
        :meth:`roll_back` with ``to_best``)."""
        self.scores.append([self.step, score])
        if self.best is None or score < self.best["score"]:
            self.best = copy.deepcopy({**self._progress(), "score": score})
            return True
        return score <= self.best["score"] * (1 + RISE_TOLERANCE)

    def settle(self) -> int | None:
        """At the end of a watched run: the last state, if it was scored within
        :data:`SETTLE_TOLERANCE` of the best, else the loop's parts back to the best state's
        (progress and records stay the run's); the step of the state kept, None for a run
        that was not watched."""
        if self.best is None:
            return None
        last_step, last_score = self.scores[-1]
        if not self.stopped and last_step == self.step:
            if last_score <= self.best["score"] * (1 + SETTLE_TOLERANCE):
                return self.step
        self.apply(self.best)
        return self.best["step"]

    def roll_back(self, step: int, loss: float, to_best: bool = False) -> None:
        """Back to the last kept snapshot (one further back if that one failed already), or
        to the best state (``to_best``), with half the learning rate. After too many tries a
        watched run stops at its best state (:attr:`stopped`); any other fails with a
        one-line error."""
        if self.rollbacks and self.rollbacks[-1]["back_to"] == self.kept[-1]["step"]:
            if len(self.kept) > 1:
                _forget(self.kept.pop())
        saved = self.best if to_best else _read(self.kept[-1])
        record = {"step": step, "loss": loss, "back_to": saved["step"]}
        if to_best:
            record["held_out"] = True
        rollbacks = [*self.rollbacks, record]
        if len(rollbacks) > self.max_rollbacks:
            if self.best is not None:
                self.rollbacks, self.stopped = rollbacks, True
                return
            raise LmcError(
                f"{self.what} diverged {len(rollbacks)} times (loss {loss:.3g} at step {step}) "
                f"even after lowering the learning rate to {self.lr_scale * self.lr:.2e}; "
                f"{self.fix}"
            )
        scale = self.lr_scale * 0.5
        self.restore(saved)
        self.rollbacks, self.lr_scale = rollbacks, scale

    def forget_kept(self) -> None:
        """Drop every kept snapshot (their files too): at the end of a run."""
        while self.kept:
            _forget(self.kept.pop())

    def save(self, path: Path, identity, snapshot: dict) -> None:
        """Write ``snapshot`` as the resumable checkpoint of the run ``identity`` (a link to
        its spilled file where it is the newest kept one)."""
        newest = self.kept[-1] if self.kept else {}
        if SPILLED in newest and newest["step"] == snapshot["step"] and identity == self.identity:
            link_state(Path(newest[SPILLED]), path)
        else:
            save_state(path, identity, snapshot)

    def load(self, path: Path | None, identity, processes: Processes | None = None) -> int | None:
        """Resume from the checkpoint at ``path`` if the run ``identity`` wrote it; the step
        resumed from, or None. Under several ``processes`` the main one (the one that writes
        checkpoints) reads it and every process resumes from what it read."""
        self.identity = identity
        # None also when the settings changed.
        saved = (processes or Processes()).from_main(lambda: load_state(path, identity))
        if saved is None:
            return None
        self.restore(saved)
        return self.step


def _read(kept: dict) -> dict:
    """A kept snapshot, read back from its file where it was spilled."""
    if SPILLED not in kept:
        return kept
    return torch.load(kept[SPILLED], map_location="cpu", weights_only=False)


def _forget(kept: dict) -> None:
    """Remove a kept snapshot's file, if it has one."""
    if SPILLED in kept:
        Path(kept[SPILLED]).unlink(missing_ok=True)
