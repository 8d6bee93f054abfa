"""Orthogonal Procrustes problems: the best rotation between two sets of corresponding rows.

Each solver takes the cross-correlation ``K = Σ X_Bᵀ·X_A`` of row sets that should satisfy
``X_B·R ≈ X_A`` and returns the ``R`` of its group maximising ``tr(Rᵀ·K)``, which minimises
``Σ ||X_B·R - X_A||²``.
"""

from __future__ import annotations

import torch

from lmc_mergekit.symmetry.group import Residual
from lmc_mergekit.symmetry.projection import nearest_permutation
from lmc_mergekit.symmetry.sampling import ones_complement_basis, ones_fixing_rotation


def orthogonal_procrustes(k: torch.Tensor) -> torch.Tensor:
    """The orthogonal ``R`` maximising ``tr(Rᵀ·K)``: ``U·Vᵀ`` from the SVD ``K = U·S·Vᵀ``."""
    u, _, vh = torch.linalg.svd(k.double())
    return u @ vh


def residual_procrustes(k: torch.Tensor, group: Residual) -> torch.Tensor:
    """The ``R`` of the residual ``group`` maximising ``tr(Rᵀ·K)``."""
    if group == "ones_fixing":
        return ones_fixing_procrustes(k)
    if group in ("signed_permutation", "permutation"):
        return nearest_permutation(k, signed=group == "signed_permutation")
    return orthogonal_procrustes(k)


def ones_fixing_procrustes(k: torch.Tensor) -> torch.Tensor:
    """Like :func:`orthogonal_procrustes`, restricted to rotations fixing the all-ones vector.

    With ``R = 11ᵀ/d + U·R'·Uᵀ`` the objective is ``const + tr(R'ᵀ·Uᵀ·K·U)``, an unconstrained
    Procrustes problem in ``d-1`` dimensions.
    """
    basis = ones_complement_basis(k.shape[0])
    return ones_fixing_rotation(orthogonal_procrustes(basis.T @ k.double() @ basis))
