"""Weight matching: the symmetry that brings one model's weights closest to another's.

Coordinate descent over the symmetry group (reference notes §2, §4):

1. residual rotation by orthogonal Procrustes on the token embeddings and the LM head, which
   correspond row by row in any two models sharing a tokenizer;
2. per layer, with B's residual stream turned into A's basis: query heads assigned by the
   similarity of their QK and OV circuits (invariant to the per-head maps; GQA groups stay
   whole), FFN neurons assigned by the similarity of their weights (scipy's linear assignment),
   then each head's QK and OV maps fitted (:mod:`lmc_mergekit.matching.head_maps`);
3. the rotation refitted on every weight of the model, given those assignments;

repeated until no assignment changes or a round shortens the distance by less than
``tolerance``. Each round is one pass over the layers, reading each block of both models once
(memory: the block being solved, never a model); a layer whose assignment did not change in the
last round is not solved again while the rotation barely moves. The heavy products run in
float32 on ``device``, the small fits (Procrustes, head maps) in float64 on the CPU, and the
linear assignments in scipy. The residual map stays in the group the model admits
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
from dataclasses import dataclass, fields, replace
from functools import cached_property

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
from lmc_mergekit.matching.head_maps import fit_free_maps, fit_normed_qk_maps, fit_rope_maps
from lmc_mergekit.matching.procrustes import residual_procrustes
from lmc_mergekit.models.view import (
    Attention,
    Block,
    Embeddings,
    Head,
    ModelSpec,
    ModelView,
    iter_tensors,
    map_tensors,
    row_chunks,
)
from lmc_mergekit.symmetry import LayerTransform, Transform
from lmc_mergekit.symmetry.actions import (
    apply_layer_transform,
    permute_heads,
    transform_block,
    transform_embeddings,
    transform_head,
)
from lmc_mergekit.symmetry.group import symmetry_group

#: A round that shortens the distance by less than this (relative) ends the descent: far below
#: what the barrier can feel (``benchmarks/weight_matching_barrier.py``).
TOLERANCE = 1e-4
#: While the rotation moves less than this (``||ΔQ||/sqrt(d)``), a layer whose assignment held
#: in the last round keeps it without being solved again.
STEADY_ROTATION = 1e-3
#: Where the heavy products run (the fits and the assignments run in float64 on the CPU).
WORK_DTYPE = torch.float32
#: Token rows of the embeddings and the head worked on at a time: the descent holds a block of
#: each model and this many rows, never a whole embedding (2 GB in float32 at 256k × 2304).
ROW_CHUNK = 16384


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
    #: Per round, how many layers had their heads and neurons assigned afresh.
    solved: tuple[int, ...] = ()


def match_weights(
    reference: ModelView,
    other: ModelView,
    *,
    max_iterations: int = 30,
    tolerance: float = TOLERANCE,
    device: torch.device | str = "cpu",
    progress: bool = False,
    keep_tie: bool = False,
) -> MatchResult:
    """The symmetry of ``other`` (norms absorbed, rotation, scale, head and neuron permutations,
    per-head maps) that brings its weights closest to ``reference``'s; with ``keep_tie``, one
    that keeps tied embeddings tied (a signed-permutation residual map, the final norm kept)."""
    start = time.perf_counter()
    spec = reference.spec
    mismatch = spec.shape_mismatch(other.spec)
    if mismatch is not None:
        raise LmcError(
            "weight matching needs two models of one shape: {} is {} vs {}".format(*mismatch)
        )
    device = torch.device(device)
    a, b = _Working(reference, device, keep_tie), _Working(other, device, keep_tie)
    group = symmetry_group(spec, keep_tie).residual
    scale = math.sqrt(spec.norm_eps / other.spec.norm_eps)
    # Embeddings and heads correspond row by row and no assignment moves them: their share of
    # every round's cross-correlation is this one.
    outside = _cross(a, b, scale)
    rotation = residual_procrustes(outside, group)
    distances = [_distance(a, b)]
    best = None
    layers: list[LayerTransform | None] = [None] * spec.num_layers
    steady = [False] * spec.num_layers
    solved: list[int] = []
    bar = tqdm(total=max_iterations, desc="weight matching", disable=not progress, leave=False)
    iterations = 0
    moved_by = math.inf
    while iterations < max_iterations:
        iterations += 1
        round_ = _round(
            a, b, spec, rotation, scale, outside, layers, steady, moved_by, bar, iterations
        )
        layers, changed = round_.layers, round_.changed
        candidate = Transform(spec.num_layers, True, rotation, scale, tuple(layers), keep_tie)
        distances.append(round_.distance)
        solved.append(round_.solved)
        bar.update()
        # The steps fit slightly different objectives (circuit cosines, balanced head maps), so
        # the descent can cycle once it has settled: stop when a round no longer helps.
        if best is not None and distances[-1] >= best[0] * (1 - tolerance):
            break
        best = (distances[-1], candidate)
        if iterations > 1 and not any(changed):
            break
        steady = [not c for c in changed]
        new_rotation = residual_procrustes(round_.cross, group)
        moved_by = float((new_rotation - rotation).norm()) / math.sqrt(spec.hidden_size)
        rotation = new_rotation
    bar.close()
    return MatchResult(
        transform=best[1],
        distance=best[0],
        iterations=iterations,
        distances=tuple(distances),
        seconds=time.perf_counter() - start,
        solved=tuple(solved),
    )


@dataclass
class _Round:
    layers: list[LayerTransform]
    changed: list[bool]
    distance: float
    #: The cross-correlation the next rotation is fitted to (B permuted by these layers).
    cross: torch.Tensor
    solved: int


def _round(
    a, b, spec, rotation, scale, outside, previous, steady, moved_by, bar, iteration
) -> _Round:
    """One pass over the model: B turned by ``rotation``, every layer assigned (or kept), the
    distance of the result, and the cross-correlation for the next rotation (``outside``: the
    embeddings' and heads' share of it)."""
    turn = Transform(spec.num_layers, True, rotation, scale, keep_tie=a.keep_tie).to(WORK_DTYPE)
    turn = replace(turn, rotation=turn.rotation.to(a.device))
    acc = _Accumulator(scale, a.keep_tie)
    acc.cross = outside.to(a.device)
    for part_a, part_b, first in _outside(a, b):
        moved = _move_outside(part_b, turn)
        acc.add_distance(*_counted(part_a, moved, first))
    layers, changed, solved = [], [], 0
    for index in range(spec.num_layers):
        bar.set_postfix_str(f"round {iteration}, layer {index + 1}/{spec.num_layers}")
        block_a, block_b = a.block(index), b.block(index)
        turned = transform_block(block_b, spec, turn, index)
        keep = previous[index] is not None and steady[index] and moved_by < STEADY_ROTATION
        layer = match_layer(block_a, turned, spec, previous[index], keep)
        solved += not keep
        changed.append(previous[index] is None or not _same_assignment(layer, previous[index]))
        layers.append(layer)
        work = _in_dtype(layer, WORK_DTYPE, a.device)
        acc.add_distance(block_a, apply_layer_transform(turned, spec, work))
        acc.add_cross(block_a, apply_layer_transform(block_b, spec, work))
    distance = acc.distance()
    bar.set_postfix_str(f"round {iteration}: distance {distance:.4f}, {solved} layers solved")
    return _Round(layers, changed, distance, acc.cross.cpu(), solved)


class _Accumulator:
    """Sums, part by part, ``||B' - A||²`` and ``||A||²`` (B' = B moved) and the
    cross-correlation ``Σ X_Bᵀ·X_A`` of the residual rows of B permuted (not turned)."""

    def __init__(self, scale: float, keep_tie: bool = False):
        self.diff = self.total = 0.0
        self.cross = None
        self.scale = scale
        self.keep_tie = keep_tie

    def add_distance(self, part_a, moved) -> None:
        for (_, ta), (_, tb) in zip(iter_tensors(part_a), iter_tensors(moved), strict=True):
            self.diff += float((ta - tb).double().pow(2).sum())
            self.total += float(ta.double().pow(2).sum())

    def add_cross(self, part_a, part_b) -> None:
        rows_a, rows_b = (_rows(part, self.keep_tie) for part in (part_a, part_b))
        for (xa, writes), (xb, _) in zip(rows_a, rows_b, strict=True):
            term = (xb.T @ xa).double()
            term = term * self.scale if writes else term
            self.cross = term if self.cross is None else self.cross + term

    def distance(self) -> float:
        return (self.diff / max(self.total, 1e-300)) ** 0.5


def _rows(part, tied_head: bool = False) -> Iterator[tuple[torch.Tensor, bool]]:
    """(rows ``X`` of a part that move as ``X·Q`` with the residual stream, written to it?); a
    head kept tied to the embeddings moves as they do (``W ← g·W·Q``)."""
    if isinstance(part, Embeddings):
        yield part.tokens, True
        if part.positions is not None:
            yield part.positions, True
        return
    if isinstance(part, Head):
        yield part.weight, tied_head
        if part.norm.bias is not None:
            yield part.norm.bias[None], False
        return
    attn, mlp = part.attn, part.mlp
    for reader in (attn.q, attn.k, attn.v, mlp.up, mlp.gate):
        if reader is not None:
            yield reader, False
    for norm in (part.attn_norm, part.mlp_norm):
        if norm is not None and norm.bias is not None:
            yield norm.bias[None], False
    yield attn.o.T, True
    yield mlp.down.T, True
    for bias in (attn.o_bias, mlp.down_bias):
        if bias is not None:
            yield bias[None], True


def _cross(a, b, scale: float) -> torch.Tensor:
    """The cross-correlation of the embeddings and the heads of ``b`` and ``a``: they
    correspond row by row in any two models sharing a tokenizer."""
    acc = _Accumulator(scale, a.keep_tie)
    for part_a, part_b, first in _outside(a, b):
        acc.add_cross(*_counted(part_a, part_b, first))
    return acc.cross.cpu()


def _distance(a, b) -> float:
    """``||B - A|| / ||A||`` over every weight."""
    acc = _Accumulator(1.0)
    for part_a, part_b, first in _outside(a, b):
        acc.add_distance(*_counted(part_a, part_b, first))
    for index in range(a.spec.num_layers):
        acc.add_distance(a.block(index), b.block(index))
    return acc.distance()


def _outside(
    a: _Working, b: _Working
) -> Iterator[tuple[Embeddings | Head, Embeddings | Head, bool]]:
    """The embeddings, then the heads, of ``a`` and ``b`` side by side, :data:`ROW_CHUNK`
    rows at a time, and whether the chunk is its part's first (the only one whose other
    tensors, such as the final norm, count)."""
    for read in ("embeddings", "head"):
        for index, (part_a, part_b) in enumerate(zip(a.chunks(read), b.chunks(read), strict=True)):
            yield part_a, part_b, index == 0


def _move_outside(part: Embeddings | Head, turn: Transform) -> Embeddings | Head:
    if isinstance(part, Embeddings):
        return transform_embeddings(part, turn)
    return transform_head(part, turn)


def _counted(part_a, part_b, first: bool) -> tuple:
    """Both chunks as they count: whole for a part's first chunk, only their rows after it."""
    if first:
        return part_a, part_b
    return _rows_only(part_a), _rows_only(part_b)


