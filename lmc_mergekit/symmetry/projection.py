"""The (signed) permutation that best fits a matrix: what weight and activation matching
assign, and what the straight-through estimator of learned permutations projects onto."""

from __future__ import annotations

import torch
from scipy.optimize import linear_sum_assignment


def nearest_permutation(k: torch.Tensor, signed: bool = True) -> torch.Tensor:
    """The (signed) permutation ``R`` maximising ``tr(Rᵀ·K)``. Unsigned: the linear assignment
    maximising ``Σ K[i, π(i)]``. Signed: with ``R[i, π(i)] = s_i`` the objective is
    ``Σ s_i·K[i, π(i)]``, so ``π`` is the assignment maximising ``Σ |K[i, π(i)]|`` and ``s_i``
    the sign of what it picks."""
    k = k.double()
    rows, cols = linear_sum_assignment((k.abs() if signed else k).numpy(), maximize=True)
    rows, cols = torch.as_tensor(rows), torch.as_tensor(cols)
    r = torch.zeros_like(k)
    r[rows, cols] = torch.where(k[rows, cols] < 0, -1.0, 1.0).double() if signed else 1.0
    return r
