"""Weight tensors as sequences of fixed-size chunks, the tokens of the weight autoencoder.

Each tensor is flattened, normalised by its own mean and standard deviation (so one model of
the autoencoder serves tensors of very different scales, and the rare large weights stay large
in normalised units instead of being clipped), zero-padded to a whole number of chunks and cut
into ``(chunks, size)``. Every tensor is encoded and decoded on its own, named by its kind (the
canonical view's field name, e.g. ``attn.q``) and its layer, never by a checkpoint key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lmc_mergekit.models.layout import OUTSIDE_BLOCKS
from lmc_mergekit.models.view import ModelView, iter_tensors


@dataclass(frozen=True)
class NamedTensor:
    """One tensor of a model: its kind (canonical field name), layer and values."""

    kind: str
    layer: int
    tensor: torch.Tensor


@dataclass(frozen=True)
class Normalisation:
    """What turns chunks back into the tensor: its shape and the statistics it was scaled by."""

    shape: tuple[int, ...]
    mean: float
    std: float

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


#: Elements scaled at a time: the statistics need the whole tensor in float64, the scaling
#: (elementwise) does not, so no second float64 copy of a large tensor is made.
SLICE = 2**22


def moments(tensor: torch.Tensor) -> tuple[float, float]:
    """The mean and (sample) standard deviation of ``tensor``'s values in float64, a slice at a
    time (each slice's own, combined as Chan et al. do: no float64 copy of a whole embedding);
    a constant tensor's standard deviation is 1, so that a fresh norm gain stays
    representable."""
    flat = tensor.detach().reshape(-1)
    count, mean, squares = 0, 0.0, 0.0
    for start in range(0, flat.numel(), SLICE):
        piece = flat[start : start + SLICE].double()
        variance, piece_mean = torch.var_mean(piece, correction=0)
        n, m = piece.numel(), float(piece_mean)
        total = count + n
        squares += float(variance) * n + (m - mean) ** 2 * count * n / total
        mean += (m - mean) * n / total
        count = total
    std = math.sqrt(squares / (count - 1)) if count > 1 else 0.0
    return mean, std if std > 0 else 1.0


def chunk_count(numel: int, size: int) -> int:
    """How many chunks of ``size`` a tensor of ``numel`` elements is cut into (at least one)."""
    return max(1, math.ceil(numel / size))


def to_chunks(tensor: torch.Tensor, size: int) -> tuple[torch.Tensor, Normalisation]:
    """``tensor`` normalised and cut into float32 ``(ceil(numel / size), size)`` chunks."""
    norm = Normalisation(tuple(tensor.shape), *moments(tensor))
    return normalised_chunks(tensor, norm, size, 0, chunk_count(norm.numel, size)), norm


def normalised_chunks(
    tensor: torch.Tensor, norm: Normalisation, size: int, first: int, stop: int
) -> torch.Tensor:
    """Chunks ``first:stop`` of :func:`to_chunks`'s, float32 ``(stop - first, size)``, made
    from ``tensor`` alone (a run of a large tensor's chunks costs the run)."""
    source = tensor.detach().reshape(-1)[first * size : stop * size]
    padded = torch.zeros((stop - first) * size)
    for start in range(0, source.numel(), SLICE):
        piece = source[start : start + SLICE].double()
        padded[start : start + len(piece)] = ((piece - norm.mean) / norm.std).float()
    return padded.reshape(stop - first, size)


def from_chunks(
    chunks: torch.Tensor, norm: Normalisation, dtype: torch.dtype = torch.float32, first: int = 0
) -> torch.Tensor:
    """The values that :func:`to_chunks` cut into ``chunks`` (chunks ``first:`` of the
    tensor's), flat, padding dropped and scale restored, computed in float64 a slice at a time
    and rounded once to ``dtype`` (float32 by default: the autoencoder's own precision, and
    half the memory of a float64 embedding). All the chunks give the whole tensor's shape."""
    values = chunks.reshape(-1)
    begin = first * chunks.shape[-1]
    count = min(values.numel(), norm.numel - begin)
    flat = torch.empty(count, dtype=dtype)
    for start in range(0, count, SLICE):
        stop = min(start + SLICE, count)
        flat[start:stop] = (values[start:stop].double() * norm.std + norm.mean).to(dtype)
    return flat.reshape(norm.shape) if count == norm.numel else flat


def model_tensors(view: ModelView) -> list[NamedTensor]:
    """Every tensor of a model in canonical form, named by kind and layer."""
    named = [
        NamedTensor("embeddings." + name, OUTSIDE_BLOCKS, t)
        for name, t in iter_tensors(view.embeddings())
    ]
    for index in range(view.spec.num_layers):
        named += [NamedTensor(name, index, t) for name, t in iter_tensors(view.block(index))]
    named += [
        NamedTensor("head." + name, OUTSIDE_BLOCKS, t) for name, t in iter_tensors(view.head())
    ]
    return named
