"""Weight matching: the symmetry that brings one model's weights closest to another's.

Coordinate descent over the symmetry group (reference notes §2, §4):

1. residual rotation by orthogonal Procrustes on the token embeddings and the LM head, which
   correspond row by row in any two models sharing a tokenizer;
2. per layer, with B's residual stream turned into A's basis: query heads assigned by the
   similarity of their QK and OV circuits (invariant to the per-head maps; GQA groups stay
   whole), FFN neurons assigned by the similarity of their weights (scipy's linear assignment),
   then each head's QK and OV maps fitted (:mod:`lmc_mergekit.matching.head_maps`);
3. the rotation refitted on every weight of the model, given those assignments;

repeated until no assignment changes. The residual map stays in the group the model admits
(:mod:`lmc_mergekit.symmetry.group`): rotations fixing the all-ones vector for LayerNorm models,
signed permutations (found by linear assignment) for post-norm ones; QK maps are not fitted
where queries and keys are normalised. Both models are compared with their norms absorbed.

The global residual scale ``g`` is not fitted: it is the one symmetry that changes config.json
(the norms' eps becomes ``eps·g²``), and a merged checkpoint has a single eps. So ``g`` is pinned
to ``sqrt(eps_A / eps_B)``: 1 for models trained with one eps, and exactly the inverse of the
scale of a scrambled copy (whose config carries ``eps·g²``). Either way both endpoints keep
their exact function under the shared eps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from lmc_mergekit.errors import LmcError
from lmc_mergekit.matching.assignment import (
    best_permutation,
    circuit_blocks,
    head_similarity,
    match_heads,
    neuron_similarity,
)
from lmc_mergekit.matching.head_maps import fit_free_maps, fit_rope_maps
from lmc_mergekit.matching.procrustes import residual_procrustes
from lmc_mergekit.models.view import (
    Block,
    InMemoryView,
    ModelSpec,
    ModelView,
    iter_tensors,
    map_tensors,
    materialize,
)
from lmc_mergekit.symmetry import LayerTransform, Transform, apply_transform
from lmc_mergekit.symmetry.actions import permute_heads
from lmc_mergekit.symmetry.group import Residual, symmetry_group

# A round that shortens the distance by less than this (relative) ends the descent.
CONVERGED = 1e-6


@dataclass(frozen=True)
class MatchResult:
    """The transform moving B onto A, and how the descent went."""

    transform: Transform
    iterations: int
    #: ``||B' - A|| / ||A||`` over all weights (norms absorbed), before and after each iteration.
    distances: tuple[float, ...]
    #: That distance for the returned transform (the best round).
    distance: float
    seconds: float


def match_weights(
    reference: ModelView, other: ModelView, *, max_iterations: int = 30, progress: bool = False
) -> MatchResult:
    """The symmetry of ``other`` (norms absorbed, rotation, scale, head and neuron permutations,
    per-head maps) that brings its weights closest to ``reference``'s."""
    start = time.perf_counter()
    spec = reference.spec
    mismatch = spec.shape_mismatch(other.spec)
    if mismatch is not None:
        raise LmcError(
            "weight matching needs two models of one shape: {} is {} vs {}".format(*mismatch)
        )
    absorb = Transform(spec.num_layers, absorb_norms=True)
    a = _float64(apply_transform(reference, absorb))
    b = _float64(apply_transform(other, absorb))
    group = symmetry_group(spec).residual
    scale = math.sqrt(spec.norm_eps / other.spec.norm_eps)
    rotation = _fit_rotation(a, b, group, scale, whole_model=False)
    distances = [_distance(a, b, Transform(spec.num_layers, absorb_norms=True))]
    previous = None
    best = None
    bar = tqdm(total=max_iterations, desc="weight matching", disable=not progress, leave=False)
    iterations = 0
    while iterations < max_iterations:
        iterations += 1
        turned = apply_transform(b, Transform(spec.num_layers, True, rotation, scale))
        layers = tuple(
            match_layer(a.block(i), turned.block(i), spec) for i in range(spec.num_layers)
        )
        candidate = Transform(spec.num_layers, True, rotation, scale, layers)
        distances.append(_distance(a, b, candidate))
        bar.update()
        bar.set_postfix(distance=f"{distances[-1]:.4f}")
        # The steps fit slightly different objectives (circuit cosines, balanced head maps), so
        # the descent can cycle once it has settled: stop when a round no longer helps.
        if best is not None and distances[-1] >= best[0] * (1 - CONVERGED):
            break
        best = (distances[-1], candidate)
        assignment = [(layer.head_perm.tolist(), layer.ffn_perm.tolist()) for layer in layers]
        if assignment == previous:
            break
        previous = assignment
        permuted = apply_transform(b, Transform(spec.num_layers, True, layers=layers))
        rotation = _fit_rotation(a, permuted, group, scale, whole_model=True)
    bar.close()
    return MatchResult(
        transform=best[1],
        distance=best[0],
        iterations=iterations,
        distances=tuple(distances),
        seconds=time.perf_counter() - start,
    )


