"""Combining tensors in latent space: weighted means, posterior averages, and the closed-form
optimal-transport map that moves one Gaussian latent distribution onto another."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.codec import EncodedTensor


def weighted_latents(latents: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """``Σ w_i z_i / Σ w_i`` of same-shaped latents (a homogeneous merge)."""
    if len(latents) != len(weights) or not latents:
        raise LmcError("give one weight per model to merge")
    if any(z.shape != latents[0].shape for z in latents):
        shapes = ", ".join(str(tuple(z.shape)) for z in latents)
        raise LmcError(f"latents of different shapes ({shapes}) cannot be averaged")
    total = sum(weights)
    if total == 0:
        raise LmcError("the merge weights sum to zero")
    return sum(w * z for w, z in zip(weights, latents, strict=True)) / total


def posterior_average(encoded: EncodedTensor, samples: int, generator: torch.Generator):
    """The mean of ``samples`` draws from a tensor's posterior (a self-merge)."""
    if samples < 1:
        raise LmcError(f"a self-merge needs at least one sample, not {samples}")
    return sum(encoded.sample(generator) for _ in range(samples)) / samples


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
