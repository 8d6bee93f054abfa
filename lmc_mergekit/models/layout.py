"""Where every element of every checkpoint tensor comes from in the canonical view.

Adapters only rearrange canonical tensors into checkpoint tensors (reshape, transpose, stack,
concatenate, leave out a tied head). Running an adapter on canonical tensors filled with their
own element positions therefore tells, for each checkpoint key, which canonical tensors feed it
and where each of its elements sits in them, so that code outside the adapters can build any
checkpoint tensor from canonical pieces without knowing a single key name.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.view import ModelView, map_named_tensors

# Layer index of pieces outside the blocks (embeddings, final norm, LM head).
OUTSIDE_BLOCKS = -1


@dataclass(frozen=True)
class Piece:
    """One canonical tensor: its kind (the view's dotted field name, ``embeddings.``/``head.``
    prefixed outside the blocks), its layer and its shape."""

    kind: str
    layer: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class KeyLayout:
    """A checkpoint tensor as a gather from its pieces: ``index`` (the tensor's shape) holds
    positions in the concatenation of the flattened pieces, in ``pieces`` order."""

    pieces: tuple[Piece, ...]
    index: torch.Tensor

    def assemble(self, flats: list[torch.Tensor]) -> torch.Tensor:
        """The checkpoint tensor from the pieces' values (one tensor per piece, any shape)."""
        return torch.cat([flat.reshape(-1) for flat in flats])[self.index.to(flats[0].device)]


@dataclass(frozen=True)
class PartLayout:
    """One part of a model (its embeddings, a block or its head) as read: its canonical tensors
    by piece, and the layout of every checkpoint key the adapter builds from them."""

    tensors: dict[Piece, torch.Tensor]
    keys: dict[str, KeyLayout]


def part_layouts(adapter, view: ModelView) -> Iterator[PartLayout]:
    """The model part by part (one in memory at a time), each with the layouts of its keys,
    checked on the real weights: assembling the part's own tensors must give exactly what the
    adapter writes. No key is built from two parts."""
    spec = view.spec
    yield _part_layout(
        adapter, view.embeddings(), "embeddings.", OUTSIDE_BLOCKS, adapter.embeddings_tensors, spec
    )
    for index in range(spec.num_layers):
        yield _part_layout(
            adapter, view.block(index), "", index, adapter.block_tensors, spec, index
        )
    yield _part_layout(adapter, view.head(), "head.", OUTSIDE_BLOCKS, adapter.head_tensors, spec)


def _part_layout(adapter, part, prefix: str, layer: int, write, *args) -> PartLayout:
    """``part``'s layouts; ``write(part, *args)`` is the adapter's writer of that part."""
    pieces: list[Piece] = []
    starts: list[int] = []
    values: dict[Piece, torch.Tensor] = {}

    def mark(name: str, tensor: torch.Tensor) -> torch.Tensor:
        start = starts[-1] + pieces[-1].numel if pieces else 0
        pieces.append(Piece(prefix + name, layer, tuple(tensor.shape)))
        starts.append(start)
        values[pieces[-1]] = tensor
        return torch.arange(start, start + tensor.numel(), dtype=torch.float64).reshape(
            tensor.shape
        )

    markers = write(map_named_tensors(part, mark), *args)
    real = write(part, *args)
    keys = {}
    for key, marker in markers.items():
        keys[key] = _key_layout(key, marker, pieces, starts)
        rebuilt = keys[key].assemble([values[piece] for piece in keys[key].pieces])
        if not torch.equal(rebuilt, real[key]):
            raise LmcError(
                f"{type(adapter).__name__} writes {key!r} as more than a rearrangement of "
                "canonical tensors; latent merging cannot rebuild it"
            )
    return PartLayout(values, keys)


def checkpoint_layout(adapter, view: ModelView) -> dict[str, KeyLayout]:
    """The layout of every tensor the adapter writes for ``view`` (read part by part)."""
    return {
        key: layout for part in part_layouts(adapter, view) for key, layout in part.keys.items()
    }


def _key_layout(key, marker: torch.Tensor, pieces, starts) -> KeyLayout:
    positions = marker.long().contiguous()
    if not torch.equal(positions.double(), marker):
        raise LmcError(f"the adapter computes {key!r} from canonical tensors; cannot lay it out")
    owner = torch.searchsorted(torch.tensor(starts), positions, right=True) - 1
    used = sorted(set(owner.reshape(-1).tolist()))
    local_start = {}
    offset = 0
    for piece in used:
        local_start[piece] = offset
        offset += pieces[piece].numel
    shift = torch.tensor([local_start.get(i, 0) - starts[i] for i in range(len(pieces))])
    return KeyLayout(tuple(pieces[i] for i in used), positions + shift[owner])
