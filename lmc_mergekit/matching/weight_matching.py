"""Weight matching: the symmetry that brings one model's weights closest to another's.

Coordinate descent over the symmetry group (reference notes §2, §4):

1. residual rotation by orthogonal Procrustes on the token embeddings and the LM head, which
   correspond row by row in any two models sharing a tokenizer;
2. per layer, with B's residual stream turned into A's basis: query heads assigned by the
   similarity of their QK and OV circuits (invariant to the per-head maps; GQA groups stay
   whole), FFN neurons assigned by the similarity of their weights (scipy's linear assignment),
   then each head's QK and OV maps fitted (:mod:`lmc_mergekit.matching.head_maps`);
3. the rotation refitted on every weight of the model, given those assignments;

repeated until no assignment changes, the refitted rotation no longer moves, a round shortens
the distance by less than ``tolerance``, a round brings B within twice its storage rounding of
A (B is A moved by a symmetry and rounded: a scramble is undone in one round, and a second
would only confirm it), or ``max_iterations`` rounds have run (:attr:`MatchResult.stopped`
says which). Each round is one pass over the layers, reading each
block of both models once (memory: the block being solved, never a model); a layer whose
assignment did not change in the last round is not solved again while the rotation barely
moves. The moves run in float32 on ``device``, the similarities that only rank heads and
neurons in bf16 where the device multiplies it natively
(:func:`~lmc_mergekit.matching.assignment.similarity_dtype`), the neurons' in int8 on a CPU
with VNNI or AMX (:func:`~lmc_mergekit.matching.assignment.neuron_similarity`), the small
fits (Procrustes, head maps) in float64 on the CPU, and the linear assignments in scipy. A
round known to be the last (the ``max_iterations``-th) fits no next rotation. Given writers,
the first round hands the reference's parts (norms absorbed, as it is written) and the first
and the last round the moved parts of ``other`` to them (the first's writer is kept where it is
the result), so that checkpoints stored in 16 bits are written and checked without moving any
block again (:class:`~lmc_mergekit.transform_checkpoint.CheckedWriter`). In the first round
each layer's neurons are first assigned from a random projection of their weights, kept where
that lands the layer within B's storage rounding of A (a scramble), solved exactly elsewhere.
The residual map stays in the group the model admits (:mod:`lmc_mergekit.symmetry.group`):
rotations fixing the all-ones vector for LayerNorm models, signed permutations (found by
linear assignment) for post-norm ones; QK maps are not fitted where queries and keys are
normalised. Both models are compared with their norms absorbed.

The global residual scale ``g`` is not fitted: it is the one symmetry that changes config.json
(the norms' eps becomes ``eps·g²``), and a merged checkpoint has a single eps. So ``g`` is pinned
to ``sqrt(eps_A / eps_B)``: 1 for models trained with one eps, and exactly the inverse of the
scale of a scrambled copy (whose config carries ``eps·g²``). Either way both endpoints keep
their exact function under the shared eps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Protocol

import torch
from tqdm.auto import tqdm

from lmc_mergekit.errors import LmcError
from lmc_mergekit.matching.assignment import (
    best_permutation,
    circuit_blocks,
    head_similarity,
    match_heads,
    neuron_similarity,
    proposed_permutation,
    similarity_dtype,
)
from lmc_mergekit.matching.head_maps import fit_free_maps, fit_normed_qk_maps, fit_rope_maps
from lmc_mergekit.matching.procrustes import residual_procrustes
from lmc_mergekit.models.checkpoint import row_slices
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
from lmc_mergekit.symmetry.group import symmetry_group
from lmc_mergekit.symmetry.weight_actions import (
    apply_layer_transform,
    compute_dtype,
    permute_heads,
    transform_block,
    transform_embeddings,
    transform_head,
)

#: A round that shortens the distance by less than this (relative) ends the descent: far below
#: what the barrier can feel (``benchmarks/weight_matching_barrier.py``).
TOLERANCE = 1e-4
#: While the rotation moves less than this (``||ΔQ||/sqrt(d)``), a layer whose assignment held
#: in the last round keeps it without being solved again.
STEADY_ROTATION = 1e-3
#: A rotation refitted this close to the last round's (float32 products' noise) would have the
#: next round solve the same problems again: the descent has settled (a scramble, undone in
#: one round, stops there).
SETTLED_ROTATION = 1e-5
#: A round that brings B within this many times its storage rounding of A (the distance that
#: rounding B's weights to their dtype alone leaves) has found the symmetry: B is A moved and
#: rounded, and no round can shorten the distance further (a scramble, undone in one round).
ROUNDING_FLOOR = 2.0
#: Elements of a stored tensor whose rounding is measured at a time, and the rows measured (one
#: in this many: the rounding of a row is a sample of the tensor's).
ROUNDING_ELEMENTS = 1 << 22
ROUNDING_STRIDE = 8
#: Where the heavy products run (the fits and the assignments run in float64 on the CPU).
WORK_DTYPE = torch.float32
#: Token rows of the embeddings and the head worked on at a time: the descent holds a block of
#: each model and this many rows, never a whole embedding (2 GB in float32 at 256k × 2304).
ROW_CHUNK = 16384


class PartsWriter(Protocol):
    """What takes a moved model's exact parts as they are computed (embeddings slices, blocks
    in order with their source blocks, head slices): a
    :class:`~lmc_mergekit.transform_checkpoint.CheckedWriter`."""

    def embeddings(self, exact: Embeddings) -> None: ...

    def block(self, index: int, exact: Block, source: Block | None = None) -> None: ...

    def head(self, exact: Head) -> None: ...

    def discard(self) -> None: ...


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
    #: Why the descent stopped, in words.
    stopped: str = ""
    #: The writer that took the returned transform's moved parts of B (the first or the last
    #: round's), if any.
    written: PartsWriter | None = None
    #: The writer that took A's parts (norms absorbed: every round's are alike), if any.
    written_reference: PartsWriter | None = None
    #: Whether the result lies within :data:`ROUNDING_FLOOR` × B's storage rounding of A: B is
    #: A moved by this symmetry and rounded.
    at_rounding_floor: bool = False


def match_weights(
    reference: ModelView,
    other: ModelView,
    *,
    max_iterations: int = 30,
    tolerance: float = TOLERANCE,
    device: torch.device | str = "cpu",
    progress: bool = False,
    keep_tie: bool = False,
    writer: Callable[[ModelSpec], PartsWriter] | None = None,
    reference_writer: Callable[[ModelSpec], PartsWriter] | None = None,
) -> MatchResult:
    """The symmetry of ``other`` (norms absorbed, rotation, scale, head and neuron permutations,
    per-head maps) that brings its weights closest to ``reference``'s; with ``keep_tie``, one
    that keeps tied embeddings tied (a signed-permutation residual map, the final norm kept).
    ``writer(moved spec)`` makes the writer the last round hands its moved parts of ``other``
    to, where ``other`` is stored in 16 bits (see the module docstring); it is discarded
    unless that round's transform is the result. ``reference_writer(spec)`` makes the one the
    first round hands ``reference``'s parts (norms absorbed) to, where it is stored in 16
    bits."""
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
    distances: list[float] = []
    best = None
    layers: list[LayerTransform | None] = [None] * spec.num_layers
    steady = [False] * spec.num_layers
    solved: list[int] = []
    bar = tqdm(total=max_iterations, desc="weight matching", disable=not progress, leave=False)
    iterations, stopped = 0, f"max_iterations ({max_iterations}) rounds ran"
    moved_by = math.inf
    floor = 0.0  # B's storage rounding, measured in the first round
    at_floor = False
    sinks: list[PartsWriter] = []  # B's writers: each discarded unless its round is the result
    made = reference_writer is not None and _written_as_computed(a)
    reference_sink = reference_writer(reference.spec) if made else None
    try:
        while iterations < max_iterations:
            iterations += 1
            last = iterations == max_iterations
            # The first round is written too, as it goes: it is the last where it reaches the
            # rounding floor (a scramble, a copy), and B is then never moved twice.
            made = (last or iterations == 1) and writer is not None and _written_as_computed(b)
            # Norms normalise away the scale g exactly when their eps scales by g².
            moved_spec = replace(other.spec, norm_eps=other.spec.norm_eps * scale**2)
            sink = writer(moved_spec) if made else None
            if sink is not None:
                sinks.append(sink)
            round_ = _round(
                a,
                b,
                spec,
                _Turn(rotation, scale),
                outside,
                layers,
                steady,
                moved_by,
                bar,
                iterations,
                last,
                (reference_sink if iterations == 1 else None, sink),
            )
            layers, changed = round_.layers, round_.changed
            candidate = Transform(spec.num_layers, True, rotation, scale, tuple(layers), keep_tie)
            if iterations == 1:
                distances.append(round_.before)
            distances.append(round_.distance)
            solved.append(round_.solved)
            bar.update()
            # The steps fit slightly different objectives (circuit cosines, balanced head
            # maps), so the descent can cycle once it has settled: stop when a round no longer
            # helps.
            if best is not None and distances[-1] >= best[0] * (1 - tolerance):
                stopped = (
                    f"round {iterations} shortened the distance by less than {tolerance:g} "
                    f"(relative): round {iterations - 1}'s result kept"
                )
                break
            best = (distances[-1], candidate, sink)
            if iterations > 1 and not any(changed):
                stopped = f"no assignment changed in round {iterations}"
                break
            if last:
                break
            floor = round_.floor or floor
            if distances[-1] <= ROUNDING_FLOOR * floor:
                at_floor = True
                stopped = (
                    f"round {iterations} brought the distance to {distances[-1]:.2e}, within "
                    f"{ROUNDING_FLOOR:g} × the rounding of the stored weights "
                    f"({floor:.2e}): no round can shorten it"
                )
                break
            steady = [not c for c in changed]
            new_rotation = residual_procrustes(round_.cross, group)
            moved_by = float((new_rotation - rotation).norm()) / math.sqrt(spec.hidden_size)
            if moved_by < SETTLED_ROTATION:
                stopped = (
                    f"the rotation refitted after round {iterations} moved by {moved_by:.1e}: "
                    "a next round would assign every layer as this one did"
                )
                break
            rotation = new_rotation
    except BaseException:
        for made in [*sinks, reference_sink]:
            if made is not None:
                made.discard()
        raise
    finally:
        bar.close()
    for made in sinks:
        if made is not best[2]:
            made.discard()
    return MatchResult(
        transform=best[1],
        distance=best[0],
        iterations=iterations,
        distances=tuple(distances),
        seconds=time.perf_counter() - start,
        solved=tuple(solved),
        stopped=stopped,
        written=best[2],
        written_reference=reference_sink,
        at_rounding_floor=at_floor,
    )


def _written_as_computed(view: _Working) -> bool:
    """Whether the parts of ``view`` that a round moves in :data:`WORK_DTYPE` are what a
    writer would compute (a model stored in 16 bits; one stored in float32 is moved in float64
    to be written)."""
    parts = [view.view.block(0)] + [
        next(row_chunks(view.view, read, 1)) for read in ("embeddings", "head")
    ]
    return all(compute_dtype(part) == WORK_DTYPE for part in parts)


@dataclass(frozen=True)
class _Turn:
    """A round's residual map and scale (float64, as the transform keeps them)."""

    rotation: torch.Tensor
    scale: float


