"""Combining tensors in latent space: weighted means, posterior averages, and the closed-form
optimal-transport map that moves one Gaussian latent distribution onto another."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.chunks import SLICE


def weighted_average(
    values: list[torch.Tensor], weights: list[float], normalize: bool = True
) -> torch.Tensor:
    """``Σ w_i v_i / Σ w_i`` (``Σ w_i v_i`` without ``normalize``) of same-shaped tensors, in
    float64: latents, normalisations or residuals of the models of a merge."""
    if len(values) != len(weights) or not values:
        raise LmcError("give one weight per model to merge")
    if any(v.shape != values[0].shape for v in values):
        shapes = ", ".join(str(tuple(v.shape)) for v in values)
        raise LmcError(f"tensors of different shapes ({shapes}) cannot be averaged")
    total = sum(weights) if normalize else 1.0
    if total == 0:
        raise LmcError("the merge weights sum to zero; give some model a non-zero weight")
    return sum(w / total * v.double() for w, v in zip(weights, values, strict=True))


def posterior_average(
    mean: torch.Tensor, log_var: torch.Tensor, samples: int, generator: torch.Generator
) -> torch.Tensor:
    """The mean of ``samples`` draws from ``N(mean, exp(log_var))`` (a self-merge), in float64;
    ``samples`` 0 gives the posterior mean itself."""
    if samples < 0:
        raise LmcError(f"the number of posterior samples cannot be negative ({samples})")
    if samples == 0:
        return mean.double()
    # A slice of rows at a time, the draws summed one by one: a vocabulary's latents are not
    # held ``samples`` times over in float64 (0.6 GB at 4 samples of a 49k × 576 embedding).
    out = torch.empty(mean.shape, dtype=torch.float64)
    step = draw_rows(mean[0].numel())
    for start in range(0, len(mean), step):
        rows = slice(start, start + step)
        centre = mean[rows].double()
        noise = torch.zeros_like(centre)
        for _ in range(samples):
            noise += torch.randn(centre.shape, generator=generator, dtype=torch.float64)
        out[rows] = centre + noise / samples * (0.5 * log_var[rows].double()).exp()
    return out


def draw_rows(width: int) -> int:
    """The rows of latents ``width`` wide that :func:`posterior_average` draws at a time: a
    caller that hands it such slices in order gets the draws of the whole tensor."""
    return max(1, SLICE // max(1, width))


@dataclass(frozen=True)
class GaussianTransport:
    """The optimal-transport map ``z ↦ μ_t + A (z − μ_s)`` between two Gaussians."""

    source_mean: torch.Tensor
    target_mean: torch.Tensor
    matrix: torch.Tensor

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        moved = (latents.double() - self.source_mean) @ self.matrix.T + self.target_mean
        return moved.to(latents.dtype)


def gaussian_transport(
    source: torch.Tensor, target: torch.Tensor, shrinkage: float = 0.1
) -> GaussianTransport:
    """Fit Gaussians to the rows of ``source`` and ``target`` ``(n, k)`` and return the map
    ``A = Σs^-½ (Σs^½ Σt Σs^½)^½ Σs^-½`` between them. Covariances are shrunk towards
    ``tr(Σ)/k · I`` by ``shrinkage`` (sample covariances of latents are rank-deficient)."""
    if source.shape[1] != target.shape[1]:
        raise LmcError(
            f"latents of {source.shape[1]} and {target.shape[1]} dims need a projection to a "
            "common dimension first"
        )
    if not 0 <= shrinkage <= 1:
        raise LmcError(f"covariance shrinkage must lie in [0, 1], not {shrinkage}")
    mean_s, cov_s = _moments(source, shrinkage)
    mean_t, cov_t = _moments(target, shrinkage)
    root_s = _power(cov_s, 0.5)
    inverse_root_s = _power(cov_s, -0.5)
    middle = _power(root_s @ cov_t @ root_s, 0.5)
    return GaussianTransport(mean_s, mean_t, inverse_root_s @ middle @ inverse_root_s)


def _moments(rows: torch.Tensor, shrinkage: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows = rows.double()
    if rows.shape[0] < 2:
        raise LmcError("a latent distribution needs at least two chunks to fit a covariance")
    mean = rows.mean(0)
    centred = rows - mean
    cov = centred.T @ centred / (rows.shape[0] - 1)
    scale = cov.diagonal().mean().clamp_min(1e-12)
    eye = torch.eye(cov.shape[0], dtype=cov.dtype)
    return mean, (1 - shrinkage) * cov + shrinkage * scale * eye


def _power(matrix: torch.Tensor, exponent: float) -> torch.Tensor:
    """A symmetric positive semi-definite matrix to a real power (by its eigenbasis)."""
    values, vectors = torch.linalg.eigh((matrix + matrix.T) / 2)
    values = values.clamp_min(1e-12) ** exponent
    return (vectors * values) @ vectors.T
