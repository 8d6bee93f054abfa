"""Where every element of every checkpoint tensor comes from in the canonical view.

Adapters only rearrange canonical tensors into checkpoint tensors (reshape, transpose, stack,
concatenate, leave out a tied head). Most keys are one canonical tensor as it is (the writer
returns that very tensor): those need nothing more. For the others (fused or transposed
projections), running the adapter's writer on canonical tensors filled with their own element
positions tells which canonical tensors feed the key and where each of its elements sits in
them. Either way code outside the adapters can build any checkpoint tensor from canonical
pieces without knowing a single key name, and no per-weight bookkeeping is made for a tensor
that is not rearranged (a whole embedding never is).
"""

from __future__ import annotations

import itertools
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
    """A checkpoint tensor built from its pieces: the one piece as it is (``index`` None: what
    adapters write for most keys, no per-element bookkeeping), or a gather, where ``index``
    (the tensor's shape; int32 where the positions fit) holds positions in the concatenation
    of the flattened pieces, in ``pieces`` order."""

    pieces: tuple[Piece, ...]
    index: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The checkpoint tensor's shape."""
        return self.pieces[0].shape if self.index is None else tuple(self.index.shape)

    def assemble(self, flats: list[torch.Tensor]) -> torch.Tensor:
        """The checkpoint tensor from the pieces' values (one tensor per piece, any shape)."""
        if self.index is None:
            return flats[0].reshape(self.pieces[0].shape)
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
    for index in range(part_count(view)):
        yield part_layout(adapter, view, index)


def checkpoint_layout(adapter, view: ModelView) -> dict[str, KeyLayout]:
    """The layout of every tensor the adapter writes for ``view`` (read part by part)."""
    return {
        key: layout for part in part_layouts(adapter, view) for key, layout in part.keys.items()
    }


def part_count(view: ModelView) -> int:
    """How many parts :func:`part_layouts` yields: the embeddings, each block, the head."""
    return view.spec.num_layers + 2


def part_layout(adapter, view: ModelView, index: int) -> PartLayout:
    """Part ``index`` of :func:`part_layouts` alone (0: the embeddings, then the blocks, last
    the head)."""
    spec = view.spec
    if index == 0:
        part, prefix, write, args = view.embeddings(), "embeddings.", adapter.embeddings_tensors, ()
    elif index <= spec.num_layers:
        part, prefix, write, args = view.block(index - 1), "", adapter.block_tensors, (index - 1,)
    else:
        part, prefix, write, args = view.head(), "head.", adapter.head_tensors, ()
    layer = index - 1 if prefix == "" else OUTSIDE_BLOCKS
    return _part_layout(part, prefix, layer, lambda p: write(p, spec, *args), type(adapter))


def _part_layout(part, prefix: str, layer: int, write, adapter: type) -> PartLayout:
    """``part``'s layouts; ``write(part)`` is the adapter's writer of that part. A key the
    writer returns a canonical tensor for, as it is, is that piece; only the others (fused or
    transposed tensors) are traced, by running the writer on the positions of the pieces they
    may read, and checked on the real weights."""
    values: dict[Piece, torch.Tensor] = {}

    def record(name: str, tensor: torch.Tensor) -> torch.Tensor:
        values[Piece(prefix + name, layer, tuple(tensor.shape))] = tensor
        return tensor

    map_named_tensors(part, record)
    real = write(part)
    as_is = {_address(tensor): piece for piece, tensor in values.items()}
    keys = {
        key: KeyLayout((as_is[_address(t)],)) for key, t in real.items() if _address(t) in as_is
    }
    traced = [key for key in real if key not in keys]
    if traced:
        skip = {keys[key].pieces[0] for key in keys}
        for key, layout in _traced_layouts(part, prefix, layer, write, values, skip, traced):
            rebuilt = layout.assemble([values[piece] for piece in layout.pieces])
            if not torch.equal(rebuilt, real[key]):
                raise LmcError(
                    f"{adapter.__name__} writes {key!r} as more than a rearrangement of "
                    "canonical tensors; latent merging cannot rebuild it"
                )
            keys[key] = layout
    return PartLayout(values, {key: keys[key] for key in real})


def _address(tensor: torch.Tensor) -> tuple:
    """Where a tensor's elements are and in which order: equal for a tensor and any view that
    reads the same elements the same way."""
    storage = tensor.untyped_storage().data_ptr()
    return storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype


def _traced_layouts(part, prefix, layer, write, values, skip, keys):
    """The gather layouts of ``keys``: the writer runs on each piece's element positions
    (pieces in ``skip``, which feed keys laid out as they are, on the meta device, so that no
    position tensor of a whole embedding is made; every piece if that fails)."""
    for leave_out in (skip, set()):
        marked = [piece for piece in values if piece not in leave_out]
        sizes = [piece.numel for piece in marked]
        starts = dict(zip(marked, itertools.accumulate([0, *sizes[:-1]]), strict=True))
        dtype = torch.int32 if sum(sizes) < 2**31 else torch.int64
        try:
            markers = write(map_named_tensors(part, _marker(prefix, layer, starts, dtype)))
        except RuntimeError:  # a left-out piece feeds a traced key too: mark every piece
            continue
        if all(markers[key].device.type != "meta" for key in keys):
            return [(key, _key_layout(key, markers[key], marked, starts)) for key in keys]
    raise LmcError("the adapter's writer cannot be traced; latent merging cannot lay it out")


def _marker(prefix: str, layer: int, starts: dict, dtype: torch.dtype):
    """The piece named ``name`` filled with its element positions (``starts`` gives where
    each marked piece begins); a piece not marked becomes a meta tensor."""

    def mark(name: str, tensor: torch.Tensor) -> torch.Tensor:
        start = starts.get(Piece(prefix + name, layer, tuple(tensor.shape)))
        if start is None:
            return torch.empty(tensor.shape, dtype=dtype, device="meta")
        return torch.arange(start, start + tensor.numel(), dtype=dtype).reshape(tensor.shape)

    return mark


def _key_layout(key, marker: torch.Tensor, marked: list[Piece], starts: dict) -> KeyLayout:
    if marker.dtype not in (torch.int32, torch.int64):
        raise LmcError(f"the adapter computes {key!r} from canonical tensors; cannot lay it out")
    bounds = torch.tensor([starts[piece] for piece in marked], dtype=marker.dtype)
    marker = marker.contiguous()
    owner = torch.searchsorted(bounds, marker, right=True) - 1
    used = torch.unique(owner).tolist()
    pieces = [marked[i] for i in used]
    local = itertools.accumulate([0] + [piece.numel for piece in pieces[:-1]])
    shift = torch.zeros(len(marked), dtype=torch.int64)
    for i, start in zip(used, local, strict=True):
        shift[i] = start - starts[marked[i]]
    index = marker + shift[owner]
    if sum(piece.numel for piece in pieces) < 2**31:
        index = index.to(torch.int32)
    return KeyLayout(tuple(pieces), index)
