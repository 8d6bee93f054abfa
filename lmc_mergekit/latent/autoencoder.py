"""The weight autoencoder: a small transformer VAE over windows of weight chunks.

A window is up to ``window`` consecutive chunks of one tensor (:mod:`.chunks`). Each chunk is
embedded linearly and given learned embeddings of its tensor's kind and layer and a sinusoidal
encoding of its position in the tensor; a transformer encoder turns the window into one
Gaussian latent per chunk (``chunk_size / compression_ratio`` numbers), and a decoder of the
same shape turns latents back into chunks. Nothing is shared across tensors, so any tensor can
be encoded and decoded on its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.chunks import OUTSIDE_BLOCKS


@dataclass(frozen=True)
class AutoencoderConfig:
    """Sizes of the autoencoder; ``kinds`` and ``layers`` fix which tensors it can encode."""

    kinds: tuple[str, ...]
    layers: int
    chunk_size: int = 64
    compression_ratio: float = 1.6
    width: int = 128
    depth: int = 2
    heads: int = 4
    window: int = 16

    def __post_init__(self) -> None:
        if not 1.0 <= self.compression_ratio <= self.chunk_size:
            raise LmcError(
                f"compression ratio {self.compression_ratio:g} is outside 1 to the chunk size "
                f"({self.chunk_size}); the paper's working point is 1.6"
            )

    @property
    def latent_dim(self) -> int:
        """Latent numbers per chunk."""
        return max(1, round(self.chunk_size / self.compression_ratio))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AutoencoderConfig:
        values = json.loads(text)
        return cls(**{**values, "kinds": tuple(values["kinds"])})


@dataclass(frozen=True)
class Windows:
    """Chunks of one tensor in windows: ``chunks`` ``(m, window, size)``, the chunk index of
    each slot ``(m, window)`` and which slots hold a chunk ``(m, window)``."""

    chunks: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor

    def __getitem__(self, index) -> Windows:
        return Windows(self.chunks[index], self.positions[index], self.valid[index])

    def to(self, device) -> Windows:
        return Windows(self.chunks.to(device), self.positions.to(device), self.valid.to(device))

    @classmethod
    def of(cls, chunks: torch.Tensor, window: int, first: int = 0) -> Windows:
        """Cut ``(n, size)`` chunks into windows of ``window`` (the last one padded); ``first``
        is the position of ``chunks[0]`` in its tensor (a multiple of ``window``) where they
        are a run of a longer tensor's chunks."""
        count, size = chunks.shape
        slots = math.ceil(count / window) * window
        padded = chunks
        if slots != count:
            padded = torch.zeros(slots, size, dtype=chunks.dtype, device=chunks.device)
            padded[:count] = chunks
        positions = torch.arange(first, first + slots, device=chunks.device)
        return cls(
            chunks=padded.reshape(-1, window, size),
            positions=positions.reshape(-1, window),
            valid=(positions < first + count).reshape(-1, window),
        )

    def flatten(self, values: torch.Tensor) -> torch.Tensor:
        """Per-slot ``values`` ``(m, window, k)`` back to per-chunk ``(n, k)``."""
        return values[self.valid]


class WeightAutoencoder(nn.Module):
    """Encoder and decoder of weight chunks (see the module docstring)."""

    def __init__(self, config: AutoencoderConfig):
        super().__init__()
        self.config = config
        width, latent = config.width, config.latent_dim
        self.kind_embedding = nn.Embedding(len(config.kinds), width)
        self.layer_embedding = nn.Embedding(config.layers + 1, width)  # 0: outside blocks
        self.chunk_in = nn.Linear(config.chunk_size, width)
        self.latent_in = nn.Linear(latent, width)
        self.encoder = _transformer(config)
        self.decoder = _transformer(config)
        self.to_posterior = nn.Linear(width, 2 * latent)
        self.chunk_out = nn.Linear(width, config.chunk_size)

    def kind_index(self, kind: str) -> int:
        """The index of a tensor kind, or a one-line error if the autoencoder never saw it."""
        try:
            return self.config.kinds.index(kind)
        except ValueError:
            raise LmcError(
                f"the autoencoder was not trained on tensors of kind {kind!r}; train it on "
                "models that have them"
            ) from None

    def _context(self, kinds: torch.Tensor, layers: torch.Tensor, windows: Windows):
        """Kind, layer and position encodings ``(m, window, width)`` of ``m`` windows whose
        tensors have kind indices ``kinds`` and layers ``layers`` (``(m,)`` each)."""
        if int(layers.min()) < OUTSIDE_BLOCKS or int(layers.max()) >= self.config.layers:
            raise LmcError(
                f"the autoencoder knows layers 0-{self.config.layers - 1}, not layer "
                f"{int(layers.max())}; train it on the models it should encode"
            )
        per_window = self.kind_embedding(kinds) + self.layer_embedding(layers + 1)
        return per_window[:, None] + _sinusoid(windows.positions, self.config.width)

    def encode(self, kinds, layers, windows: Windows) -> tuple[torch.Tensor, torch.Tensor]:
        """Posterior mean and log-variance per slot, ``(m, window, latent)`` each."""
        hidden = self.chunk_in(windows.chunks) + self._context(kinds, layers, windows)
        hidden = self.encoder(hidden, src_key_padding_mask=~windows.valid)
        mean, log_var = self.to_posterior(hidden).chunk(2, dim=-1)
        return mean, log_var.clamp(-12.0, 8.0)

    def decode(self, kinds, layers, latents: torch.Tensor, windows: Windows) -> torch.Tensor:
        """Chunks ``(m, window, size)`` from per-slot ``latents`` ``(m, window, latent)``."""
        hidden = self.latent_in(latents) + self._context(kinds, layers, windows)
        hidden = self.decoder(hidden, src_key_padding_mask=~windows.valid)
        return self.chunk_out(hidden)

    def tags(self, kind: str, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Kind and layer index tensors ``(count,)`` for ``count`` windows of one tensor."""
        return self.tags_of([self.kind_index(kind)] * count, [layer] * count)

    def tags_of(self, kinds: list[int], layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Kind and layer index tensors of windows whose kind indices are ``kinds`` and layers
        ``layers``, on the autoencoder's device."""
        device = self.chunk_in.weight.device
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return as_tensor(kinds), as_tensor(layers)


def _transformer(config: AutoencoderConfig) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(
        config.width,
        config.heads,
        dim_feedforward=4 * config.width,
        dropout=0.0,
        batch_first=True,
        norm_first=True,
    )
    return nn.TransformerEncoder(layer, config.depth, enable_nested_tensor=False)


def _sinusoid(positions: torch.Tensor, width: int) -> torch.Tensor:
    """Sinusoidal encodings ``(..., width)`` of integer chunk positions."""
    half = width // 2
    freqs = torch.exp(
        -math.log(10000.0) * torch.arange(half, device=positions.device) / max(1, half)
    )
    angles = positions[..., None].float() * freqs
    encoding = torch.cat([angles.sin(), angles.cos()], dim=-1)
    return F.pad(encoding, (0, width - 2 * half))


def save_autoencoder(model: WeightAutoencoder, path: Path) -> None:
    """Write the autoencoder's weights and config into one safetensors file."""
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path), metadata={"config": model.config.to_json()})


def load_autoencoder(path: Path, device: torch.device | str = "cpu") -> WeightAutoencoder:
    """An autoencoder written by :func:`save_autoencoder`, in eval mode."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fp:
        config = AutoencoderConfig.from_json((fp.metadata() or {})["config"])
    model = WeightAutoencoder(config)
    model.load_state_dict(load_file(str(path)))
    return model.to(device).eval()