def _rows_only(part: Embeddings | Head) -> Embeddings | Head:
    if isinstance(part, Embeddings):
        return replace(part, **{f.name: None for f in fields(part) if f.name != "tokens"})
    return replace(part, norm=replace(part.norm, weight=part.norm.weight[:0], bias=None))


def match_layer(
    a: Block,
    b: Block,
    spec: ModelSpec,
    previous: LayerTransform | None = None,
    keep: bool = False,
) -> LayerTransform:
    """Head and neuron permutations and per-head maps moving block ``b`` onto block ``a``
    (both already in one residual basis), starting from the ``previous`` round's assignment;
    with ``keep``, its permutations are kept and only the maps fitted. Maps and permutations
    come back in float64 on the CPU."""
    attn_a, attn_b = (map_tensors(x.attn, _cpu64) for x in (a, b))
    if keep and previous is not None:
        head_perm, ffn_perm = previous.head_perm, previous.ffn_perm
    else:
        head_perm = match_heads(head_similarity(attn_a, attn_b, spec), spec.num_kv_heads)
        current = None if previous is None else previous.ffn_perm
        ffn_perm, _ = best_permutation(_cpu64(neuron_similarity(a.mlp, b.mlp)), current)
    attn = permute_heads(attn_b, spec, head_perm)
    if symmetry_group(spec).qk_maps:
        xa, ya = circuit_blocks(attn_a, spec, "qk")
        xb, yb = circuit_blocks(attn, spec, "qk")
        qk = fit_rope_maps(xa, ya, xb, yb, spec.rotary_dims).mT
    else:
        xa, ya = circuit_blocks(_gained(attn_a, spec), spec, "qk")
        xb, yb = circuit_blocks(_gained(attn, spec), spec, "qk")
        gains = qk_gains(attn_a, spec), qk_gains(attn, spec)
        qk = fit_normed_qk_maps(xa, ya, xb, yb, *gains, spec.rotary_dims)
    xa, ya = circuit_blocks(attn_a, spec, "ov")
    xb, yb = circuit_blocks(attn, spec, "ov")
    ov = fit_free_maps(xa, ya, xb, yb)
    # The fitted A act on rows (X ← A·X); the transform stores M with W_q ← Mᵀ·W_q, i.e. Aᵀ.
    return LayerTransform(head_perm=head_perm, ffn_perm=ffn_perm, qk=qk, ov=ov.mT)


