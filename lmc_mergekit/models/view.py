"""The canonical view of a decoder-only transformer.

Every linear weight is stored as torch's ``nn.Linear`` does, shape ``(out, in)``, computing
``y = x Wᵀ + b`` on row vectors. Attention projections are unfused: ``q`` is ``(H·dh, d)``,
``k`` and ``v`` are ``(Hkv·dh, d)``, ``o`` is ``(d, H·dh)``, heads contiguous. Rotary dimensions
follow transformers' ``rotate_half`` layout: within each head, dimension ``j`` pairs with
``j + rotary_dims/2`` for ``j < rotary_dims/2``; dimensions from ``rotary_dims`` on are not rotated.
A norm keeps its stored parameter and the offset its family adds to it (Gemma's ``1 + w``): the
effective gain is ``weight + offset``.

Nothing here knows checkpoint key names; the adapters map checkpoints to and from this view.
The parts are dataclasses with optional fields for what only some families have (QK-norms,
post-norms); code that rebuilds a part uses :func:`dataclasses.replace`, so that no field it
does not know is dropped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import Literal, Protocol

import torch

NormKind = Literal["layernorm", "rmsnorm"]
#: Where queries and keys are normalised after their projection: not at all, per head (one gain
#: of ``head_dim`` shared by every head: Qwen3, Gemma 3) or over the whole projection
#: (``heads·head_dim`` gains: OLMo 2).
QKNorm = Literal["none", "head", "projection"]


@dataclass(frozen=True)
class ModelSpec:
    """Structural facts about a model, independent of its checkpoint layout."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dims: int
    intermediate_size: int
    vocab_size: int
    norm: NormKind
    norm_eps: float
    parallel_residual: bool
    gated_mlp: bool
    activation: str
    tied_embeddings: bool
    learned_positions: int = 0
    rope_theta: float = 10000.0
    #: Added to every stored norm parameter to give its gain (Gemma: 1).
    norm_offset: float = 0.0
    #: Whether the attention and the MLP read the stream through a norm (OLMo 2: no).
    pre_norms: bool = True
    #: Whether the attention and MLP outputs are normalised before they are added to the stream
    #: (OLMo 2, and the sandwich norms of Gemma 2 and 3).
    post_norms: bool = False
    qk_norm: QKNorm = "none"
    #: The constant the token embeddings are multiplied by inside the model (Gemma: sqrt(d),
    #: rounded to the model's dtype).
    embedding_multiplier: float = 1.0
    #: ``query_pre_attn_scalar`` (Gemma 2 and 3): attention divides by its square root instead of
    #: the head size's.
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    #: Per layer, its attention type (``full_attention``, ``sliding_attention``), when the
    #: family names them.
    layer_types: tuple[str, ...] = ()
    #: The rotary scaling type (``default``, ``linear``, ``llama3``, ``yarn``, ...).
    rope_type: str = "default"

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def block_parameters(self) -> int:
        """The weights of one block's matrices (its vectors are negligible beside them)."""
        d, dh = self.hidden_size, self.head_dim
        attention = 2 * self.num_heads * dh * d + 2 * self.num_kv_heads * dh * d
        return attention + (3 if self.gated_mlp else 2) * d * self.intermediate_size

    @property
    def parameters(self) -> int:
        """The model's weights: its blocks, embeddings and (untied) head."""
        outside = self.vocab_size * (1 if self.tied_embeddings else 2) + self.learned_positions
        return self.num_layers * self.block_parameters + outside * self.hidden_size

    def shape_summary(self) -> dict[str, int]:
        """The sizes two models must share to be merged weight by weight."""
        return {
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rotary_dims": self.rotary_dims,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "learned_positions": self.learned_positions,
        }

    def shape_mismatch(self, other: ModelSpec) -> tuple[str, int, int] | None:
        """The first size (name, this model's, the other's) in which ``other`` differs."""
        a, b = self.shape_summary(), other.shape_summary()
        return next(((key, a[key], b[key]) for key in a if a[key] != b[key]), None)


