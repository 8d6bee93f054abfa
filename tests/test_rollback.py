"""Rollback on divergence, the one mechanism of every training loop: what counts as diverging
(against the recent losses, not the first step's), and the weight autoencoder's training
rolling back a non-finite loss and finishing with finite weights."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tiny_models import build_model
from torch.nn.modules.module import register_module_forward_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.chunks import model_tensors
from lmc_mergekit.latent.training import TrainingConfig, autoencoder_config_for, train_autoencoder
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.runtime.resumable import load_state
from lmc_mergekit.runtime.rollback import EXPLODE_FACTOR, KEPT_SNAPSHOTS, SPILLED, TrainingState


class _Weights(TrainingState):
    """A training state whose only part is one tensor."""

    def __init__(self, explode_factor: float | None = EXPLODE_FACTOR, spill: Path | None = None):
        super().__init__("toy training", 0.1, 3, "set a smaller lr", explode_factor, spill)
        self.weight = torch.zeros(3)

    def capture(self) -> dict:
        return {"weight": self.weight}  # live, trained in place: keep() copies or writes it

    def apply(self, parts: dict) -> None:
        self.weight = parts["weight"].clone()


def test_a_mid_path_loss_after_an_endpoint_draw_is_no_explosion():
    """Learned matching draws λ every step: a first step near an endpoint has a small loss, and
    the mid-path losses after it are several times larger without anything going wrong. The
    first-step rule (2× the first loss) fired on every one of them; the running one does not,
    and still fires on a true explosion."""
    state = _Weights()
    endpoint, mid_path = 1.0, 3.0
    assert mid_path > EXPLODE_FACTOR * endpoint  # what the first-step rule called exploding
    for loss in [endpoint, mid_path, 1.4, mid_path, 2.2, 1.1, mid_path, 2.8]:
        assert not state.diverged(loss)
        state.accept(loss)
    assert state.diverged(30.0)  # ten times the largest recent loss
    assert state.diverged(math.nan) and state.diverged(math.inf)
    # Losses that fall as training goes on lower the reference with them.
    for _ in range(20):
        state.accept(0.5)
    assert state.diverged(2.9) and not state.diverged(0.9)


def test_only_non_finite_losses_diverge_without_an_explode_factor():
    state = _Weights(explode_factor=None)
    for _ in range(10):
        state.accept(0.01)
    assert not state.diverged(100.0) and state.diverged(math.nan)


@pytest.mark.parametrize("spilled", [False, True], ids=["in memory", "on disk"])
def test_a_rollback_restores_the_last_snapshot_with_half_the_rate_and_stops_in_the_end(
    tmp_path, spilled
):
    state = _Weights(spill=tmp_path if spilled else None)
    state.keep()  # step 0
    state.weight += 1
    state.accept(1.0)
    state.keep()  # step 1
    state.weight += 1
    state.accept(1.0)
    if spilled:  # the snapshots are files; memory holds their steps only
        assert len(list(tmp_path.iterdir())) == 2
        assert all(set(kept) == {"step", SPILLED} for kept in state.kept)
    state.roll_back(2, math.nan)
    assert state.step == 1 and torch.equal(state.weight, torch.ones(3))
    assert state.lr_scale == 0.5 and len(state.rollbacks) == 1
    assert state.rollbacks[0]["step"] == 2 and state.rollbacks[0]["back_to"] == 1
    # Failing again from the same snapshot goes one further back.
    state.roll_back(1, math.nan)
    assert state.step == 0 and torch.equal(state.weight, torch.zeros(3))
    assert state.lr_scale == 0.25 and [r["back_to"] for r in state.rollbacks] == [1, 0]
    state.roll_back(0, math.inf)
    with pytest.raises(LmcError, match=r"toy training diverged 4 times .* set a smaller lr"):
        state.roll_back(0, math.inf)
    state.forget_kept()
    assert not any(tmp_path.iterdir())


def test_spilled_snapshots_beyond_the_kept_ones_leave_the_disk(tmp_path):
    state = _Weights(spill=tmp_path)
    for _ in range(KEPT_SNAPSHOTS + 3):
        state.keep()
        state.weight += 1
        state.accept(1.0)
    assert len(list(tmp_path.iterdir())) == KEPT_SNAPSHOTS
    state.roll_back(state.step, math.nan)
    assert torch.equal(state.weight, torch.full((3,), float(KEPT_SNAPSHOTS + 2)))
    # The resumable checkpoint is the newest spilled snapshot, linked, not written again.
    checkpoint = tmp_path.parent / "state.pt"
    state.save(checkpoint, None, state.keep())
    assert checkpoint.stat().st_ino == Path(state.kept[-1][SPILLED]).stat().st_ino
    assert load_state(checkpoint, None)["step"] == state.step


def test_a_held_out_rise_goes_back_to_the_best_state_and_the_end_keeps_it():
    state = _Weights()
    assert state.watch(5.0)  # the start
    state.keep()
    for score in (4.0, 4.5):  # 4.5 is more than a tenth above the best
        state.weight += 1
        state.accept(1.0)
        state.keep()
        assert state.watch(score) is (score == 4.0)
    assert state.best["step"] == 1 and state.best["score"] == 4.0
    state.roll_back(2, 4.5, to_best=True)
    assert state.step == 1 and torch.equal(state.weight, torch.ones(3))
    assert state.lr_scale == 0.5 and state.rollbacks[-1]["held_out"]
    state.weight += 1
    state.accept(1.0)
    assert state.settle() == 1 and torch.equal(state.weight, torch.ones(3))


def test_a_loss_far_above_the_start_score_explodes_from_the_first_step():
    state = _Weights()
    state.watch(4.0)
    assert state.diverged(8.5) and not state.diverged(7.5)


def test_a_watched_run_whose_rollbacks_run_out_stops_at_its_best_instead_of_failing():
    state = _Weights()
    state.watch(5.0)
    state.keep()
    for _ in range(state.max_rollbacks):
        state.roll_back(0, math.nan)
    assert not state.stopped
    state.roll_back(0, math.nan)
    assert state.stopped and state.settle() == 0


class _PoisonedForward:
    """Makes the first module output after the ``at``-th optimiser step NaN, through torch's
    global hooks (no part of the code under test is replaced)."""

    def __init__(self, at: int | None):
        self.at, self.steps, self.fired = at, 0, 0

    def __enter__(self):
        self.handles = [
            register_optimizer_step_post_hook(self._stepped),
            register_module_forward_hook(self._forward),
        ]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def _stepped(self, optimizer, args, kwargs) -> None:
        self.steps += 1

    def _forward(self, module, args, output):
        armed = self.at is None or (self.steps == self.at and not self.fired)
        if armed and isinstance(module, torch.nn.Linear):
            self.fired += 1
            return output * math.nan
        return None


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    named = model_tensors(open_model(build_model("llama", tmp_path_factory.mktemp("m"))))
    return named, autoencoder_config_for(named, width=16, depth=1)


def test_autoencoder_training_rolls_back_a_non_finite_loss(weights):
    named, config = weights
    training = TrainingConfig(steps=40, batch_size=4)
    with _PoisonedForward(at=25) as poison:
        model, record = train_autoencoder(
            named, config, training, progress=False, checkpoint_every=10
        )
    assert poison.fired == 1
    # The poisoned step went back to the snapshot of step 20 and the run went on to the end:
    # 25 steps, then steps 20-39 again.
    assert record["rollbacks"] == [{"step": 25, "loss": "nan", "back_to": 20}]
    assert poison.steps == 25 + 20 and math.isfinite(record["final_huber"])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    clean, _ = train_autoencoder(named, config, training, progress=False, checkpoint_every=10)
    # From step 20 on it trained at half the rate, so it ends elsewhere than a clean run.
    assert not torch.equal(model.chunk_out.weight, clean.chunk_out.weight)


def test_autoencoder_training_that_keeps_diverging_stops_with_a_clear_error(weights):
    named, config = weights
    with (
        _PoisonedForward(at=None),
        pytest.raises(LmcError, match=r"autoencoder training diverged 4 times .* latent lr"),
    ):
        train_autoencoder(named, config, TrainingConfig(steps=10, batch_size=4), progress=False)
