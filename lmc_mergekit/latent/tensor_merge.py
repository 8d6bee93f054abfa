"""One checkpoint tensor merged in latent space and decoded: what the ``ls_merge`` method
computes for each tensor inside mergekit's executor (the pre-merge pass decodes what it wrote
the same way to check it)."""

from __future__ import annotations

import zlib
from functools import cache
from pathlib import Path

import torch

from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.autoencoder import WeightAutoencoder, load_autoencoder
from lmc_mergekit.latent.chunks import Normalisation
from lmc_mergekit.latent.codec import decode_latents
from lmc_mergekit.latent.merging import posterior_average, weighted_average
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
    latents, stats = zip(*(store.get(key) for store in stores), strict=True)
    draws = [
        posterior_average(z[0], z[1], samples, _generator(seed, key, index))
        for index, z in enumerate(latents)
    ]
    autoencoder = autoencoder_at(str(autoencoders.pop()), str(device))
    merged = decode_key(
        autoencoder,
        prepared_layout(folders[0])[key],
        weighted_average(draws, weights, normalize),
        weighted_average(list(stats), weights, normalize),
    )
    if residuals:
        found = [(store.residual(key), w) for store, w in zip(stores, weights, strict=True)]
        found = [(residual, w) for residual, w in found if residual is not None]
        # All weight on transported sources: there is no residual to add.
        if found and sum(w for _, w in found) != 0:
            residual, weight = zip(*found, strict=True)
            merged = merged + weighted_average(list(residual), list(weight), normalize)
    return merged


def _generator(seed: int, key: str, index: int) -> torch.Generator:
    """One seeded stream per recipe seed, tensor and input."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()) + index)


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
