"""Activation matching: the symmetry that brings one model's activations closest to another's.

Both models (norms absorbed) read the same calibration text, block by block through the
:class:`~lmc_mergekit.models.block_runner.BlockRunner`: the computation ``transformers`` runs. One
pass, holding one block of each model and the residual streams of the calibration tokens:

1. the residual stream before the first block and after every block gives one cross-correlation
   ``K = Σ_l X_B,lᵀ·X_A,l / (||X_A,l||·||X_B,l||)``; the residual map is the element of the group
   the model admits (:mod:`lmc_mergekit.symmetry.group`) that maximises ``tr(Rᵀ·K)`` (orthogonal
   Procrustes, or within rotations fixing the all-ones vector). For signed permutations (post-norm
   and sandwich-norm families, kept ties) each channel is correlated with each other by its
   cosine, so that a few large channels do not decide the assignment for all (Verma & Elbayad
   correlate activations in the same way for post-LN BERT);
2. per layer, the FFN neurons are assigned by the cosine of their activations (the input of the
   down projection), as the layer is passed; the query heads (GQA-aware) by the cosine of what
   each writes to the residual stream, ``z_h·W_O,hᵀ`` (B's turned into A's basis: invariant to
   the per-head OV maps), once the residual map is known, from the cross products of the heads'
   inputs ``z`` kept per layer (``(H·dh)²`` float32 numbers: 96 MiB for Pythia-410M, 2 GiB
   for a 7B Llama, on the CPU). The per-head QK and OV maps are then fitted to the weights
   given these assignments, as weight matching fits them
   (:func:`~lmc_mergekit.matching.weight_matching.match_layer`).

A model moved by any symmetry of its group is recovered, since its activations are A's up to
that symmetry: exactly where the residual group is discrete, to the float32 precision of the
activations where it is continuous (tested: within 5e-4 of the weights, relative). The cost is
one forward pass of both models over the calibration sequences and the products of their
activations (float32 per batch, summed in float64, where the activations are: the GPU, where
the pass runs there).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from lmc_mergekit.matching.assignment import best_permutation, match_heads
from lmc_mergekit.matching.procrustes import residual_procrustes
from lmc_mergekit.matching.weight_matching import match_layer
from lmc_mergekit.models.block_runner import BlockActivations, BlockRunner, embed
from lmc_mergekit.models.view import Block, ModelSpec, ModelView, map_tensors
from lmc_mergekit.symmetry import LayerTransform, Transform, apply_transform
from lmc_mergekit.symmetry.group import symmetry_group
from lmc_mergekit.symmetry.weight_actions import transform_block

#: Calibration sequences run through both models at once.
BATCH = 8


@dataclass(frozen=True)
class ActivationMatch:
    """The transform moving B onto A and how close their residual streams are (the mean over
    layers of the cosine of A's stream with B's, before and after B is moved)."""

    transform: Transform
    stream_cosine: tuple[float, float]
    tokens: int
    seconds: float

    def record(self) -> dict:
        """JSON-ready facts for the report."""
        before, after = self.stream_cosine
        return {
            "matching": "activations",
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "stream_cosine": {"before": round(before, 6), "after": round(after, 6)},
        }


def match_activations(
    reference: ModelView,
    other: ModelView,
    runner: BlockRunner,
    sequences: torch.Tensor,
    *,
    keep_tie: bool = False,
    progress: bool = False,
) -> ActivationMatch:
    """The symmetry of ``other`` that brings its activations on ``sequences`` (``(n, L)`` token
    ids) closest to ``reference``'s, ``runner`` running blocks of their absorbed shape."""
    start = time.perf_counter()
    spec = reference.spec
    # As weight matching: the global scale is pinned by the two models' eps (see there); B
    # runs scaled by it, so that its norms see A's eps, as the runner's blocks do.
    scale = math.sqrt(spec.norm_eps / other.spec.norm_eps)
    absorb = Transform(spec.num_layers, absorb_norms=True, keep_tie=keep_tie)
    a = apply_transform(reference, absorb)
    b = apply_transform(other, replace(absorb, scale=scale))
    batches = list(torch.split(sequences, BATCH))
    group = symmetry_group(spec, keep_tie).residual
    bar = tqdm(
        total=2 * spec.num_layers, desc="activation matching", disable=not progress, leave=False
    )

    streams = _StreamStatistics(spec.hidden_size)
    heads, neurons = [], []
    for units in _walk(a, b, runner, batches, bar, streams):
        neurons.append(best_permutation(units.neurons())[0])
        heads.append(units.heads_only())
        del units  # one layer's full statistics at a time, not two
    discrete = group in ("signed_permutation", "permutation")
    rotation = residual_procrustes(streams.cosine if discrete else streams.plain, group)
    turn = Transform(spec.num_layers, True, rotation, keep_tie=keep_tie).to(torch.float64)

    layers = []
    for index, units in enumerate(heads):
        block_a = _cpu64(a.block(index))
        turned = transform_block(_cpu64(b.block(index)), spec, turn, index)
        chosen = LayerTransform(
            head_perm=match_heads(units.heads(block_a, turned, spec), spec.num_kv_heads),
            ffn_perm=neurons[index],
        )
        layers.append(match_layer(block_a, turned, spec, chosen, keep=True))
        bar.update()
    bar.close()
    transform = Transform(spec.num_layers, True, rotation, scale, tuple(layers), keep_tie)
    before, after = (
        float(x) / streams.layers
        for x in (streams.plain.trace(), rotation.mul(streams.plain).sum())
    )
    return ActivationMatch(
        transform, (before, after), int(sequences.numel()), time.perf_counter() - start
    )


