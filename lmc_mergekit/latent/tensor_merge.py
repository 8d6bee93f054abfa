"""One checkpoint tensor merged in latent space and decoded: what the ``ls_merge`` method
computes for each tensor inside mergekit's executor (and the pre-merge pass for each input's
plain encode–decode)."""

from __future__ import annotations

import zlib
from functools import cache
from pathlib import Path

import torch

from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.autoencoder import WeightAutoencoder, load_autoencoder
from lmc_mergekit.latent.chunks import Normalisation
from lmc_mergekit.latent.codec import decode_latents
from lmc_mergekit.latent.store import open_store
from lmc_mergekit.models.layout import KeyLayout, checkpoint_layout


def decode_key(
    autoencoder: WeightAutoencoder, layout: KeyLayout, latents: torch.Tensor, stats: torch.Tensor
) -> torch.Tensor:
    """The checkpoint tensor of ``layout`` decoded from its pieces' latents ``(chunks,
    latent)`` and normalisations ``(pieces, 2)``."""
    flats, start = [], 0
    size = autoencoder.config.chunk_size
    for piece, (mean, std) in zip(layout.pieces, stats.tolist(), strict=True):
        count = -(-piece.numel // size)
        rows = latents[start : start + count]
        start += count
        norm = Normalisation(piece.shape, mean, std)
        flats.append(decode_latents(autoencoder, piece.kind, piece.layer, rows, norm))
    if start != latents.shape[0]:
        raise LmcError("the latents do not fit the checkpoint layout; re-run the pre-merge pass")
    return layout.assemble(flats)


def merge_key(
    key: str,
    folders: list[str],
    weights: list[float],
    normalize: bool,
    samples: int,
    seed: int,
    residuals: bool,
    device: torch.device,
) -> torch.Tensor:
    """``key`` of the merge of the prepared ``folders``: each model's posterior mean (or the
    mean of ``samples`` posterior draws), their weighted average, decoded; with ``residuals``,
    plus the weighted average of the inputs' reconstruction residuals (over the inputs that
    have one), so that where the merge leaves a model unchanged its weights come back exactly."""
    stores = [open_store(folder) for folder in folders]
    autoencoders = {store.autoencoder for store in stores}
    if len(autoencoders) > 1:
        raise LmcError("ls_merge inputs were encoded by different autoencoders; re-run the recipe")
    total = sum(weights) if normalize else 1.0
    if total == 0:
        raise LmcError(f"the ls_merge weights of {key!r} sum to zero")
    merged_latents, merged_stats = 0.0, 0.0
    for index, (store, weight) in enumerate(zip(stores, weights, strict=True)):
        latents, stats = store.get(key)
        merged_latents = merged_latents + weight / total * _draw(latents, samples, seed, key, index)
        merged_stats = merged_stats + weight / total * stats
    autoencoder = autoencoder_at(str(autoencoders.pop()), str(device))
    layout = prepared_layout(folders[0])[key]
    merged = decode_key(autoencoder, layout, merged_latents, merged_stats)
    if residuals:
        merged = merged + _residual(key, stores, weights, normalize)
    return merged


def _residual(key: str, stores, weights: list[float], normalize: bool) -> torch.Tensor:
    """The weighted average of the inputs' reconstruction residuals of ``key``."""
    found = [(store.residual(key), w) for store, w in zip(stores, weights, strict=True)]
    found = [(residual.double(), w) for residual, w in found if residual is not None]
    total = sum(w for _, w in found) if normalize else 1.0
    if total == 0:  # all weight on transported sources: nothing to correct with
        return torch.zeros(())
    return sum(w / total * residual for residual, w in found)


def _draw(latents: torch.Tensor, samples: int, seed: int, key: str, index: int) -> torch.Tensor:
    """The posterior mean (``samples`` 0) or the mean of ``samples`` posterior draws."""
    mean, log_var = latents[0].double(), latents[1].double()
    if samples == 0:
        return mean
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()) + index)
    noise = torch.randn((samples, *mean.shape), generator=generator, dtype=torch.float64)
    return mean + noise.mean(0) * (0.5 * log_var).exp()


@cache
def prepared_layout(folder: str) -> dict[str, KeyLayout]:
    """The checkpoint layout of a prepared folder (cached: mergekit asks once per tensor)."""
    from lmc_mergekit.models.adapters import open_model

    view = open_model(Path(folder))
    return checkpoint_layout(view.adapter, view)


@cache
def autoencoder_at(path: str, device: str) -> WeightAutoencoder:
    """The autoencoder file ``path`` loaded on ``device`` (cached per process)."""
    if not Path(path).is_file():
        raise LmcError(f"the autoencoder {path} that encoded the inputs is gone; re-run the recipe")
    return load_autoencoder(Path(path), device)
