"""Encoding one tensor into latents and decoding latents back into a tensor."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmc_mergekit.latent.autoencoder import WeightAutoencoder, Windows
from lmc_mergekit.latent.chunks import SLICE, NamedTensor, Normalisation, from_chunks, to_chunks

#: Windows the autoencoder runs at once when encoding or decoding one tensor.
WINDOW_BATCH = 2048


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
    """The posterior of every chunk of ``named``."""
    chunks, norm = to_chunks(named.tensor, model.config.chunk_size)
    device = model.chunk_in.weight.device
    windows = Windows.of(chunks.to(device), model.config.window)
    kinds, layers = model.tags(named.kind, named.layer, windows.chunks.shape[0])
    posteriors = [
        model.encode(kinds[part], layers[part], windows[part]) for part in _batches(windows)
    ]
    mean = torch.cat([mean for mean, _ in posteriors])
    log_var = torch.cat([log_var for _, log_var in posteriors])
    return EncodedTensor(
        named.kind, named.layer, windows.flatten(mean), windows.flatten(log_var), norm
    )


def decode_tensor(
    model: WeightAutoencoder, encoded: EncodedTensor, latents: torch.Tensor | None = None
) -> torch.Tensor:
    """The tensor decoded from ``latents`` (default: the posterior mean), float64 on the CPU."""
    latents = encoded.mean if latents is None else latents
    return decode_latents(model, encoded.kind, encoded.layer, latents, encoded.norm)


@torch.no_grad()
def decode_latents(
    model: WeightAutoencoder, kind: str, layer: int, latents: torch.Tensor, norm: Normalisation
) -> torch.Tensor:
    """The tensor of ``kind`` and ``layer`` decoded from per-chunk ``latents`` ``(n, latent)``
    and rescaled by ``norm``, float64 on the CPU."""
    device = model.chunk_in.weight.device
    windows = Windows.of(latents.float().to(device), model.config.window)
    kinds, layers = model.tags(kind, layer, windows.chunks.shape[0])
    chunks = windows.flatten(
        torch.cat(
            [
                model.decode(kinds[part], layers[part], windows.chunks[part], windows[part])
                for part in _batches(windows)
            ]
        )
    )
    del windows  # the padded latents: a large tensor's are not needed past this point
    return from_chunks(chunks.cpu(), norm)


def _batches(windows: Windows) -> list[slice]:
    """Windows are independent: a large tensor runs in batches of :data:`WINDOW_BATCH`, so that
    the autoencoder's activations stay a fixed size however large the tensor."""
    count = windows.chunks.shape[0]
    return [slice(start, start + WINDOW_BATCH) for start in range(0, count, WINDOW_BATCH)]


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
