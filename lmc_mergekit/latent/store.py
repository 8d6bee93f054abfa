"""A prepared model's latents on disk, named after the output checkpoint's tensors.

``latents/latents.safetensors`` in a prepared folder holds, for every checkpoint key, the
posterior mean and log-variance of the chunks of the canonical pieces that key is built from
(``(2, chunks, latent)``, pieces in layout order) and each piece's normalisation
(``(pieces, 2)``: mean, std), and, for inputs whose weights have the output's shape, the
tensor's reconstruction residual (original − decoded). Its metadata names the autoencoder
that encoded them. The ``ls_merge`` method reads it key by key inside mergekit's executor.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.codec import EncodedTensor
from lmc_mergekit.models.layout import KeyLayout

LATENT_FILE = Path("latents") / "latents.safetensors"
STATS_PREFIX = "normalisation::"
RESIDUAL_PREFIX = "residual::"


def write_latents(
    folder: Path,
    layouts: dict[str, KeyLayout],
    encoded: dict[tuple[str, int], EncodedTensor],
    autoencoder: Path,
    residuals: dict[str, torch.Tensor],
) -> None:
    """Write the latents of every key of ``layouts`` from the encoded pieces ``encoded``, and
    the ``residuals`` given (by key)."""
    tensors = {}
    for key, layout in layouts.items():
        parts = [encoded[(piece.kind, piece.layer)] for piece in layout.pieces]
        mean = torch.cat([part.mean.float().cpu() for part in parts])
        log_var = torch.cat([part.log_var.float().cpu() for part in parts])
        tensors[key] = torch.stack([mean, log_var]).contiguous()
        tensors[STATS_PREFIX + key] = torch.tensor(
            [[part.norm.mean, part.norm.std] for part in parts], dtype=torch.float64
        )
    for key, residual in residuals.items():
        tensors[RESIDUAL_PREFIX + key] = residual.contiguous()
    path = folder / LATENT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"autoencoder": str(autoencoder)})


class LatentStore:
    """Read access to the latents of one prepared folder."""

    def __init__(self, folder: Path):
        path = folder / LATENT_FILE
        if not path.is_file():
            raise LmcError(
                f"{folder} holds no latents ({LATENT_FILE}); run the recipe with "
                "lmc-mergekit-yaml so that ls_merge's pre-merge pass writes them"
            )
        self._file = safe_open(str(path), "pt")
        self.autoencoder = Path((self._file.metadata() or {})["autoencoder"])

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Posterior mean and log-variance ``(2, chunks, latent)`` and normalisations of
        ``key``."""
        if key not in self._file.keys():
            raise LmcError(f"the prepared latents hold no tensor {key!r}")
        return self._file.get_tensor(key), self._file.get_tensor(STATS_PREFIX + key)

    def residual(self, key: str) -> torch.Tensor | None:
        """The reconstruction residual of ``key`` (None for a transported source)."""
        name = RESIDUAL_PREFIX + key
        return self._file.get_tensor(name) if name in self._file.keys() else None


@cache
def open_store(folder: str) -> LatentStore:
    """The (cached) latent store of the prepared folder ``folder``."""
    return LatentStore(Path(folder))
