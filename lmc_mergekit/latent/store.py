"""A prepared model's latents on disk, named after the output checkpoint's tensors.

``latents/`` in a prepared folder holds sharded safetensors with, for every checkpoint key,
the posterior mean and log-variance of the chunks of the canonical pieces that key is built
from (``(2, chunks, latent)``, pieces in layout order) and each piece's normalisation
(``(pieces, 2)``: mean, std); ``latents/autoencoder.json`` names the autoencoder that encoded
them. For inputs whose weights have the output's shape, ``latents/residuals/`` holds each
tensor's reconstruction residual (original − decoded). Both are written key by key while the
model is encoded (:class:`LatentWriter`), and the ``ls_merge`` method reads them key by key
inside mergekit's executor.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch

from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.codec import EncodedTensor
from lmc_mergekit.models.adapters.base import DEFAULT_SHARD_SIZE
from lmc_mergekit.models.checkpoint import CheckpointReader, ShardWriter, TensorSink

LATENT_FOLDER = Path("latents")
AUTOENCODER_NOTE = LATENT_FOLDER / "autoencoder.json"
RESIDUAL_FOLDER = LATENT_FOLDER / "residuals"
STATS_PREFIX = "normalisation::"
#: Shards of latents and residuals: written alongside the decoded checkpoint, so three writers
#: each hold a shard being filled; smaller ones keep that sum near one prepared shard.
SHARD_SIZE = DEFAULT_SHARD_SIZE // 4


class LatentWriter:
    """Writes the latents (and, with ``residuals``, the residuals) of a prepared folder."""

    def __init__(self, folder: Path, autoencoder: Path, residuals: bool):
        self._latents = ShardWriter(folder / LATENT_FOLDER, SHARD_SIZE)
        self._residuals = ShardWriter(folder / RESIDUAL_FOLDER, SHARD_SIZE) if residuals else None
        self._note = folder / AUTOENCODER_NOTE
        self._autoencoder = autoencoder

    def write(self, key: str, parts: list[EncodedTensor]) -> None:
        """The latents of ``key`` from its pieces' ``parts`` (layout order): every mean, then
        every log-variance, a piece at a time (no stacked copy of a whole embedding's)."""
        rows = sum(len(part.mean) for part in parts)
        shape = (2, rows, parts[0].mean.shape[1])
        with self._latents.sink(key, shape, torch.float32) as sink:
            for values in [part.mean for part in parts] + [part.log_var for part in parts]:
                sink.write(values)
        stats = [[part.norm.mean, part.norm.std] for part in parts]
        self._latents.write({STATS_PREFIX + key: torch.tensor(stats, dtype=torch.float64)})

    def residual_sink(self, key: str, shape: tuple[int, ...]) -> TensorSink:
        """A sink for the reconstruction residual of ``key`` (float32; a writer made with
        ``residuals``)."""
        if self._residuals is None:
            raise ValueError("this latent writer was made without residuals")
        return self._residuals.sink(key, shape, torch.float32)

    def close(self) -> None:
        """Flush both and name the autoencoder."""
        self._latents.close()
        if self._residuals is not None:
            self._residuals.close()
        self._note.write_text(json.dumps({"autoencoder": str(self._autoencoder)}))


class LatentStore:
    """Read access to the latents of one prepared folder."""

    def __init__(self, folder: Path):
        if not (folder / AUTOENCODER_NOTE).is_file():
            raise LmcError(
                f"{folder} holds no latents ({AUTOENCODER_NOTE}); run the recipe with "
                "lmc-mergekit-yaml so that ls_merge's pre-merge pass writes them"
            )
        note = json.loads((folder / AUTOENCODER_NOTE).read_text())
        self.autoencoder = Path(note["autoencoder"])
        self._latents = CheckpointReader(folder / LATENT_FOLDER)
        residuals = folder / RESIDUAL_FOLDER
        self._residuals = CheckpointReader(residuals) if residuals.is_dir() else None

    def has(self, key: str) -> bool:
        """Whether the folder holds latents of ``key`` (tensors outside the canonical view,
        such as a vision tower, have none)."""
        return self._latents.has(key)

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Posterior mean and log-variance ``(2, chunks, latent)`` and normalisations of
        ``key``."""
        return self.latent_rows(key, 0, self.latent_shape(key)[0], True), self.normalisations(key)

    def means(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Posterior means ``(chunks, latent)`` (the log-variances left unread) and
        normalisations of ``key``."""
        means = self.latent_rows(key, 0, self.latent_shape(key)[0], False)[0]
        return means, self.normalisations(key)

    def latent_shape(self, key: str) -> tuple[int, int]:
        """``(chunks, latent)``: how many chunks ``key`` has, and the latent width."""
        if not self._latents.has(key):
            raise LmcError(f"the prepared latents hold no tensor {key!r}")
        return self._latents.shape(key)[1:]

    def latent_rows(self, key: str, start: int, stop: int, log_var: bool) -> torch.Tensor:
        """The posterior means of chunks ``start:stop`` of ``key`` ``(1, rows, latent)``, and
        with ``log_var`` their log-variances too ``(2, rows, latent)`` (read alone)."""
        return self._latents.rows(key, start, stop, within=(slice(0, 2 if log_var else 1),))

    def normalisations(self, key: str) -> torch.Tensor:
        """The normalisation ``(pieces, 2)`` (mean, std) of each piece of ``key``."""
        return self._latents.get(STATS_PREFIX + key)

    def has_residual(self, key: str) -> bool:
        """Whether ``key`` has a reconstruction residual (a transported source has none)."""
        return self._residuals is not None and self._residuals.has(key)

    def residual_flat(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of ``key``'s reconstruction residual, flattened (read
        alone)."""
        return self._residuals.flat(key, start, stop)

    def residual(self, key: str) -> torch.Tensor | None:
        """The reconstruction residual of ``key`` (None for a transported source)."""
        if self._residuals is None:
            return None
        return self._residuals.get(key, optional=True)


@cache
def open_store(folder: str) -> LatentStore:
    """The (cached) latent store of the prepared folder ``folder``."""
    return LatentStore(Path(folder))