@dataclass
class _Round:
    layers: list[LayerTransform]
    changed: list[bool]
    distance: float
    #: The distance of the models as they are (norms absorbed), measured on the way.
    before: float
    #: The cross-correlation the next rotation is fitted to (B permuted by these layers);
    #: None after a last round.
    cross: torch.Tensor | None
    solved: int
    #: The distance that rounding B's stored blocks to their dtype alone accounts for
    #: (relative, as ``distance``), measured in the first round (0 after it).
    floor: float


def _round(
    a, b, spec, turn, outside, previous, steady, moved_by, bar, iteration, last, sinks
) -> _Round:
    """One pass over the model: B turned by ``turn``, every layer assigned (or kept), the
    distance of the result, and unless ``last`` the cross-correlation for the next rotation
    (``outside``: the embeddings' and heads' share of it). A's parts (norms absorbed) and the
    parts of B moved by the round's transform go to ``sinks`` (embeddings, blocks, head, in
    that order) where they are given."""
    sink_a, sink = sinks
    moving = Transform(spec.num_layers, True, turn.rotation, turn.scale, keep_tie=a.keep_tie)
    moving = moving.to(WORK_DTYPE)
    moving = replace(moving, rotation=moving.rotation.to(a.device))
    acc = _Accumulator(turn.scale, a.keep_tie)
    acc.cross = None if last else outside.to(a.device)
    before = _Accumulator(1.0) if iteration == 1 else None

    def outside_part(read: str) -> None:
        for part_a, part_b, first in _outside(a, b, read):
            moved = _move_outside(part_b, moving)
            acc.add_distance(*_counted(part_a, moved, first))
            if before is not None:
                before.add_distance(*_counted(part_a, part_b, first))
            for part, to in ((part_a, sink_a), (moved, sink)):
                if to is not None:
                    getattr(to, read)(_on_cpu(part))

    outside_part("embeddings")
    layers, changed, solved = [], [], 0
    # First-round layers B matches to its storage rounding: their share of the next rotation's
    # cross-correlation is computed only if a next round is needed (a scramble needs none).
    deferred = []
    # Proposals are tried until one misses before any landed: an unrelated pair's land in no
    # layer (each miss costs an assignment), a scramble's in nearly every one (a real model's
    # layer of near-identical dead neurons can miss, and the layers after it still land).
    proposing, landed = True, False
    for index in range(spec.num_layers):
        bar.set_postfix_str(f"round {iteration}, layer {index + 1}/{spec.num_layers}")
        (raw_a, block_a), (raw, block_b) = a.read(index), b.read(index)
        rounding = None
        if before is not None:  # the first round: B's blocks as stored are at hand
            rounding = before.add_rounding(raw)
        if sink_a is not None:
            sink_a.block(index, _on_cpu(block_a), raw_a)
        del raw_a
        if before is not None:
            before.add_distance(block_a, block_b)
        turned = transform_block(block_b, spec, moving, index)
        keep = previous[index] is not None and steady[index] and moved_by < STEADY_ROTATION
        # In the first round a proposed neuron assignment is tried first, and kept only where
        # it moves the layer within its storage rounding of A: then it is the symmetry (no
        # assignment can do better than rounding), found at a fortieth of the products.
        tries = (True, False) if rounding is not None and not keep and proposing else (False,)
        for propose in tries:
            layer = match_layer(block_a, turned, spec, previous[index], keep, propose)
            work = _in_dtype(layer, WORK_DTYPE, a.device)
            moved = apply_layer_transform(turned, spec, work)
            squared = _squared_distance(block_a, moved)
            gap = squared[0] / max(squared[1], 1e-300)
            if not propose or gap <= ROUNDING_FLOOR**2 * rounding:
                landed = landed or propose
                break
            proposing = landed
        acc.add(*squared)
        solved += not keep
        changed.append(previous[index] is None or not _same_assignment(layer, previous[index]))
        layers.append(layer)
        del turned
        if rounding is not None and gap <= ROUNDING_FLOOR**2 * rounding:
            deferred.append(index)
        elif not last:
            acc.add_cross(block_a, apply_layer_transform(block_b, spec, work))
        del block_b
        if sink is not None:
            sink.block(index, _on_cpu(moved), raw)
        del moved, raw
    outside_part("head")
    distance = acc.distance()
    bar.set_postfix_str(f"round {iteration}: distance {distance:.4f}, {solved} layers solved")
    initial = math.nan if before is None else before.distance()
    floor = 0.0 if before is None else before.floor()
    if last or distance <= ROUNDING_FLOOR * floor:
        cross = None  # no next round
    else:
        for index in deferred:  # read again: a next round needs their share
            block_a, block_b = a.block(index), b.block(index)
            work = _in_dtype(layers[index], WORK_DTYPE, a.device)
            acc.add_cross(block_a, apply_layer_transform(block_b, spec, work))
        cross = acc.cross.cpu()
    return _Round(layers, changed, distance, initial, cross, solved, floor)