@dataclass
class Norm:
    """A LayerNorm or RMSNorm's parameters; ``bias`` is None for RMSNorm. ``weight`` is the
    stored parameter; the gain is ``weight + offset``."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    offset: float = 0.0

    @property
    def gain(self) -> torch.Tensor:
        """The effective gain, in float32 at least where an offset is added: transformers adds
        it in float32 (Gemma's ``1 + w.float()``), and ``1 + w`` rounded to bf16 moves a
        gain near 1 by up to 2⁻⁸."""
        if not self.offset:
            return self.weight
        weight = self.weight
        if weight.is_floating_point() and weight.element_size() < 4:
            weight = weight.float()
        return weight + self.offset

    def with_gain(self, gain: torch.Tensor, bias: torch.Tensor | None = None) -> Norm:
        """This norm with the effective gain ``gain`` (stored as ``gain - offset``, in the
        stored parameter's dtype: :attr:`gain` is float32 where an offset is added, and a bf16
        checkpoint's norm must not come back float32)."""
        if not self.offset:
            return Norm(gain, bias, self.offset)
        return Norm((gain - self.offset).to(self.weight.dtype), bias, self.offset)


@dataclass
class Attention:
    """Unfused attention projections (see the module docstring for layouts), and the norms of
    queries and keys where the family has them (``ModelSpec.qk_norm``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: Norm | None = None
    k_norm: Norm | None = None


@dataclass
class MLP:
    """Feed-forward weights; ``gate`` is set for gated (SwiGLU-style) MLPs."""

    up: torch.Tensor
    down: torch.Tensor
    gate: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    gate_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


@dataclass
class Block:
    """One transformer block: the attention reads through ``attn_norm``, the MLP through
    ``mlp_norm`` (both read the residual stream directly when the residual is parallel; None
    where the family reads the stream without a norm), and their outputs pass through
    ``attn_post_norm`` and ``mlp_post_norm`` before they are added to the stream, where the
    family has those."""

    attn_norm: Norm | None
    attn: Attention
    mlp_norm: Norm | None
    mlp: MLP
    attn_post_norm: Norm | None = None
    mlp_post_norm: Norm | None = None


@dataclass
class Embeddings:
    """Token embedding ``(vocab, d)``, learned positions ``(positions, d)`` if any, and a
    multimodal model's projector ``(features, d)`` if any: row ``i`` is what channel ``i`` of
    a (normalised, pooled) image feature writes into the residual stream at an image token (in
    place of that token's embedding, and not multiplied by the embedding multiplier)."""

    tokens: torch.Tensor
    positions: torch.Tensor | None = None
    projector: torch.Tensor | None = None


@dataclass
class Head:
    """The final norm and the LM head ``(vocab, d)``."""

    norm: Norm
    weight: torch.Tensor
    bias: torch.Tensor | None = None


def map_tensors(part, fn):
    """A copy of a view part with ``fn`` applied to every tensor in it (None stays None)."""
    return map_named_tensors(part, lambda _, tensor: fn(tensor))


def map_named_tensors(part, fn, prefix: str = ""):
    """A copy of a view part with ``fn(dotted field name, tensor)`` applied to every tensor
    (other fields, such as a norm's offset, are kept)."""
    changes = {}
    for f in fields(part):
        value = getattr(part, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = fn(prefix + f.name, value)
        elif value is not None and hasattr(value, "__dataclass_fields__"):
            changes[f.name] = map_named_tensors(value, fn, prefix + f.name + ".")
    return replace(part, **changes)


def iter_tensors(part, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted field name, tensor) for every tensor in a view part."""
    for f in fields(part):
        value = getattr(part, f.name)
        if isinstance(value, torch.Tensor):
            yield prefix + f.name, value
        elif value is not None and hasattr(value, "__dataclass_fields__"):
            yield from iter_tensors(value, prefix + f.name + ".")


class ModelView(Protocol):
    """Read access to a model in canonical form, one part at a time.

    A checkpoint-backed view loads each part on demand, so code written against this protocol
    never needs more than one block in memory.
    """

    spec: ModelSpec

    def embeddings(self) -> Embeddings: ...

    def block(self, index: int) -> Block: ...

    def head(self) -> Head: ...


#: The matrix of each outside part whose rows are the vocabulary's.
ROW_FIELDS = {"embeddings": "tokens", "head": "weight"}
#: Vocabulary rows a writer or a check reads, moves or mixes at a time.
VOCAB_ROWS = 16384


def row_chunks(view: ModelView, read: str, rows: int) -> Iterator[Embeddings | Head]:
    """``view``'s part ``read`` (``embeddings`` or ``head``) with ``rows`` rows of its
    vocabulary matrix at a time (and of a head's bias), the rest of the part whole: through the
    view's own ``row_chunks`` where it has one (a checkpoint reads each slice alone, a moved or
    mixed view moves or mixes a slice at a time), else the part read whole and sliced."""
    own = getattr(view, "row_chunks", None)
    if own is not None:
        yield from own(read, rows)
        return
    yield from sliced_rows(getattr(view, read)(), read, rows)


def sliced_rows(part: Embeddings | Head, read: str, rows: int) -> Iterator[Embeddings | Head]:
    """``part`` (read as ``read``) a slice of ``rows`` vocabulary rows at a time."""
    field = ROW_FIELDS[read]
    sliced = [field] + (["bias"] if getattr(part, "bias", None) is not None else [])
    for start in range(0, len(getattr(part, field)), rows):
        yield replace(part, **{f: getattr(part, f)[start : start + rows] for f in sliced})


@dataclass
class InMemoryView:
    """A fully materialised model view."""

    spec: ModelSpec
    embeddings_: Embeddings
    blocks: list[Block]
    head_: Head

    def embeddings(self) -> Embeddings:
        return self.embeddings_

    def block(self, index: int) -> Block:
        return self.blocks[index]

    def head(self) -> Head:
        return self.head_


def materialize(view: ModelView) -> InMemoryView:
    """Load every part of a view into memory."""
    return InMemoryView(
        spec=view.spec,
        embeddings_=view.embeddings(),
        blocks=[view.block(i) for i in range(view.spec.num_layers)],
        head_=view.head(),
    )