def match_layer(a: Block, b: Block, spec: ModelSpec) -> LayerTransform:
    """Head and neuron permutations and per-head maps moving block ``b`` onto block ``a``
    (both already in one residual basis)."""
    head_perm = match_heads(head_similarity(a.attn, b.attn, spec), spec.num_kv_heads)
    ffn_perm, _ = best_permutation(neuron_similarity(a.mlp, b.mlp))
    attn = permute_heads(b.attn, spec, head_perm)
    qk = None
    if symmetry_group(spec).qk_maps:
        xa, ya = circuit_blocks(a.attn, spec, "qk")
        xb, yb = circuit_blocks(attn, spec, "qk")
        qk = fit_rope_maps(xa, ya, xb, yb, spec.rotary_dims).mT
    xa, ya = circuit_blocks(a.attn, spec, "ov")
    xb, yb = circuit_blocks(attn, spec, "ov")
    ov = fit_free_maps(xa, ya, xb, yb)
    # The fitted A act on rows (X ← A·X); the transform stores M with W_q ← Mᵀ·W_q, i.e. Aᵀ.
    return LayerTransform(head_perm=head_perm, ffn_perm=ffn_perm, qk=qk, ov=ov.mT)


def _float64(view: ModelView) -> InMemoryView:
    model = materialize(view)
    return InMemoryView(
        spec=model.spec,
        embeddings_=map_tensors(model.embeddings_, torch.Tensor.double),
        blocks=[map_tensors(block, torch.Tensor.double) for block in model.blocks],
        head_=map_tensors(model.head_, torch.Tensor.double),
    )


def _residual_rows(view: ModelView, whole_model: bool) -> Iterator[tuple[torch.Tensor, bool]]:
    """(rows ``X`` that move as ``X·Q`` with the residual stream, written to it?)."""
    emb = view.embeddings()
    yield emb.tokens, True
    if emb.positions is not None:
        yield emb.positions, True
    head = view.head()
    yield head.weight, False
    if head.norm.bias is not None:
        yield head.norm.bias[None], False
    if not whole_model:
        return
    for index in range(view.spec.num_layers):
        block = view.block(index)
        attn, mlp = block.attn, block.mlp
        for reader in (attn.q, attn.k, attn.v, mlp.up, mlp.gate):
            if reader is not None:
                yield reader, False
        for norm in (block.attn_norm, block.mlp_norm):
            if norm is not None and norm.bias is not None:
                yield norm.bias[None], False
        yield attn.o.T, True
        yield mlp.down.T, True
        for bias in (attn.o_bias, mlp.down_bias):
            if bias is not None:
                yield bias[None], True


def _fit_rotation(
    a: ModelView, b: ModelView, group: Residual, scale: float, whole_model: bool
) -> torch.Tensor:
    """Procrustes rotation ``Q`` for ``X_B·Q ≈ X_A`` over all residual rows (writers of B
    scaled by ``scale``)."""
    d = a.spec.hidden_size
    cross = torch.zeros(d, d, dtype=torch.float64)
    for (xa, writes), (xb, _) in zip(
        _residual_rows(a, whole_model), _residual_rows(b, whole_model), strict=True
    ):
        cross += (scale if writes else 1.0) * (xb.T @ xa)
    return residual_procrustes(cross, group)


def _distance(a: ModelView, b: ModelView, transform: Transform) -> float:
    """``||B' - A|| / ||A||`` over every weight, B' being ``b`` moved by ``transform``."""
    moved = apply_transform(b, transform)
    diff = total = 0.0
    parts = [(a.embeddings(), moved.embeddings()), (a.head(), moved.head())]
    parts += [(a.block(i), moved.block(i)) for i in range(a.spec.num_layers)]
    for part_a, part_b in parts:
        for (_, ta), (_, tb) in zip(iter_tensors(part_a), iter_tensors(part_b), strict=True):
            diff += float((ta - tb).pow(2).sum())
            total += float(ta.pow(2).sum())
    return (diff / max(total, 1e-300)) ** 0.5