def _walk(
    a: ModelView,
    b: ModelView,
    runner: BlockRunner,
    batches: list[torch.Tensor],
    bar: tqdm,
    streams: _StreamStatistics,
) -> Iterator[_UnitStatistics]:
    """Both models block by block over ``batches``, holding the residual streams of every batch
    and one batch's activations: per layer the statistics of its heads' and neurons'
    activations, the residual streams (before the first block and after each) added to
    ``streams``."""
    device = runner.device
    inputs = [
        [embed(view.embeddings(), ids, view.spec).to(device, torch.float32) for ids in batches]
        for view in (a, b)
    ]
    streams.add(*inputs)
    for index in range(a.spec.num_layers):
        blocks = (a.block(index), b.block(index))
        units = _UnitStatistics(a.spec.num_heads)
        runs = [runner.each(block, x, index) for block, x in zip(blocks, inputs, strict=True)]
        outputs: list[list[torch.Tensor]] = [[], []]
        for act_a, act_b in zip(*runs, strict=True):
            units.add(act_a, act_b)
            outputs[0].append(act_a.output)
            outputs[1].append(act_b.output)
        inputs = outputs
        streams.add(*inputs)
        bar.update()
        yield units


class _StreamStatistics:
    """Cross-correlations ``X_Bᵀ·X_A`` of the two residual streams, summed over the layers
    seen: ``plain``, each layer's normalised by the two streams' norms, and ``cosine``, per
    pair of channels."""

    def __init__(self, width: int):
        zeros = torch.zeros(width, width, dtype=torch.float64)
        self.plain, self.cosine, self.layers = zeros, zeros.clone(), 0

    def add(self, xa: list[torch.Tensor], xb: list[torch.Tensor]) -> None:
        cross, sq_a, sq_b = 0, 0, 0
        for x, y in zip(xa, xb, strict=True):
            cross, sq_a, sq_b = cross + _gram(y, x), sq_a + _energy(x), sq_b + _energy(y)
        cross, sq_a, sq_b = cross.cpu(), sq_a.cpu(), sq_b.cpu()
        self.plain += cross / (sq_a.sum() * sq_b.sum()).sqrt().clamp_min(1e-300)
        self.cosine += _cosines(cross, sq_b, sq_a)
        self.layers += 1


