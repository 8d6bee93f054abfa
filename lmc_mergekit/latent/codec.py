"""Encoding one tensor into latents and decoding latents back into a tensor."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lmc_mergekit.latent.autoencoder import WeightAutoencoder, Windows
from lmc_mergekit.latent.chunks import SLICE, NamedTensor, Normalisation, from_chunks, to_chunks

#: Windows the autoencoder runs at once when encoding or decoding one tensor.
WINDOW_BATCH = 512


@dataclass(frozen=True)
class EncodedTensor:
    """A tensor in latent space: posterior mean and log-variance per chunk ``(n, latent)``,
    and what decoding needs to rebuild the tensor."""

    kind: str
    layer: int
    mean: torch.Tensor
    log_var: torch.Tensor
    norm: Normalisation


@torch.no_grad()
def encode_tensor(model: WeightAutoencoder, named: NamedTensor) -> EncodedTensor:
    """The posterior of every chunk of ``named`` (on the CPU)."""
    chunks, norm = to_chunks(named.tensor, model.config.chunk_size)
    latent = model.config.latent_dim
    mean, log_var = torch.empty(len(chunks), latent), torch.empty(len(chunks), latent)
    for rows, windows in _window_batches(model, chunks):
        kinds, layers = model.tags(named.kind, named.layer, windows.chunks.shape[0])
        posterior = model.encode(kinds, layers, windows)
        mean[rows], log_var[rows] = (windows.flatten(t).cpu() for t in posterior)
    return EncodedTensor(named.kind, named.layer, mean, log_var, norm)


def decode_tensor(
    model: WeightAutoencoder, encoded: EncodedTensor, latents: torch.Tensor | None = None
) -> torch.Tensor:
    """The tensor decoded from ``latents`` (default: the posterior mean), float32 on the CPU."""
    latents = encoded.mean if latents is None else latents
    return decode_latents(model, encoded.kind, encoded.layer, latents, encoded.norm)


@torch.no_grad()
def decode_latents(
    model: WeightAutoencoder, kind: str, layer: int, latents: torch.Tensor, norm: Normalisation
) -> torch.Tensor:
    """The tensor of ``kind`` and ``layer`` decoded from per-chunk ``latents`` ``(n, latent)``
    and rescaled by ``norm`` (in float64, rounded once), float32 on the CPU."""
    chunks = torch.empty(len(latents), model.config.chunk_size)
    for rows, windows in _window_batches(model, latents.float()):
        kinds, layers = model.tags(kind, layer, windows.chunks.shape[0])
        decoded = model.decode(kinds, layers, windows.chunks, windows)
        chunks[rows] = windows.flatten(decoded).cpu()
    return from_chunks(chunks, norm)


def _window_batches(model: WeightAutoencoder, rows: torch.Tensor) -> Iterator[tuple]:
    """``(rows, windows)``: ``rows`` ``(n, k)`` (chunks or latents) cut into windows
    :data:`WINDOW_BATCH` at a time, on the autoencoder's device. Windows are independent: a
    large tensor runs in batches, so that the autoencoder's activations and the padded windows
    stay a fixed size however large the tensor (the same as :meth:`Windows.of` of them all)."""
    device, window = model.chunk_in.weight.device, model.config.window
    step = WINDOW_BATCH * window
    for start in range(0, len(rows), step):
        part = rows[start : start + step]
        yield slice(start, start + len(part)), Windows.of(part.to(device), window, start)


def relative_error(original: torch.Tensor, decoded: torch.Tensor) -> float:
    """``‖decoded − original‖ / ‖original‖`` (0 for an all-zero original decoded as zero),
    summed in float64 a slice at a time (no float64 copy of a whole embedding)."""
    a, b = original.reshape(-1), decoded.reshape(-1)
    sums = torch.zeros(2, dtype=torch.float64)
    for start in range(0, a.numel(), SLICE):
        x, y = (t[start : start + SLICE].double() for t in (a, b))
        sums += torch.stack([x.square().sum(), (y - x).square().sum()])
    scale, gap = sums.sqrt().tolist()
    return gap / max(scale, 1e-30)
