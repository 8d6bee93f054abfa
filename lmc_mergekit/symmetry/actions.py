"""Applying a :class:`Transform` to a model view, one part at a time.

The actions are plain differentiable torch operations in the dtype of their inputs: a
:class:`TransformedView` computes in float32 (float64 for parts stored in float32) and casts
back to the source dtype; learned matching runs the same functions on float32 parts with
trainable group elements. See the transform module for the order of operations and the
reference notes (§2) for the algebra.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.adapters.base import CheckpointView
from lmc_mergekit.models.view import (
    MLP,
    Attention,
    Block,
    Embeddings,
    Head,
    ModelSpec,
    ModelView,
    Norm,
    iter_tensors,
    map_named_tensors,
    map_tensors,
    row_chunks,
)
from lmc_mergekit.symmetry.transform import LayerTransform, Transform, kv_permutation

# A LayerNorm bias kept in the norm is divided by the gain; refuse gains this close to zero.
MIN_GAIN = 1e-6


def apply_transform(
    view: ModelView, transform: Transform, dtype: torch.dtype | None = None
) -> TransformedView:
    """The view of ``view`` moved by ``transform`` (lazy: parts are transformed when read),
    each part computed in :func:`compute_dtype` and rounded once to each tensor's own dtype, or
    to ``dtype``."""
    transform.check_fits(view.spec)
    return TransformedView(view, transform, dtype)


class TransformedView:
    """A :class:`ModelView` whose parts are those of ``source`` moved by ``transform``, each
    part computed in :func:`compute_dtype` (float32 for a part stored in 16 bits, float64 for
    one stored in float32) and rounded once to its source tensor's dtype (or to ``dtype``).
    The embeddings and the head are moved in slices of rows (each row moves on its own), so
    that no full-precision copy of a whole vocabulary exists."""

    def __init__(self, source: ModelView, transform: Transform, dtype: torch.dtype | None = None):
        self.source = source
        self.transform = transform.to(torch.float64)
        self._transforms = {torch.float64: self.transform}
        self.dtype = dtype
        # Norms normalise away a global scale g exactly when their eps scales by g².
        self.spec: ModelSpec = replace(
            source.spec, norm_eps=source.spec.norm_eps * transform.scale**2
        )

    def in_dtype(self, dtype: torch.dtype) -> Transform:
        """The transform with its rotation and maps in ``dtype`` (cast once)."""
        if dtype not in self._transforms:
            self._transforms[dtype] = self.transform.to(dtype)
        return self._transforms[dtype]

    def embeddings(self) -> Embeddings:
        return _by_rows(
            self.source.embeddings(),
            "tokens",
            lambda e, dt: transform_embeddings(e, self.in_dtype(dt)),
            self.dtype,
        )

    def block(self, index: int) -> Block:
        return _computed(
            self.source.block(index),
            lambda b, dt: transform_block(b, self.source.spec, self.in_dtype(dt), index),
            self.dtype,
        )

    def head(self) -> Head:
        return _by_rows(
            self.source.head(),
            "weight",
            lambda h, dt: transform_head(h, self.in_dtype(dt)),
            self.dtype,
        )

    def row_chunks(self, read: str, rows: int) -> Iterator[Embeddings | Head]:
        """See :func:`~lmc_mergekit.models.view.row_chunks`: each slice of the source's moved
        alone (rows move on their own)."""
        move = transform_embeddings if read == "embeddings" else transform_head
        for part in row_chunks(self.source, read, rows):
            yield _computed(part, lambda p, dt: move(p, self.in_dtype(dt)), self.dtype)


def head_through_tokens(view: ModelView) -> Head | None:
    """For a view whose head is its token embeddings (a tied checkpoint, as it is or moved):
    the head as a ``d × d`` reader of the view's own (moved) embeddings, ``Head(norm, C)`` with
    ``logits = norm(x)·Cᵀ·tokensᵀ``, ``C`` in float32, the norm as the view's head has it (a
    LayerNorm bias the head cannot take stays in it). A caller that holds the tokens then needs
    no second vocabulary-sized matrix for the head, though a moved head (a final norm absorbed
    into it) differs from the moved tokens: both are the stored matrix moved row by row,
    ``tokens = E·B`` and ``head = E·A``, so ``C = B⁻¹·A``. None for any other view (an untied
    head, a head bias, a view not read from a checkpoint)."""
    source, transform = view, None
    if isinstance(view, TransformedView):
        source, transform = view.source, view.transform
    if not isinstance(source, CheckpointView) or not source.spec.tied_embeddings:
        return None
    first = next(row_chunks(source, "head", 1))  # the norm, and one row of the vocabulary
    if first.bias is not None:
        return None
    d = first.weight.shape[1]
    eye = torch.eye(d, dtype=torch.float64)
    rows = eye if transform is None else transform_embeddings(Embeddings(eye), transform).tokens
    probe = replace(first, weight=torch.linalg.inv(rows).float())
    if transform is None:
        return probe
    return _computed(probe, lambda head, dt: transform_head(head, view.in_dtype(dt)))


# Rows of an embedding or head moved at once (a slice of 8192 × 4096 float64 is 256 MiB).
ROW_SLICE = 8192


def compute_dtype(part) -> torch.dtype:
    """What a part is moved in: float64 where a tensor that products reach (a matrix, a bias)
    is stored in float32 or wider, so that each is its exact transform rounded once; float32
    where they are all stored in 16 bits (the float64 move rounded once but for under one
    element in a thousand, each a neighbour of it or within float32's error of the tensor's
    scale; at twice float64's speed). Norm gains, moved only by
    elementwise scales and signed permutations, do not count."""
    wide = any(
        t.is_floating_point() and t.element_size() >= 4 and "norm." not in name
        for name, t in iter_tensors(part)
    )
    return torch.float64 if wide else torch.float32


def _computed(part, fn, dtype: torch.dtype | None = None):
    """``fn(part, compute dtype)`` with ``part`` in its :func:`compute_dtype`, each result
    rounded once to the dtype of the source tensor of the same name (mixed-dtype checkpoints
    keep their dtypes), or to ``dtype``."""
    dtypes = stored_dtypes(part)
    work = compute_dtype(part)
    out = fn(map_tensors(part, lambda t: t.to(work) if t.is_floating_point() else t), work)
    return rounded(out, dtypes, dtype)


def stored_dtypes(part) -> dict[str, torch.dtype]:
    """The dtype of each floating tensor of a (source) part, by its dotted name."""
    return {name: t.dtype for name, t in iter_tensors(part) if t.is_floating_point()}


def rounded(part, dtypes: dict[str, torch.dtype], dtype: torch.dtype | None = None):
    """A moved ``part`` rounded once: each floating tensor to the source tensor of its name's
    dtype in ``dtypes`` (a tensor the move created: the source's first dtype), or to
    ``dtype``."""
    fallback = next(iter(dtypes.values()))
    return map_named_tensors(
        part,
        lambda name, t: t.to(dtype or dtypes.get(name, fallback)) if t.is_floating_point() else t,
    )


def _by_rows(part, field: str, fn, dtype: torch.dtype | None = None):
    """:func:`_computed` for a part whose tensor ``field`` ``fn`` moves row by row: run on
    slices of its rows, the other tensors taken from the first slice."""
    rows = getattr(part, field)
    if rows.shape[0] <= ROW_SLICE:
        return _computed(part, fn, dtype)
    first, out = None, None
    for start in range(0, rows.shape[0], ROW_SLICE):
        moved = _computed(replace(part, **{field: rows[start : start + ROW_SLICE]}), fn, dtype)
        piece = getattr(moved, field)
        if out is None:
            first = moved
            out = piece.new_empty((rows.shape[0], *piece.shape[1:]))
        out[start : start + piece.shape[0]] = piece
    return replace(first, **{field: out})


# ---- the parts --------------------------------------------------------------------------


def transform_embeddings(emb: Embeddings, t: Transform) -> Embeddings:
    """Embeddings (and a multimodal projector, which writes image features in place of the
    image tokens' embeddings) write the residual stream: ``E ← g·E·Q``."""
    return replace(
        emb,
        tokens=_write(emb.tokens, t),
        positions=None if emb.positions is None else _write(emb.positions, t),
        projector=None if emb.projector is None else _write(emb.projector, t),
    )


def transform_head(head: Head, t: Transform) -> Head:
    """The LM head reads through the final norm. A head kept tied to the embeddings moves as
    they do (``W ← g·W·Q``) and the final norm keeps its gain, moved by ``|Q|`` and divided by
    ``g``: ``(γ|Q|/g ⊙ x̂Q)·(g·W·Q)ᵀ = (γ ⊙ x̂)·Wᵀ`` for a signed permutation ``Q``."""
    if not t.keep_tie:
        norm, [(weight, bias)] = _read_stream(head.norm, [(head.weight, head.bias)], t)
        return replace(head, norm=norm, weight=weight, bias=bias)
    norm = head.norm
    gain, bias = norm.gain, norm.bias
    if t.rotation is not None:
        gain = turned(gain, t.rotation.abs())
        bias = None if bias is None else turned(bias, t.rotation)
    moved = norm.with_gain(_scaled(gain, t, -1), _scaled(bias, t, -1))
    return replace(head, norm=moved, weight=_write(head.weight, t))


def transform_block(block: Block, spec: ModelSpec, t: Transform, index: int) -> Block:
    """Move one block by the residual part of ``t`` and by its layer part ``t.layers[index]``.

    With a global scale ``g`` every norm's eps becomes ``eps·g²``, so every norm must see its
    input scaled by ``g``: the stream is, the input of a post-norm (the attention or MLP
    output) is made so by its writer, and the input of a QK-norm by scaling the query and key
    projections; a reader of the stream without a norm in front is divided by ``g``.
    """
    a, m = block.attn, block.mlp
    attn_norm, attn_readers = _read_stream(
        block.attn_norm, [(a.q, a.q_bias), (a.k, a.k_bias), (a.v, a.v_bias)], t
    )
    mlp_readers = [(m.up, m.up_bias)] + ([(m.gate, m.gate_bias)] if m.gate is not None else [])
    mlp_norm, mlp_readers = _read_stream(block.mlp_norm, mlp_readers, t)
    (q, q_bias), (k, k_bias), (v, v_bias) = attn_readers
    if spec.qk_norm != "none":
        q, q_bias, k, k_bias = (_scaled(x, t, 1) for x in (q, q_bias, k, k_bias))
    (up, up_bias), *gated = mlp_readers
    gate, gate_bias = gated[0] if gated else (None, None)
    o, o_bias = _write_linear(a.o, a.o_bias, t)
    down, down_bias = _write_linear(m.down, m.down_bias, t)
    block = replace(
        block,
        attn_norm=attn_norm,
        attn=replace(
            a, q=q, k=k, v=v, o=o, q_bias=q_bias, k_bias=k_bias, v_bias=v_bias, o_bias=o_bias
        ),
        mlp_norm=mlp_norm,
        mlp=replace(
            m,
            up=up,
            down=down,
            gate=gate,
            up_bias=up_bias,
            gate_bias=gate_bias,
            down_bias=down_bias,
        ),
        attn_post_norm=_post_norm(block.attn_post_norm, t),
        mlp_post_norm=_post_norm(block.mlp_post_norm, t),
    )
    return apply_layer_transform(block, spec, t.layers[index])


def apply_layer_transform(block: Block, spec: ModelSpec, layer: LayerTransform) -> Block:
    """Head and FFN permutations, then QK and OV maps, on one block."""
    attn, mlp = block.attn, block.mlp
    if layer.head_perm is not None:
        attn = permute_heads(attn, spec, layer.head_perm)
    if layer.ffn_perm is not None:
        mlp = permute_ffn(mlp, layer.ffn_perm)
    if layer.qk is not None:
        attn = apply_qk_maps(attn, spec, layer.qk)
    if layer.ov is not None:
        attn = apply_ov_maps(attn, spec, layer.ov)
    return replace(block, attn=attn, mlp=mlp)


# ---- norms and the residual stream --------------------------------------------------------

Reader = tuple[torch.Tensor, torch.Tensor | None]


def absorb_norm(norm: Norm, readers: list[Reader]) -> tuple[Norm, list[Reader]]:
    """Fold the norm's gain (and, where every reader has a bias, its bias) into its readers.

    ``W ← W·diag(γ)``, ``b ← b + W·β``, then ``γ ← 1, β ← 0`` (stored as ``1 - offset``). A
    LayerNorm bias that cannot be folded (a reader without bias, e.g. the LM head) stays in the
    norm as ``β/γ``.
    """
    gain, bias = norm.gain, norm.bias
    fold_bias = bias is not None and all(b is not None for _, b in readers)
    new_readers = []
    for weight, reader_bias in readers:
        if fold_bias:
            reader_bias = reader_bias + weight @ bias
        new_readers.append((weight * gain, reader_bias))
    new_bias = None
    if bias is not None:
        if fold_bias:
            new_bias = torch.zeros_like(bias)
        else:
            tiny = (gain.abs() < MIN_GAIN) & (bias != 0)
            if tiny.any():
                channel = int(tiny.nonzero()[0])
                raise LmcError(
                    f"norm gain is ~0 at channel {channel} where its bias is not; cannot absorb "
                    "this norm (its bias would have to be divided by the gain)"
                )
            new_bias = torch.where(gain.abs() < MIN_GAIN, torch.zeros_like(bias), bias / gain)
    return norm.with_gain(torch.ones_like(gain), new_bias), new_readers


def _read_stream(
    norm: Norm | None, readers: list[Reader], t: Transform
) -> tuple[Norm | None, list[Reader]]:
    """Readers of the stream ``g·x·Q``: through a norm (absorbed when ``t`` absorbs norms),
    ``W ← W·Q``, a bias kept in the norm turning with the stream; without one, ``W ← W·Q/g``."""
    if norm is None:
        rotated = (
            readers if t.rotation is None else [(turned(w, t.rotation), b) for w, b in readers]
        )
        return None, [(_scaled(w, t, -1), b) for w, b in rotated]
    if t.absorb_norms:
        norm, readers = absorb_norm(norm, readers)
    if t.rotation is None:
        return norm, readers
    bias = None if norm.bias is None else turned(norm.bias, t.rotation)
    return replace(norm, bias=bias), [(turned(w, t.rotation), b) for w, b in readers]


def _post_norm(norm: Norm | None, t: Transform) -> Norm | None:
    """A norm between a block's output and the stream: its writer already sends ``g·y·P``, so
    its gain moves with the signed permutation ``P`` (``γ ← g·γ·|P|``), never mixing channels."""
    if norm is None:
        return None
    gain = norm.gain if t.rotation is None else turned(norm.gain, t.rotation.abs())
    return norm.with_gain(_scaled(gain, t, 1), norm.bias)


def _scaled(x: torch.Tensor | None, t: Transform, power: int) -> torch.Tensor | None:
    """``x·g^power`` (a learned scale is a tensor and always multiplies: it carries a gradient
    even at 1)."""
    if x is None or (not isinstance(t.scale, torch.Tensor) and t.scale == 1.0):
        return x
    return x * t.scale if power == 1 else x / t.scale


def _write(x: torch.Tensor, t: Transform) -> torch.Tensor:
    """Rows written into the residual stream: ``x ← g·x·Q``."""
    return _scaled(x if t.rotation is None else turned(x, t.rotation), t, 1)


def turned(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``x·Q``. A fixed signed permutation ``Q`` (the residual map of post-norm families and of
    kept ties) moves columns instead of multiplying: the same values exactly, at the cost of a
    copy instead of a ``d``-times larger product."""
    if rotation.requires_grad:
        return x @ rotation
    magnitude = rotation.abs()
    source = magnitude.argmax(dim=0)  # the row of each column's one nonzero entry
    columns = torch.arange(len(rotation), device=rotation.device)
    if not (bool((magnitude[source, columns] == 1).all()) and bool((magnitude.sum(0) == 1).all())):
        return x @ rotation
    return x[..., source] * rotation[source, columns].to(x)


def _write_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, t: Transform
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear writing the residual stream: ``W ← g·Qᵀ·W``, ``b ← g·b·Q``."""
    return _write(weight.T, t).T, None if bias is None else _write(bias, t)


# ---- heads and neurons --------------------------------------------------------------------


def _by_head(weight: torch.Tensor | None, heads: int, perm: torch.Tensor) -> torch.Tensor | None:
    if weight is None:
        return None
    return weight.reshape(heads, -1, *weight.shape[1:])[perm].reshape(weight.shape)


def permute_heads(attn: Attention, spec: ModelSpec, head_perm: torch.Tensor) -> Attention:
    """Reorder query heads by ``head_perm`` and key/value heads by the implied group order (a
    QK-norm over the whole projection has a gain per head and moves with them)."""
    kv = kv_permutation(head_perm, spec.num_kv_heads)
    h, hkv = spec.num_heads, spec.num_kv_heads
    d = attn.o.shape[0]
    o = attn.o.reshape(d, h, -1)[:, head_perm].reshape(d, -1)
    q_norm, k_norm = attn.q_norm, attn.k_norm
    if spec.qk_norm == "projection":
        q_norm = replace(q_norm, weight=_by_head(q_norm.weight, h, head_perm))
        k_norm = replace(k_norm, weight=_by_head(k_norm.weight, hkv, kv))
    return replace(
        attn,
        q=_by_head(attn.q, h, head_perm),
        k=_by_head(attn.k, hkv, kv),
        v=_by_head(attn.v, hkv, kv),
        o=o,
        q_bias=_by_head(attn.q_bias, h, head_perm),
        k_bias=_by_head(attn.k_bias, hkv, kv),
        v_bias=_by_head(attn.v_bias, hkv, kv),
        q_norm=q_norm,
        k_norm=k_norm,
    )


def permute_ffn(mlp: MLP, perm: torch.Tensor) -> MLP:
    """Reorder hidden neurons: rows of up/gate (and biases), columns of down."""

    def rows(x):
        return None if x is None else x[perm]

    return replace(
        mlp,
        up=rows(mlp.up),
        down=mlp.down[:, perm],
        gate=rows(mlp.gate),
        up_bias=rows(mlp.up_bias),
        gate_bias=rows(mlp.gate_bias),
    )


def _invertible(maps: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``maps`` in a dtype ``linalg.inv`` takes and no coarser than the weights they act on:
    CUDA's bf16 autocast hands learned maps over in bf16 (the CPU's inverts in float32)."""
    dtype = torch.promote_types(torch.promote_types(maps.dtype, weight.dtype), torch.float32)
    return maps.to(dtype)


def apply_qk_maps(attn: Attention, spec: ModelSpec, maps: torch.Tensor) -> Attention:
    """``q ← q·M_j`` for every query head of group ``j`` and ``k_j ← k_j·M_j⁻ᵀ``."""
    if spec.qk_norm != "none":
        return _apply_normed_qk_maps(attn, spec, maps)
    hkv, g, dh = spec.num_kv_heads, spec.group_size, spec.head_dim
    maps = _invertible(maps, attn.q)
    inv = torch.linalg.inv(maps)
    q = torch.einsum("jba,jgbd->jgad", maps, attn.q.reshape(hkv, g, dh, -1))
    k = torch.einsum("jab,jbd->jad", inv, attn.k.reshape(hkv, dh, -1))
    q_bias = k_bias = None
    if attn.q_bias is not None:
        q_bias = torch.einsum("jgb,jba->jga", attn.q_bias.reshape(hkv, g, dh), maps).reshape(-1)
    if attn.k_bias is not None:
        k_bias = torch.einsum("jb,jab->ja", attn.k_bias.reshape(hkv, dh), inv).reshape(-1)
    return replace(
        attn, q=q.reshape(attn.q.shape), k=k.reshape(attn.k.shape), q_bias=q_bias, k_bias=k_bias
    )


def _apply_normed_qk_maps(attn: Attention, spec: ModelSpec, maps: torch.Tensor) -> Attention:
    """Diagonal QK maps under a QK-norm (:mod:`.group`): their signs flip rows of ``W_q`` and
    ``W_k`` (the norm commutes with that), their magnitudes scale the ``q_norm`` gain and divide
    the ``k_norm`` one (:func:`_normed_qk_parts`)."""
    q_sign, k_sign, q_norm, k_norm = _normed_qk_parts(attn, spec, maps)
    return replace(
        attn,
        q=_signed_rows(attn.q, q_sign),
        k=_signed_rows(attn.k, k_sign),
        q_bias=_signed_rows(attn.q_bias, q_sign),
        k_bias=_signed_rows(attn.k_bias, k_sign),
        q_norm=q_norm,
        k_norm=k_norm,
    )


def _normed_qk_parts(
    attn: Attention, spec: ModelSpec, maps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Norm, Norm]:
    """Diagonal QK maps under a QK-norm as they act: the sign of each row of ``W_q`` and of
    ``W_k`` (:func:`_qk_signs`), and the ``q_norm`` and ``k_norm`` with their gains times and
    divided by the maps' magnitudes (a per-head norm's gain is shared by all heads: kv head 0's
    magnitudes)."""
    if attn.q_norm.bias is not None or attn.k_norm.bias is not None:
        # A LayerNorm's mean subtraction does not commute with flipping some rows' signs.
        raise LmcError("QK maps under a QK-norm with a bias (a LayerNorm) are not supported")
    hkv, g, dh = spec.num_kv_heads, spec.group_size, spec.head_dim
    magnitude = maps.diagonal(dim1=-2, dim2=-1).abs()  # (hkv, dh)
    if spec.qk_norm == "head":
        q_scale, k_scale = magnitude[0], magnitude[0]
    else:
        q_scale = magnitude[:, None, :].expand(hkv, g, dh).reshape(-1)
        k_scale = magnitude.reshape(-1)
    q_norm, k_norm = attn.q_norm, attn.k_norm
    return (
        *_qk_signs(maps, spec),
        q_norm.with_gain(q_norm.gain * q_scale.to(q_norm.weight), q_norm.bias),
        k_norm.with_gain(k_norm.gain / k_scale.to(k_norm.weight), k_norm.bias),
    )


def _qk_signs(maps: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The signs of diagonal QK maps ``(kv heads, dh, dh)`` per row of ``W_q`` (each query
    head its group's) and of ``W_k``. Discrete: detached, since their gradient is zero and
    a sign that asked for one would make the rows it multiplies ask for theirs."""
    hkv, g, dh = spec.num_kv_heads, spec.group_size, spec.head_dim
    sign = torch.sign(maps.diagonal(dim1=-2, dim2=-1)).detach()  # (hkv, dh)
    return sign[:, None, :].expand(hkv, g, dh).reshape(-1), sign.reshape(-1)


def _signed_rows(x: torch.Tensor | None, sign: torch.Tensor) -> torch.Tensor | None:
    """``x`` (a matrix or a bias) with its rows times ``sign``."""
    return None if x is None else x * sign.reshape(-1, *([1] * (x.dim() - 1)))


def apply_ov_maps(attn: Attention, spec: ModelSpec, maps: torch.Tensor) -> Attention:
    """``v_j ← v_j·N_j`` and every output block of group ``j`` by ``N_j⁻ᵀ``."""
    hkv, g, dh = spec.num_kv_heads, spec.group_size, spec.head_dim
    maps = _invertible(maps, attn.v)
    inv = torch.linalg.inv(maps)
    v = torch.einsum("jba,jbd->jad", maps, attn.v.reshape(hkv, dh, -1))
    d = attn.o.shape[0]
    o = torch.einsum("djgb,jab->djga", attn.o.reshape(d, hkv, g, dh), inv)
    v_bias = None
    if attn.v_bias is not None:
        v_bias = torch.einsum("jb,jba->ja", attn.v_bias.reshape(hkv, dh), maps).reshape(-1)
    return replace(attn, v=v.reshape(attn.v.shape), o=o.reshape(d, -1), v_bias=v_bias)


# ---- the same symmetries acting on a block's activations ----------------------------------


@dataclass(frozen=True)
class ActivationAction:
    """A transform's residual map ``Q``, global scale ``g`` and per-head QK and OV maps acting
    on the activations of a block instead of on its weights (learned matching's mixes: the
    block mixer's ``StreamMaps``). Each projection computes with the weights it holds what it
    would compute with the moved ones: a reader of the stream ``proj(x·Qᵀ)`` for weights
    ``W·Q``, a writer ``g·proj(z)·Q`` for ``g·Qᵀ·W`` and ``g·b·Q``, queries ``proj(x)·M`` per
    head for ``Mᵀ·W_q`` (reference notes §2), so that moving a block costs what its tokens do,
    not ``d`` times its weights. The norms' vectors move in weight space (:meth:`norms`). Made
    by :func:`activation_actions`, each layer's maps with their inverses; no permutations
    (they are matching's, already applied to the weights)."""

    spec: ModelSpec
    rotation: torch.Tensor | None = None
    scale: float | torch.Tensor = 1.0
    #: Per layer, per key/value head ``(kv heads, dh, dh)``: the QK maps (diagonal under a
    #: QK-norm) and, without a QK-norm, their inverse transposes (what keys are multiplied
    #: by); the OV maps and their inverses. One tuple of views each, so that a step's
    #: gradient reaches the stacked maps in one piece, not as a full-size one per layer.
    qk: tuple[torch.Tensor, ...] | None = None
    qk_inverse: tuple[torch.Tensor, ...] | None = None
    ov: tuple[torch.Tensor, ...] | None = None
    ov_inverse: tuple[torch.Tensor, ...] | None = None
    #: What readers' inputs and writers' outputs are multiplied by where there is a rotation
    #: (``Qᵀ``, or ``Qᵀ/g`` with no norm in between; ``g·Q``): made once a step, each a
    #: ``d × d`` product where scaling every block's activations would be a ``tokens × d`` one.
    reader: torch.Tensor | None = None
    writer: torch.Tensor | None = None

    def norms(self, block: Block, layer: int) -> Block:
        """``block`` (layer ``layer``, its norms absorbed) with its norms as
        :func:`transform_block` moves them: a bias kept in a pre-norm turns with the stream,
        post-norm gains move by ``g·|Q|``, QK-norm gains by the QK maps' magnitudes; its
        projections as they are (:meth:`reads` and the others move them)."""
        attn = block.attn
        if self.qk is not None and self.spec.qk_norm != "none":
            _, _, q_norm, k_norm = _normed_qk_parts(attn, self.spec, self.qk[layer])
            attn = replace(attn, q_norm=q_norm, k_norm=k_norm)
        return replace(
            block,
            attn_norm=self._pre_norm(block.attn_norm),
            mlp_norm=self._pre_norm(block.mlp_norm),
            attn=attn,
            attn_post_norm=_post_norm(block.attn_post_norm, self),
            mlp_post_norm=_post_norm(block.mlp_post_norm, self),
        )

    def _pre_norm(self, norm: Norm | None) -> Norm | None:
        if norm is None or norm.bias is None or self.rotation is None:
            return norm
        return replace(norm, bias=turned(norm.bias, self.rotation))

    def reads(self, x: torch.Tensor) -> torch.Tensor:
        """What the readers of the stream take for ``x``, the (normalised) stream they read:
        ``x·Qᵀ``, divided by ``g`` where no norm is in between."""
        if self.reader is not None:
            return x @ self.reader
        return x if self.spec.pre_norms else _scaled(x, self, -1)

    def read(self, piece: str, y: torch.Tensor, layer: int) -> torch.Tensor:
        """``y``, outputs of reader ``piece`` (``attn.q``, ``attn.k``, ``attn.v``, ``mlp.up``,
        ``mlp.gate``; its canonical rows last), as the moved weights make them: queries per
        head times the QK map, keys times its inverse transpose, values times the OV map;
        under a QK-norm queries and keys times ``g`` and the maps' signs."""
        if piece in ("attn.q", "attn.k"):
            query = piece == "attn.q"
            if self.spec.qk_norm != "none":
                y = _scaled(y, self, 1)
                if self.qk is not None:
                    y = y * _qk_signs(self.qk[layer], self.spec)[0 if query else 1].to(y.dtype)
            elif self.qk is not None:
                y = _per_head(y, (self.qk if query else self.qk_inverse)[layer])
        elif piece == "attn.v" and self.ov is not None:
            y = _per_head(y, self.ov[layer])
        return y

    def writes_from(self, piece: str, z: torch.Tensor, layer: int) -> torch.Tensor:
        """What writer ``piece`` (``attn.o``, ``mlp.down``) takes for its input ``z`` (its
        canonical columns last): attention outputs per head times the OV map's inverse."""
        if piece == "attn.o" and self.ov is not None:
            z = _per_head(z, self.ov_inverse[layer])
        return z

    def writes(self, y: torch.Tensor) -> torch.Tensor:
        """What a writer adds to the stream for its output ``y``: ``g·y·Q``."""
        return _scaled(y, self, 1) if self.writer is None else y @ self.writer


def activation_actions(
    transforms: list[Transform | None], spec: ModelSpec
) -> list[ActivationAction]:
    """``transforms`` (residual maps, scales and per-head maps; None: the identity) as
    :class:`ActivationAction` s on the models of ``spec`` whose mix is run, the first's
    per-head maps moved onto the others (``M_i·M_0⁻¹``, the first without any): the maps act
    linearly on the weights and a mix moved by one of them computes what it did, so the mix
    is the same and its first model's projections run as they are. Every map of every model
    and layer is inverted in one batched call (a layer without a map has the identity)."""
    identity = Transform(spec.num_layers)
    stacked = {
        (kind, index): maps
        for kind in ("qk", "ov")
        for index, t in enumerate(transforms)
        if (maps := _stacked_maps(t or identity, kind)) is not None
    }
    maps = inverses = {}
    if stacked:
        every = torch.stack(list(stacked.values()))
        every = _invertible(every, every)
        maps = dict(zip(stacked, every.unbind(), strict=True))
        inverses = dict(zip(stacked, torch.linalg.inv(every).unbind(), strict=True))

    def relative(kind: str, index: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Model ``index``'s maps ``M_i·M_0⁻¹`` of ``kind`` and their inverses."""
        own, first = (kind, index), (kind, 0)
        if index == 0 or (own not in maps and first not in maps):
            return None, None
        if first not in maps:
            return maps[own], inverses[own]
        if own not in maps:
            return inverses[first], maps[first]
        return maps[own] @ inverses[first], maps[first] @ inverses[own]

    actions = []
    for index, t in enumerate(transforms):
        qk, qk_inverse = relative("qk", index)
        ov, ov_inverse = relative("ov", index)
        if spec.qk_norm != "none":  # diagonal maps: signs and magnitudes, no inverse
            qk_inverse = None
        elif qk_inverse is not None:
            qk_inverse = qk_inverse.mT
        t = t or identity
        layers = [None if x is None else x.unbind() for x in (qk, qk_inverse, ov, ov_inverse)]
        reader = writer = None
        if t.rotation is not None:
            # A product even for a (signed) permutation: telling one apart syncs a GPU.
            reader = t.rotation.mT if spec.pre_norms else _scaled(t.rotation.mT, t, -1)
            writer = _scaled(t.rotation, t, 1)
        actions.append(ActivationAction(spec, t.rotation, t.scale, *layers, reader, writer))
    return actions


def _stacked_maps(t: Transform, kind: str) -> torch.Tensor | None:
    """The ``kind`` maps (``qk``, ``ov``) of every layer of ``t``, ``(layers, kv, dh, dh)``;
    None where it has none. Permutations are refused: they belong to the weights."""
    if any(layer.head_perm is not None or layer.ffn_perm is not None for layer in t.layers):
        raise ValueError("an activation action has no permutations: apply them to the weights")
    maps = [getattr(layer, kind) for layer in t.layers]
    given = next((m for m in maps if m is not None), None)
    if given is None:
        return None
    eye = torch.eye(given.shape[-1], dtype=given.dtype, device=given.device).expand_as(given)
    return torch.stack([eye if m is None else m for m in maps])


def _per_head(y: torch.Tensor, maps: torch.Tensor) -> torch.Tensor:
    """``y`` (heads × dh last) with each head right-multiplied by its key/value head's map
    (``maps``: ``(kv heads, dh, dh)``; the query heads of a group share their group's), in
    the maps' precision whatever autocast is on: maps rounded to bf16 doubled a bf16 mix's
    error on every family (a map that is not orthogonal amplifies its rounding), at a cost
    ``dh / d`` of the projections'."""
    heads = y.reshape(*y.shape[:-1], len(maps), -1, maps.shape[-1])
    with torch.autocast(y.device.type, enabled=False):
        moved = torch.einsum("...jgb,jba->...jga", heads.to(maps.dtype), maps)
    return moved.reshape(y.shape)
