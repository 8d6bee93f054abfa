"""A transform acting on a block's activations instead of on its weights, for learned
matching's mixes: :class:`ActivationAction` and :func:`activation_actions`, which makes them.
The norms still move in weight space, with :mod:`.weight_actions`' functions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lmc_mergekit.models.view import Block, ModelSpec, Norm
from lmc_mergekit.symmetry.transform import Transform
from lmc_mergekit.symmetry.weight_actions import (
    invertible,
    normed_qk_parts,
    qk_signs,
    scaled,
    transform_post_norm,
    turned,
)


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
        :func:`~.weight_actions.transform_block` moves them: a bias kept in a pre-norm turns
        with the stream, post-norm gains move by ``g·|Q|``, QK-norm gains by the QK maps'
        magnitudes; its projections as they are (:meth:`reads` and the others move them)."""
        attn = block.attn
        if self.qk is not None and self.spec.qk_norm != "none":
            _, _, q_norm, k_norm = normed_qk_parts(attn, self.spec, self.qk[layer])
            attn = replace(attn, q_norm=q_norm, k_norm=k_norm)
        return replace(
            block,
            attn_norm=self._pre_norm(block.attn_norm),
            mlp_norm=self._pre_norm(block.mlp_norm),
            attn=attn,
            attn_post_norm=transform_post_norm(block.attn_post_norm, self),
            mlp_post_norm=transform_post_norm(block.mlp_post_norm, self),
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
        return x if self.spec.pre_norms else scaled(x, self, -1)

    def read(self, piece: str, y: torch.Tensor, layer: int) -> torch.Tensor:
        """``y``, outputs of reader ``piece`` (``attn.q``, ``attn.k``, ``attn.v``, ``mlp.up``,
        ``mlp.gate``; its canonical rows last), as the moved weights make them: queries per
        head times the QK map, keys times its inverse transpose, values times the OV map;
        under a QK-norm queries and keys times ``g`` and the maps' signs."""
        if piece in ("attn.q", "attn.k"):
            query = piece == "attn.q"
            if self.spec.qk_norm != "none":
                y = scaled(y, self, 1)
                if self.qk is not None:
                    y = y * qk_signs(self.qk[layer], self.spec)[0 if query else 1].to(y.dtype)
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
        return scaled(y, self, 1) if self.writer is None else y @ self.writer


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
        every = invertible(every, every)
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
            reader = t.rotation.mT if spec.pre_norms else scaled(t.rotation.mT, t, -1)
            writer = scaled(t.rotation, t, 1)
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