def qk_gains(attn: Attention, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The magnitudes of the query and key norm gains as ``(heads, dh)``: one row when every
    head shares them, else per key/value group (a group's query gain: the geometric mean of its
    heads')."""
    q, k = attn.q_norm.gain.abs(), attn.k_norm.gain.abs()
    if spec.qk_norm == "head":
        return q[None], k[None]
    q = q.reshape(spec.num_kv_heads, spec.group_size, spec.head_dim)
    q = q.clamp_min(torch.finfo(q.dtype).tiny).log().mean(1).exp()
    return q, k.reshape(spec.num_kv_heads, spec.head_dim)


def _gained(attn: Attention, spec: ModelSpec) -> Attention:
    """``attn`` with each query and key row (and bias) times its QK-norm gain."""
    q_gain, k_gain = attn.q_norm.gain, attn.k_norm.gain
    if spec.qk_norm == "head":
        q_gain = q_gain.repeat(spec.num_heads)
        k_gain = k_gain.repeat(spec.num_kv_heads)
    return replace(
        attn,
        q=attn.q * q_gain[:, None],
        k=attn.k * k_gain[:, None],
        q_bias=None if attn.q_bias is None else attn.q_bias * q_gain,
        k_bias=None if attn.k_bias is None else attn.k_bias * k_gain,
    )


def _same_assignment(x: LayerTransform, y: LayerTransform) -> bool:
    return torch.equal(x.head_perm, y.head_perm) and torch.equal(x.ffn_perm, y.ffn_perm)


def _in_dtype(layer: LayerTransform, dtype: torch.dtype, device: torch.device) -> LayerTransform:
    """``layer`` with its maps in ``dtype`` and everything on ``device``."""

    def move(x):
        if x is None:
            return None
        return x.to(device, dtype) if x.is_floating_point() else x.to(device)

    return LayerTransform(*(move(x) for x in (layer.head_perm, layer.ffn_perm, layer.qk, layer.ov)))


def _cpu64(x: torch.Tensor) -> torch.Tensor:
    return x.to("cpu", torch.float64)


@dataclass(frozen=True)
class _Working:
    """``view`` with its norms absorbed, in the working dtype on ``device``, part by part on
    each access: the descent keeps no model in memory, only the parts it is working on (a
    checkpoint-backed view reads them again each round). The absorption runs in the working
    dtype too: what is written is computed again from the checkpoints, in float64."""

    view: ModelView
    device: torch.device
    keep_tie: bool = False

    @property
    def spec(self) -> ModelSpec:
        return self.view.spec

    @cached_property
    def _absorb(self) -> Transform:
        return Transform(self.spec.num_layers, absorb_norms=True, keep_tie=self.keep_tie)

    def _work(self, part):
        return map_tensors(part, lambda t: t.to(self.device, WORK_DTYPE))

    def chunks(self, read: str) -> Iterator[Embeddings | Head]:
        """The embeddings (``read``: ``embeddings``) or the head (``head``), :data:`ROW_CHUNK`
        token rows at a time, each chunk with the rest of its part (see
        :func:`~lmc_mergekit.models.view.row_chunks`)."""
        for part in row_chunks(self.view, read, ROW_CHUNK):
            yield _move_outside(self._work(part), self._absorb)

    def block(self, index: int) -> Block:
        return transform_block(self._work(self.view.block(index)), self.spec, self._absorb, index)
