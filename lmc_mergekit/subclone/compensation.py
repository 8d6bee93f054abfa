"""Closed-form least-squares compensation: refitting a projection to what the donor wrote.

For features ``X`` (what the smaller model's projection reads) and targets ``Y`` (what the
donor's layers added to the kept residual channels), the refit is the ridge solution
``W = (Y Xᵀ + λW₀)(X Xᵀ + λI)⁻¹`` with ``λ = strength · mean(diag(X Xᵀ))``: the paper's ridge,
shrunk towards the selected weights ``W₀`` instead of towards zero (on our donors the two agree
to three decimals of test loss; where the selection is already exact, this one stays exact).
It is solved in float64 from Gram matrices accumulated batch by batch (each batch's products
in float32), so memory grows with the number of features, not of tokens. A constant feature
fits a bias where the architecture has one; it is not shrunk.

The strength is chosen from the data by default (:func:`held_out_ridge`): the fit is solved on
most calibration batches at each strength of :data:`RIDGE_GRID`, scored on the batches held out,
and the best strength (or the selected weights themselves, where no refit does better on text
it was not fitted to) is solved again on every batch. A fit with more features than its tokens
support, the ill-conditioned solve of a large width ratio, is thereby shrunk towards the
selection instead of over-correcting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmc_mergekit.errors import LmcError

#: Strengths (relative to the mean feature energy) a held-out choice tries.
RIDGE_GRID = (1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)
#: What a held-out choice records when no refit beats the selected weights.
SELECTION = "selection"


@dataclass(frozen=True)
class RidgeSolution:
    """The refit projection ``(outputs, features)``, its bias (if fitted), and the relative
    squared error ``‖Y − XWᵀ − b‖² / ‖Y − mean(Y)‖²`` of the given weights and of the refit."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    error_before: float
    error_after: float


class RidgeFit:
    """Accumulates ``XᵀX``, ``XᵀY`` and ``YᵀY`` over batches of rows, then solves."""

    def __init__(self, features: int, outputs: int, bias: bool, device: torch.device):
        self.bias = bias
        width = features + int(bias)
        self.gram = torch.zeros(width, width, dtype=torch.float64, device=device)
        self.cross = torch.zeros(width, outputs, dtype=torch.float64, device=device)
        self.energy = torch.zeros((), dtype=torch.float64, device=device)
        self.total = torch.zeros(outputs, dtype=torch.float64, device=device)
        self.rows = 0

    def add(self, features: torch.Tensor, targets: torch.Tensor) -> None:
        """Add rows: ``features`` ``(..., features)``, ``targets`` ``(..., outputs)``. The
        products of a batch are taken in float32 (a few times faster than float64, and
        exact to float32 over a batch's rows) and summed in float64."""
        x = features.reshape(-1, features.shape[-1]).float()
        y = targets.reshape(-1, targets.shape[-1]).float()
        if self.bias:
            x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        self.gram += (x.T @ x).to(self.gram)
        self.cross += (x.T @ y).to(self.gram)
        wide = y.to(self.gram)
        self.energy += (wide * wide).sum()
        self.total += wide.sum(0)
        self.rows += x.shape[0]

    def solve(
        self, strength: float, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> RidgeSolution:
        """The ridge refit, scored against the current ``weight`` (and ``bias``)."""
        current = self.stacked(weight, bias)
        solution = self.coefficients(strength, current)
        width = self.gram.shape[0] - int(self.bias)
        return RidgeSolution(
            weight=solution[:width].T,
            bias=solution[width] if self.bias else None,
            error_before=self.relative_error(current),
            error_after=self.relative_error(solution),
        )

    def stacked(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``weight`` ``(outputs, features)`` (and ``bias``) as coefficients ``(width,
        outputs)``: the layout :meth:`coefficients` solves for."""
        current = weight.T.to(self.gram)
        if self.bias:
            start = torch.zeros(1, current.shape[1]) if bias is None else bias[None]
            current = torch.cat([current, start.to(self.gram)])
        return current

    def coefficients(self, strength: float, current: torch.Tensor) -> torch.Tensor:
        """The ridge solution at ``strength``, pulled towards the coefficients ``current``."""
        width = self.gram.shape[0] - int(self.bias)
        if self.rows < self.gram.shape[0]:
            raise LmcError(
                f"compensation fits {self.gram.shape[0]} features from {self.rows} calibration "
                "tokens; give more calibration text"
            )
        shrink = strength * self.gram.diagonal()[:width].mean().clamp_min(1e-12)
        regular = self.gram.clone()
        regular.diagonal()[:width] += shrink
        # The ridge pulls towards the selected weights rather than towards zero, so a
        # projection the selection left exact stays exact.
        pull = torch.zeros_like(current)
        pull[:width] = shrink * current[:width]
        return torch.linalg.solve(regular, self.cross + pull)  # (width, outputs)

    def absorb(self, other: RidgeFit) -> None:
        """Add the rows ``other`` accumulated (its batches become this fit's)."""
        self.gram += other.gram
        self.cross += other.cross
        self.energy += other.energy
        self.total += other.total
        self.rows += other.rows

    def error(self, solution: RidgeSolution) -> float:
        """The relative squared error of ``solution`` on this fit's rows."""
        return self.relative_error(self.stacked(solution.weight, solution.bias))

    def relative_error(self, coef: torch.Tensor) -> float:
        """``‖Y − X·coef‖² / ‖Y − mean(Y)‖²`` on this fit's rows."""
        centred = (self.energy - (self.total**2).sum() / max(self.rows, 1)).clamp_min(1e-30)
        return float(self._residual(coef) / centred)

    def _residual(self, coef: torch.Tensor) -> torch.Tensor:
        """``‖Y − X·coef‖²`` from the accumulated Gram matrices."""
        return self.energy - 2 * (coef * self.cross).sum() + (coef * (self.gram @ coef)).sum()


def held_out_ridge(
    fit: RidgeFit, held: RidgeFit, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[float | str, dict[str, float]]:
    """The strength of :data:`RIDGE_GRID` whose fit on ``fit``'s rows has the least error on
    ``held``'s, or :data:`SELECTION` where the selected ``weight`` (``bias``) does better than
    every refit; with the held-out error of each candidate (keyed by strength)."""
    current = fit.stacked(weight, bias)
    errors = {SELECTION: held.relative_error(current)}
    for strength in RIDGE_GRID:  # solved only: scored on the held-out rows alone
        errors[f"{strength:g}"] = held.relative_error(fit.coefficients(strength, current))
    best = min(errors, key=errors.get)
    return (best if best == SELECTION else float(best)), {k: round(v, 6) for k, v in errors.items()}