def _on_cpu(part):
    return map_tensors(part, lambda t: t.cpu())


class _Accumulator:
    """Sums, part by part, ``||B' - A||²`` and ``||A||²`` (B' = B moved) and the
    cross-correlation ``Σ X_Bᵀ·X_A`` of the residual rows of B permuted (not turned)."""

    def __init__(self, scale: float, keep_tie: bool = False):
        self.diff = self.total = 0.0
        self.rounding = self.blocks = 0.0
        self.cross = None
        self.scale = scale
        self.keep_tie = keep_tie

    def add_distance(self, part_a, moved) -> float:
        """Add ``||moved - part_a||²`` and ``||part_a||²``; their ratio for this part."""
        diff, total = _squared_distance(part_a, moved)
        self.add(diff, total)
        return diff / max(total, 1e-300)

    def add(self, diff: float, total: float) -> None:
        """Add a part's ``||moved - part_a||²`` and ``||part_a||²``."""
        self.diff, self.total = self.diff + diff, self.total + total

    def add_rounding(self, stored) -> float:
        """Add a block of B as stored: its squared norm, and the expected squared error of
        rounding each weight to its dtype (a twelfth of its unit in the last place squared),
        both on every :data:`ROUNDING_STRIDE`-th row (their ratio is what counts), a slice of
        rows at a time (no float32 copy of a whole matrix); their ratio for this block."""
        rounding = total = 0.0
        for name, t in iter_tensors(stored):
            if not t.is_floating_point() or "norm." in name or t.dim() == 0:
                continue
            eps = torch.finfo(t.dtype).eps
            t = t[::ROUNDING_STRIDE]
            for rows in row_slices(t, ROUNDING_ELEMENTS):
                values = t[rows].float()
                _, exponent = torch.frexp(values)
                unit = torch.ldexp(torch.full_like(values, eps / 2), exponent)
                unit[values == 0] = 0  # zeros stay exact
                rounding += float(unit.pow_(2).sum()) / 12
                total += float(values.square().sum())  # values may be the stored tensor
        self.rounding, self.blocks = self.rounding + rounding, self.blocks + total
        return rounding / max(total, 1e-300)

    def floor(self) -> float:
        """The relative distance B's storage rounding accounts for (its blocks')."""
        return (self.rounding / max(self.blocks, 1e-300)) ** 0.5

    def add_cross(self, part_a, part_b) -> None:
        rows_a, rows_b = (_rows(part, self.keep_tie) for part in (part_a, part_b))
        for (xa, writes), (xb, _) in zip(rows_a, rows_b, strict=True):
            term = (xb.T @ xa).double()
            term = term * self.scale if writes else term
            self.cross = term if self.cross is None else self.cross + term

    def distance(self) -> float:
        return (self.diff / max(self.total, 1e-300)) ** 0.5