class _UnitStatistics:
    """One layer's head outputs ``z`` (the input of ``W_O``) and FFN activations (the input of
    the down projection) of both models, as sums over tokens of their cross products (each
    head's own products only), kept where the activations are until asked for."""

    def __init__(self, heads: int):
        self.heads_count = heads
        self.z_ab = self.z_aa = self.z_bb = 0
        self.n_ab = self.n_aa = self.n_bb = 0

    def add(self, a: BlockActivations, b: BlockActivations) -> None:
        za, zb, na, nb = a.attn_out_input, b.attn_out_input, a.mlp_out_input, b.mlp_out_input
        self.z_ab = self.z_ab + _gram(za, zb)
        self.z_aa = self.z_aa + _head_grams(za, self.heads_count)
        self.z_bb = self.z_bb + _head_grams(zb, self.heads_count)
        self.n_ab = self.n_ab + _gram(na, nb)
        self.n_aa, self.n_bb = self.n_aa + _energy(na), self.n_bb + _energy(nb)

    def neurons(self) -> torch.Tensor:
        """The cosine of every FFN neuron of A with every one of B over the tokens."""
        return _cosines(self.n_ab, self.n_aa, self.n_bb).cpu()

    def heads_only(self) -> _UnitStatistics:
        """These statistics without the neurons', the heads' on the CPU (``z_ab`` in
        float32): what is kept of a layer until the residual map is known."""
        kept = _UnitStatistics(self.heads_count)
        kept.z_ab = self.z_ab.to("cpu", torch.float32)
        kept.z_aa, kept.z_bb = self.z_aa.cpu(), self.z_bb.cpu()
        return kept

    def heads(self, block_a: Block, turned_b: Block, spec: ModelSpec) -> torch.Tensor:
        """The cosine of what each query head of A writes to the stream, ``z_i·W_O,iᵀ``, with
        what each of B writes (``turned_b``: B's block in A's basis)."""
        h, dh = spec.num_heads, spec.head_dim
        o_a = block_a.attn.o.reshape(-1, h, dh).permute(1, 0, 2)  # (head, d, dh)
        o_b = turned_b.attn.o.reshape(-1, h, dh).permute(1, 0, 2)
        # <c_i^A, c_j^B> = Σ_kl (O_iᵀ·O_j)_kl · (Σ_t z_i^Aᵀ·z_j^B)_kl: only dh×dh blocks.
        z = self.z_ab.cpu().double().reshape(h, dh, h, dh).permute(0, 2, 1, 3)  # (A, B, ..)
        cross = (torch.einsum("idk,jdl->ijkl", o_a, o_b) * z).sum((-1, -2))
        own_a = torch.einsum("hdk,hdl,hkl->h", o_a, o_a, self.z_aa.cpu())
        own_b = torch.einsum("hdk,hdl,hkl->h", o_b, o_b, self.z_bb.cpu())
        return _cosines(cross, own_a, own_b)


def _cosines(cross: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Inner products ``cross`` of features divided by the features' norms (squared norms
    ``rows`` and ``cols``): their cosines."""
    return cross / (rows[:, None] * cols[None, :]).sqrt().clamp_min(1e-300)


def _gram(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``Σ_t x_tᵀ·y_t`` over one batch's tokens, in float64 where ``x`` is (summed in float32:
    a batch's thousand tokens lose nothing that float64 sums over batches would keep, at half
    the cost of the largest products of the pass)."""
    return (x.flatten(0, -2).T.float() @ y.flatten(0, -2).float()).double()


def _head_grams(z: torch.Tensor, heads: int) -> torch.Tensor:
    """Each head's ``Σ_t z_hᵀ·z_h`` ``(heads, dh, dh)``, in float64 where ``z`` is."""
    z = z.flatten(0, -2).float()
    z = z.reshape(len(z), heads, -1)
    return torch.einsum("thk,thl->hkl", z, z).double()


def _energy(x: torch.Tensor) -> torch.Tensor:
    """``Σ_t x_t²`` per feature, in float64 where ``x`` is."""
    return x.double().pow(2).flatten(0, -2).sum(0)


def _cpu64(block: Block) -> Block:
    return map_tensors(block, lambda t: t.to("cpu", torch.float64) if t.is_floating_point() else t)
