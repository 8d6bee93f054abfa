"""Encoding one tensor into latents and decoding latents back into a tensor."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lmc_mergekit.latent.autoencoder import WeightAutoencoder, Windows
from lmc_mergekit.latent.chunks import (
    SLICE,
    NamedTensor,
    Normalisation,
    chunk_count,
    from_chunks,
    moments,
    normalised_chunks,
)

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
    """The posterior of every chunk of ``named`` (on the CPU). The chunks are cut and
    normalised a batch of windows at a time: a whole embedding is never copied."""
    size, latent = model.config.chunk_size, model.config.latent_dim
    norm = Normalisation(tuple(named.tensor.shape), *moments(named.tensor))
    count = chunk_count(norm.numel, size)
    mean, log_var = torch.empty(count, latent), torch.empty(count, latent)
    for rows in _batch_rows(model, count):
        chunks = normalised_chunks(named.tensor, norm, size, rows.start, rows.stop)
        windows = _windows(model, chunks, rows)
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


def decode_latents(
    model: WeightAutoencoder, kind: str, layer: int, latents: torch.Tensor, norm: Normalisation
) -> torch.Tensor:
    """The tensor of ``kind`` and ``layer`` decoded from per-chunk ``latents`` ``(n, latent)``
    and rescaled by ``norm`` (in float64, rounded once), float32 on the CPU."""
    flat = torch.empty(norm.numel)
    for start, values in decoded_slices(model, kind, layer, latents, norm):
        flat[start : start + len(values)] = values
    return flat.reshape(norm.shape)


@torch.no_grad()
def decoded_slices(
    model: WeightAutoencoder, kind: str, layer: int, latents: torch.Tensor, norm: Normalisation
) -> Iterator[tuple[int, torch.Tensor]]:
    """:func:`decode_latents`'s tensor as ``(start, values)``: its flat values from element
    ``start`` on, float32, one batch of windows at a time (what a consumer that writes or
    compares slices holds is a batch, not the tensor)."""
    size = model.config.chunk_size
    for rows in _batch_rows(model, len(latents)):
        windows = _windows(model, latents[rows].float(), rows)
        kinds, layers = model.tags(kind, layer, windows.chunks.shape[0])
        chunks = windows.flatten(model.decode(kinds, layers, windows.chunks, windows)).cpu()
        yield rows.start * size, from_chunks(chunks, norm, first=rows.start).reshape(-1)


def _batch_rows(model: WeightAutoencoder, count: int) -> Iterator[slice]:
    """The rows (chunks or latents) of a tensor of ``count`` chunks, :data:`WINDOW_BATCH`
    windows at a time. Windows are independent: a large tensor runs in batches, so that the
    autoencoder's activations and the padded windows stay a fixed size however large the
    tensor (the same as :meth:`Windows.of` of them all)."""
    step = WINDOW_BATCH * model.config.window
    for start in range(0, count, step):
        yield slice(start, min(start + step, count))


def _windows(model: WeightAutoencoder, rows: torch.Tensor, where: slice) -> Windows:
    """``rows`` ``(n, k)`` (chunks or latents), rows ``where`` of their tensor's, in windows
    on the autoencoder's device."""
    device = model.chunk_in.weight.device
    return Windows.of(rows.to(device), model.config.window, where.start)


class SliceDistance:
    """``‖a − b‖`` over aligned slices of two tensors, with ``‖a‖`` and ``‖b‖``, summed in
    float64 a slice at a time (no float64 copy of a whole embedding)."""

    def __init__(self) -> None:
        self._sums = torch.zeros(3, dtype=torch.float64)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """The next aligned slices of the two."""
        x, y = a.reshape(-1).double(), b.reshape(-1).double()
        self._sums += torch.stack([x.square().sum(), y.square().sum(), (x - y).square().sum()])

    @property
    def relative(self) -> float:
        """``‖a − b‖ / ‖a‖`` (0 for an all-zero ``a`` met by zeros)."""
        norm_a, _, gap = self._sums.sqrt().tolist()
        return gap / max(norm_a, 1e-30)

    @property
    def symmetric(self) -> float:
        """``‖a − b‖`` relative to the larger of the two (zero tensors stay comparable)."""
        norm_a, norm_b, gap = self._sums.sqrt().tolist()
        return gap / max(norm_a, norm_b, 1e-30)


def relative_error(original: torch.Tensor, decoded: torch.Tensor) -> float:
    """``‖decoded − original‖ / ‖original‖`` of two whole tensors."""
    distance = SliceDistance()
    a, b = original.reshape(-1), decoded.reshape(-1)
    for start in range(0, a.numel(), SLICE):
        distance.add(a[start : start + SLICE], b[start : start + SLICE])
    return distance.relative