def _squared_distance(part_a, moved) -> tuple[float, float]:
    """``||moved - part_a||²`` and ``||part_a||²``."""
    # Summed in the working dtype (pairwise sums: accurate far past the tolerance), each
    # tensor's total added in float64: no float64 copy of a block.
    diff = total = 0.0
    for (_, ta), (_, tb) in zip(iter_tensors(part_a), iter_tensors(moved), strict=True):
        diff += float(torch.sub(ta, tb).pow_(2).sum())
        total += float(ta.pow(2).sum())
    return diff, total


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
    for read in ("embeddings", "head"):
        for part_a, part_b, first in _outside(a, b, read):
            acc.add_cross(*_counted(part_a, part_b, first))
    return acc.cross.cpu()


def _outside(
    a: _Working, b: _Working, read: str
) -> Iterator[tuple[Embeddings | Head, Embeddings | Head, bool]]:
    """The embeddings (``read``: ``embeddings``) or the heads (``head``) of ``a`` and ``b``
    side by side, :data:`ROW_CHUNK` rows at a time, and whether the chunk is its part's first
    (the only one whose other tensors, such as the final norm, count)."""
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
    propose: bool = False,
) -> LayerTransform:
    """Head and neuron permutations and per-head maps moving block ``b`` onto block ``a``
    (both already in one residual basis), starting from the ``previous`` round's assignment;
    with ``keep``, its permutations are kept and only the maps fitted; with ``propose``, the
    neurons are assigned from a random projection of their weights
    (:func:`~lmc_mergekit.matching.assignment.proposed_permutation`). The similarities that
    rank heads and neurons run in :func:`~lmc_mergekit.matching.assignment.similarity_dtype` on
    the blocks' device, the map fits in float64 on the CPU. Maps and permutations come back in
    float64 on the CPU."""
    if keep and previous is not None:
        head_perm, ffn_perm = previous.head_perm, previous.ffn_perm
    else:
        ranked = similarity_dtype(a.attn.q.device)

        def low(part):
            return map_tensors(part, lambda t: t.to(ranked))

        heads = head_similarity(low(a.attn), low(b.attn), spec)
        head_perm = match_heads(_cpu64(heads), spec.num_kv_heads)
        current = None if previous is None else previous.ffn_perm
        if propose:
            ffn_perm = proposed_permutation(a.mlp, b.mlp)
        else:
            similarity = neuron_similarity(low(a.mlp), low(b.mlp)).cpu()
            ffn_perm, _ = best_permutation(similarity, current)
    attn = permute_heads(b.attn, spec, head_perm.to(b.attn.q.device))
    qk, ov = _fit_maps(a.attn, attn, spec)
    # The fitted A act on rows (X ← A·X); the transform stores M with W_q ← Mᵀ·W_q, i.e. Aᵀ.
    return LayerTransform(head_perm=head_perm, ffn_perm=ffn_perm, qk=qk, ov=ov.mT)


