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
from lmc_mergekit.latent.chunks import SLICE, Normalisation
from lmc_mergekit.latent.codec import decode_latents
from lmc_mergekit.latent.merging import posterior_average, weighted_average
from lmc_mergekit.latent.store import open_store
from lmc_mergekit.models.layout import KeyLayout, part_count, part_layout


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
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``key`` of the merge of the prepared ``folders``: each model's posterior mean (or the
    mean of ``samples`` posterior draws), their weighted average, decoded; with ``residuals``,
    plus the weighted average of the inputs' reconstruction residuals (over the inputs that
    have one), so that where the merge leaves a model unchanged its weights come back exactly.
    The decode (float32) and the residuals are summed in float64 and rounded once to
    ``dtype``; the residuals are read and added a slice of rows at a time."""
    stores = [open_store(folder) for folder in folders]
    autoencoders = {store.autoencoder for store in stores}
    if len(autoencoders) > 1:
        raise LmcError("ls_merge inputs were encoded by different autoencoders; re-run the recipe")
    autoencoder = autoencoder_at(str(autoencoders.pop()), str(device))
    merged = decode_key(
        autoencoder,
        prepared_layout(folders[0])[key],
        *_averaged_latents(stores, key, weights, normalize, samples, seed),
    )
    with_residual = [(store, w) for store, w in zip(stores, weights, strict=True)]
    with_residual = [(store, w) for store, w in with_residual if store.has_residual(key)]
    # All weight on transported sources: there is no residual to add.
    if not residuals or not with_residual or sum(w for _, w in with_residual) == 0:
        return merged.to(dtype)
    out = torch.empty(merged.shape, dtype=dtype)
    step = max(1, SLICE // max(1, merged[0].numel()))
    for start in range(0, len(merged), step):
        stop = start + step
        found = [store.residual_rows(key, start, stop) for store, _ in with_residual]
        average = weighted_average(found, [w for _, w in with_residual], normalize)
        out[start:stop] = (merged[start:stop] + average).to(dtype)
    return out


def _averaged_latents(stores, key, weights, normalize, samples, seed):
    """The weighted average of the inputs' posterior means (or draws) of ``key``, and of their
    normalisations; each input's stored latents are let go once its draw is made."""
    draws, stats = [], []
    for index, store in enumerate(stores):
        if samples:
            (mean, log_var), normalisations = store.get(key)
        else:  # the posterior means alone: the log-variances are not read
            (mean, normalisations), log_var = store.means(key), None
        draws.append(posterior_average(mean, log_var, samples, _generator(seed, key, index)))
        stats.append(normalisations)
        del mean, log_var
    return weighted_average(draws, weights, normalize), weighted_average(stats, weights, normalize)


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
