"""One checkpoint tensor merged in latent space and decoded: what the ``ls_merge`` method
computes for each tensor inside mergekit's executor (the pre-merge pass decodes what it wrote
the same way to check it)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import torch

from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.autoencoder import WeightAutoencoder, load_autoencoder
from lmc_mergekit.latent.chunks import Normalisation, chunk_count
from lmc_mergekit.latent.codec import decode_latents, decoded_slices
from lmc_mergekit.latent.merging import draw_rows, posterior_average, weighted_average
from lmc_mergekit.latent.store import open_store
from lmc_mergekit.models.layout import KeyLayout, part_count, part_layout


def decode_key(
    autoencoder: WeightAutoencoder, layout: KeyLayout, latents: torch.Tensor, stats: torch.Tensor
) -> torch.Tensor:
    """The checkpoint tensor of ``layout`` decoded from its pieces' latents ``(chunks,
    latent)`` and normalisations ``(pieces, 2)``, float32."""
    flat = torch.empty(math.prod(layout.shape))
    for start, values in decoded_key_slices(autoencoder, layout, latents, stats):
        flat[start : start + len(values)] = values
    return flat.reshape(layout.shape)


def decoded_key_slices(
    autoencoder: WeightAutoencoder, layout: KeyLayout, latents: torch.Tensor, stats: torch.Tensor
) -> Iterator[tuple[int, torch.Tensor]]:
    """:func:`decode_key`'s tensor as ``(start, values)`` slices of its flat float32 values:
    a key that is one piece (an embedding, a head) a batch of windows at a time, a gathered
    key whole (its assembly needs every piece)."""
    pieces, start = [], 0
    size = autoencoder.config.chunk_size
    for piece, (mean, std) in zip(layout.pieces, stats.tolist(), strict=True):
        count = chunk_count(piece.numel, size)
        norm = Normalisation(piece.shape, mean, std)
        pieces.append((piece, latents[start : start + count], norm))
        start += count
    if start != latents.shape[0]:
        raise LmcError("the latents do not fit the checkpoint layout; re-run the pre-merge pass")
    if layout.index is None:
        piece, rows, norm = pieces[0]
        yield from decoded_slices(autoencoder, piece.kind, piece.layer, rows, norm)
        return
    flats = [decode_latents(autoencoder, p.kind, p.layer, rows, norm) for p, rows, norm in pieces]
    yield 0, layout.assemble(flats).reshape(-1)


def merge_key(
    key: str,
    folders: list[str],
    weights: list[float],
    normalize: bool,
    samples: int,
    seed: int,
    residuals: bool,
    device: torch.device,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``key`` of the merge of the prepared ``folders``: each model's posterior mean (or the
    mean of ``samples`` posterior draws), their weighted average, decoded; with ``residuals``,
    plus the weighted average of the inputs' reconstruction residuals (over the inputs that
    have one), so that where the merge leaves a model unchanged its weights come back exactly.
    The decode (float32) and the residuals are summed in float64 and rounded once to
    ``dtype``. The decode is made, and the residuals read and added, a slice at a time: what
    is held besides the output is the averaged latents."""
    stores = [open_store(folder) for folder in folders]
    autoencoders = {store.autoencoder for store in stores}
    if len(autoencoders) > 1:
        raise LmcError("ls_merge inputs were encoded by different autoencoders; re-run the recipe")
    autoencoder = autoencoder_at(str(autoencoders.pop()), str(device))
    layout = prepared_layout(folders[0])[key]
    latents, stats = _averaged_latents(stores, key, weights, normalize, samples, seed)
    with_residual = [(store, w) for store, w in zip(stores, weights, strict=True)]
    with_residual = [(store, w) for store, w in with_residual if store.has_residual(key)]
    # All weight on transported sources: there is no residual to add.
    if not residuals or sum(w for _, w in with_residual) == 0:
        with_residual = []
    out = torch.empty(layout.shape, dtype=dtype)
    flat = out.view(-1)
    for start, values in decoded_key_slices(autoencoder, layout, latents, stats):
        stop = start + len(values)
        if with_residual:
            found = [store.residual_flat(key, start, stop) for store, _ in with_residual]
            values = values + weighted_average(found, [w for _, w in with_residual], normalize)
        flat[start:stop] = values.to(dtype)
    return out


def _averaged_latents(stores, key, weights, normalize, samples, seed):
    """The weighted average of the inputs' posterior means (or draws) of ``key`` in float32
    (what the decoder takes: rounded once from the float64 average), and of their
    normalisations. Made a slice of rows at a time across the inputs (the slices
    :func:`posterior_average` draws in, each input with its own stream: the same draws as
    at once), so that no input's latents are held whole."""
    shapes = {store.latent_shape(key) for store in stores}
    if len(shapes) > 1:
        raise LmcError(f"the inputs' latents of {key!r} differ in shape; re-run the recipe")
    count, width = shapes.pop()
    out = torch.empty(count, width)
    generators = [_generator(seed, key, index) for index in range(len(stores))]
    step = draw_rows(width)
    for start in range(0, count, step):
        draws = []
        for store, generator in zip(stores, generators, strict=True):
            found = store.latent_rows(key, start, start + step, samples > 0)
            log_var = found[1] if samples else None
            draws.append(posterior_average(found[0], log_var, samples, generator))
        out[start : start + step] = weighted_average(draws, weights, normalize)
    stats = [store.normalisations(key) for store in stores]
    return out, weighted_average(stats, weights, normalize)


def _generator(seed: int, key: str, index: int) -> torch.Generator:
    """One seeded stream per recipe seed, tensor and input."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()) + index)


@cache
def prepared_layout(folder: str) -> PreparedLayout:
    """The checkpoint layout of a prepared folder (cached: mergekit asks once per tensor)."""
    return PreparedLayout(Path(folder))


class PreparedLayout:
    """The checkpoint layout of a prepared folder, one part at a time: the part each key
    belongs to is found once (each part read and laid out, then let go), and a key's layout
    comes from its part's, laid out again when asked for. The last part's layouts are kept:
    mergekit asks for a part's tensors one after another. So the merge holds one part's
    layouts (most keys need no index at all), never the whole model's."""

    def __init__(self, folder: Path):
        from lmc_mergekit.models.adapters import open_model

        self._view = open_model(folder)
        adapter = self._view.adapter
        self._part_of = {
            key: index
            for index in range(part_count(self._view))
            for key in part_layout(adapter, self._view, index).keys
        }
        self._last: tuple[int, dict[str, KeyLayout]] | None = None

    def __getitem__(self, key: str) -> KeyLayout:
        index = self._part_of.get(key)
        if index is None:
            raise LmcError(
                f"the prepared folder holds no tensor {key!r}; re-run the pre-merge pass"
            )
        if self._last is None or self._last[0] != index:
            self._last = (index, part_layout(self._view.adapter, self._view, index).keys)
        return self._last[1][key]


@cache
def autoencoder_at(path: str, device: str) -> WeightAutoencoder:
    """The autoencoder file ``path`` loaded on ``device`` (cached per process)."""
    if not Path(path).is_file():
        raise LmcError(f"the autoencoder {path} that encoded the inputs is gone; re-run the recipe")
    return load_autoencoder(Path(path), device)