#: Key/value heads whose maps are fitted at a time (their circuit blocks in float64).
FIT_HEADS = 8


def _fit_maps(
    attn_a: Attention, attn_b: Attention, spec: ModelSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """The QK maps (as the transform stores them) and the OV maps (acting on rows) taking the
    heads of ``attn_b`` (already assigned) onto those of ``attn_a``: fitted in float64 on the
    CPU, :data:`FIT_HEADS` key/value heads at a time (each head's fit is its own)."""
    ov_a, ov_b = circuit_blocks(attn_a, spec, "ov"), circuit_blocks(attn_b, spec, "ov")
    chunks = [slice(s, s + FIT_HEADS) for s in range(0, spec.num_kv_heads, FIT_HEADS)]
    ov = torch.cat([fit_free_maps(*(_cpu64(t[h]) for t in (*ov_a, *ov_b))) for h in chunks])
    if not symmetry_group(spec).qk_maps:
        # Diagonal maps under a QK-norm: elementwise, fitted over every head at once.
        xa, ya = circuit_blocks(_gained(attn_a, spec), spec, "qk")
        xb, yb = circuit_blocks(_gained(attn_b, spec), spec, "qk")
        gains = [tuple(map(_cpu64, qk_gains(x, spec))) for x in (attn_a, attn_b)]
        blocks = (_cpu64(t) for t in (xa, ya, xb, yb))
        return fit_normed_qk_maps(*blocks, *gains, spec.rotary_dims), ov
    qk_a, qk_b = circuit_blocks(attn_a, spec, "qk"), circuit_blocks(attn_b, spec, "qk")
    qk = [
        fit_rope_maps(*(_cpu64(t[h]) for t in (*qk_a, *qk_b)), spec.rotary_dims).mT for h in chunks
    ]
    return torch.cat(qk), ov


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
        """Block ``index`` in the working dtype, its norms absorbed."""
        return self.read(index)[1]

    def read(self, index: int) -> tuple[Block, Block]:
        """Block ``index`` as stored, and in the working dtype with its norms absorbed."""
        raw = self.view.block(index)
        return raw, transform_block(self._work(raw), self.spec, self._absorb, index)
