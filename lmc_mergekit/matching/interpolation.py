"""The learned-matching objective: the loss of ``Σ λ_i π_i(Θ_i)`` as a function of the symmetries.

The endpoints ``Θ_i`` are frozen (already moved by weight matching, norms absorbed); ``π_i`` is
the continuous symmetry :class:`LearnedSymmetry` ``i`` stands for. The mix is run part by part:
the embeddings, each block, the head. Each part is one module holding that part of every
endpoint as frozen parameters. The embeddings and the head are moved with the same
differentiable actions that write checkpoints and mixed with weights ``λ``; a block runs
through a one-layer stock ``transformers`` module
(:meth:`~lmc_mergekit.models.block_mixing.BlockMixer.mixed_output`) whose projections each run
once per endpoint on its held weights, the symmetry moving what they read and write
(:class:`~lmc_mergekit.symmetry.activation_actions.ActivationAction`: ``proj(x·Qᵀ)`` for a
reader of the stream, per-head maps on queries, keys, values), and add up with weights ``λ``:
by linearity the block of the mixed moved weights, at the cost of the endpoints' projections on the
batch's tokens rather than of moving ``d × d`` products of every weight. The first endpoint's
rotation and per-head maps are moved onto the others (the loss is invariant under one symmetry
of the whole mix), so its projections run as they are. A step makes each symmetry's rotation
and maps once, all maps inverted in one batched call.

A block keeps its work for the backward while the kept work fits in the endpoints' own bytes
(and on a GPU in its free memory: :class:`~lmc_mergekit.matching.step_memory.StepMemory`); the
others run under activation checkpointing, keeping only their input and recomputing their work
in the backward, one block at a time. The precision is a parameter (:func:`autocast_dtype`),
whatever the device: in float32 the endpoints are held in their checkpoint's dtype (a bf16
checkpoint's values exactly, in half the memory of float32) and a part runs in float32; under
bf16 autocast (the default on a GPU, and the CPU twin the tests run) they are held in bf16 and
autocast casts. The embeddings move only the rows the batch uses, never a whole vocabulary.

Under several processes every part module is sharded with torch's FSDP (``fully_shard``): each
process holds a ``1/world_size`` slice of every endpoint, every block recomputes its work, and
a part's forward (and its recomputation in the backward) gathers that part's endpoints, and
only that part's, for the time it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmc_mergekit.matching.step_memory import StepMemory, step_memory
from lmc_mergekit.models.block_mixing import BlockMixer
from lmc_mergekit.models.block_runner import (
    embed,
    final_norm,
    head_logits,
    loss_tokens,
    soft_capped,
)
from lmc_mergekit.models.view import Head, ModelView, iter_tensors, map_named_tensors
from lmc_mergekit.runtime.distributed import Processes
from lmc_mergekit.runtime.memory import trim_heap
from lmc_mergekit.symmetry.activation_actions import activation_actions
from lmc_mergekit.symmetry.parametrize import LearnedSymmetry
from lmc_mergekit.symmetry.transform import Transform
from lmc_mergekit.symmetry.weight_actions import (
    apply_transform,
    head_through_tokens,
    transform_embeddings,
    transform_head,
)

#: How learned matching computes: ``bf16`` (under ``torch.autocast``, endpoints held in bf16),
#: ``float32``, or ``auto`` (bf16 on a GPU, float32 elsewhere).
Precision = Literal["auto", "bf16", "float32"]


def autocast_dtype(precision: Precision, device: torch.device) -> torch.dtype | None:
    """The dtype the mixes run in under ``torch.autocast`` on ``device`` (None: float32, no
    autocast). Only ``auto`` looks at the device; bf16 autocast runs on the CPU as well."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "float32"
    return torch.bfloat16 if precision == "bf16" else None


def endpoint_dtype(autocast: torch.dtype | None, parts: list | None = None) -> torch.dtype:
    """How endpoints are held: in the ``autocast`` dtype when the mixes run under autocast;
    otherwise in the dtype the ``parts`` share (a bf16 checkpoint's: exact, and half the
    memory of float32; they run in float32), float32 if they have several."""
    if autocast is not None:
        return autocast
    dtypes = {t.dtype for part in parts or [] for _, t in _named(part)}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


class EndpointPart(nn.Module):
    """One part (the embeddings, a block or the head) of every endpoint, as frozen parameters:
    the unit FSDP shards and gathers. A part is a view part, or a block laid out for the
    block mixer (a dict of tensors)."""

    def __init__(self, parts: list, device: torch.device, autocast: torch.dtype | None = None):
        super().__init__()
        dtype = endpoint_dtype(autocast, parts)
        # Without autocast a part runs in float32 whatever it is held in; under autocast it
        # runs as held and autocast casts.
        self.compute_dtype = None if autocast is not None else torch.float32
        # The parts' structure, without their data, to rebuild them from the parameters.
        self.templates = [_mapped(part, lambda _, t: t.to("meta")) for part in parts]
        for index, part in enumerate(parts):
            for name, tensor in _named(part):
                data = tensor.to(device=device, dtype=dtype)
                self.register_parameter(_key(index, name), nn.Parameter(data, requires_grad=False))

    def forward(self, compute: Callable, *inputs: torch.Tensor) -> torch.Tensor:
        """``compute(parts, *inputs)``, run while the parameters are gathered."""
        parts = [
            _mapped(template, lambda name, _, i=index: getattr(self, _key(i, name)))
            for index, template in enumerate(self.templates)
        ]
        return compute(parts, *inputs)

    def computed(self, parts: list) -> list:
        """``parts`` in the dtype they run in (float32; as held under autocast)."""
        if self.compute_dtype is None:
            return parts
        return [_mapped(part, lambda _, t: t.to(self.compute_dtype)) for part in parts]


def _named(part) -> Iterator[tuple[str, torch.Tensor]]:
    """A part's tensors by name (a dict's items, a view part's fields)."""
    return iter(part.items()) if isinstance(part, dict) else iter_tensors(part)


def _mapped(part, fn: Callable):
    """A part with ``fn(name, tensor)`` in place of each tensor."""
    if isinstance(part, dict):
        return {name: fn(name, tensor) for name, tensor in part.items()}
    return map_named_tensors(part, fn)


def _key(index: int, name: str) -> str:
    return f"e{index}__{name.replace('.', '__')}"


class InterpolationObjective(nn.Module):
    """Frozen endpoints, one :class:`LearnedSymmetry` per endpoint that learns (``None`` for an
    endpoint held fixed), and the runner that evaluates their mix block by block on its device.
    ``autocast``: the dtype the caller runs the forward under ``torch.autocast`` in (None:
    float32), which decides how the endpoints are held (:func:`endpoint_dtype`)."""

    def __init__(
        self,
        endpoints: list[ModelView],
        symmetries: list[LearnedSymmetry | None],
        runner: BlockMixer,
        processes: Processes | None = None,
        autocast: torch.dtype | None = None,
    ):
        super().__init__()
        self.spec, self.runner = endpoints[0].spec, runner
        self.symmetries = nn.ModuleList(s for s in symmetries if s is not None)
        self.learns = [symmetry is not None for symmetry in symmetries]
        processes = processes or Processes()
        mesh = processes.mesh(runner.device)

        def part(parts: list) -> EndpointPart:
            module = EndpointPart(parts, runner.device, autocast)
            if mesh is not None:
                from torch.distributed.fsdp import fully_shard

                # Explicit: a module sharded on its own is a root, and FSDP keeps a root
                # gathered after its forward unless told otherwise.
                fully_shard(module, mesh=mesh, reshard_after_forward=True)
            return module

        # Read and (when sharded) shard one part at a time: no process holds a whole endpoint.
        self.embeddings = part([view.embeddings() for view in endpoints])
        # Blocks are held with their norms absorbed (the identity where matching absorbed
        # them: their mixes move the projections' activations, which needs unit gains), laid
        # out as the block mixer's module takes them.
        absorbed = [
            apply_transform(view, Transform(self.spec.num_layers, absorb_norms=True))
            for view in endpoints
        ]
        self.blocks = nn.ModuleList(
            part([runner.lay_out(view.block(index), index) for view in absorbed])
            for index in range(self.spec.num_layers)
        )
        # A tied endpoint's head read through its embeddings' tokens (a d × d map), not
        # held as a second vocabulary-sized matrix: in one process, where the embeddings'
        # tokens stay whole, and when every endpoint's can (so that no held head is cast).
        heads = [None if mesh is not None else head_through_tokens(v) for v in endpoints]
        self.reads_tokens = all(head is not None for head in heads)
        if not self.reads_tokens:
            heads = [view.head() for view in endpoints]
        self.head = part(heads)
        # Moving each part made float64 transients of every size: the heap kept their pages.
        trim_heap()
        #: The most parts held whole at once while a part ran (forward or recomputation).
        self.most_gathered = 0
        self.processes = processes.world_size
        #: Bytes the step may use on its device (set where they are counted: a GPU's free
        #: memory before the endpoints came); None: the endpoints' budget alone.
        self.free: int | None = None

    def parts(self) -> list[EndpointPart]:
        """The part modules, embeddings first."""
        return [self.embeddings, *self.blocks, self.head]

    def gathered(self) -> int:
        """How many parts are held whole right now (all of them in one process; under FSDP,
        those gathered at this moment)."""
        return sum(not hasattr(next(m.parameters()), "to_local") for m in self.parts())

    def held_bytes(self) -> int:
        """Bytes of endpoint weights this process holds (its shard under FSDP)."""
        total = 0
        for module in self.parts():
            for param in module.parameters():
                local = param.to_local() if hasattr(param, "to_local") else param
                total += local.numel() * local.element_size()
        return total

    def _note_gathered(self) -> None:
        self.most_gathered = max(self.most_gathered, self.gathered())

    def _transforms(self) -> list[Transform | None]:
        """The endpoints' current symmetries, made once a step in float32 whatever autocast
        the step runs under (their maps are inverted and composed)."""
        with torch.autocast(self.runner.device.type, enabled=False):
            learned = iter(self.symmetries)
            return [next(learned).transform() if learns else None for learns in self.learns]

    def forward(self, weights: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss of the mix with ``weights`` on ``input_ids``."""
        spec = self.spec
        first = self.symmetries[0] if self.learns[0] else None
        permutation = first is not None and "permutation" in first.families
        transforms = _first_unrotated(self._transforms(), permutation, spec.num_layers)
        input_ids = input_ids.to(self.runner.device)
        # Each endpoint's symmetry on the blocks' activations, every map inverted once for
        # the step (not per block, nor again in a recomputation).
        with torch.autocast(self.runner.device.type, enabled=False):
            actions = activation_actions(transforms, spec)
        floats = weights.tolist()  # scalars for the blocks' sums (one read of a GPU's)

        def moved(parts: list, action: Callable) -> list:
            pairs = zip(parts, transforms, strict=True)
            return [p if t is None else action(p, t) for p, t in pairs]

        def embeddings(parts: list) -> torch.Tensor:
            self._note_gathered()
            # Only the rows the batch uses are moved (each row moves on its own): never a
            # moved copy of a whole vocabulary per model.
            used, inverse = torch.unique(input_ids, return_inverse=True)
            rows = [replace(part, tokens=part.tokens[used]) for part in parts]
            mixed = _mix(moved(self.embeddings.computed(rows), transform_embeddings), weights)
            return embed(mixed, inverse, spec).float()

        def block(index: int) -> Callable:
            def run(parts: list, residual: torch.Tensor) -> torch.Tensor:
                self._note_gathered()
                states = self.blocks[index].computed(parts)
                return self.runner.mixed_output(states, actions, floats, residual, index)

            return run

        def loss(parts: list, residual: torch.Tensor) -> torch.Tensor:
            self._note_gathered()
            # A head moves by ``W ← W·M``, ``b ← b + W·β``: move a d × d identity in its place
            # and read each model's stored head through its ``M``, ``β``, never a moved (or a
            # float32) copy of a vocab × d head.
            probes = moved(self.head.computed([_probe(p) for p in parts]), transform_head)
            norm = _mix([probe.norm for probe in probes], weights)
            readers = [
                self._reader(index, part, probe)
                for index, (part, probe) in enumerate(zip(parts, probes, strict=True))
            ]
            # transformers' causal-LM loss: every position predicts the next token. The logits
            # are made a few hundred tokens at a time and made again in the backward (but for
            # one piece in one process: its logits live through the forward anyway).
            states, targets = residual[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten()
            spans = _spans(len(targets), loss_tokens(len(readers[0].weight)))
            summed = _summed_loss
            if len(spans) > 1 or self.processes > 1:
                summed = partial(checkpoint, _summed_loss, use_reentrant=False)
            pieces = [
                summed(norm, readers, weights, states[start:stop], targets[start:stop], spec)
                for start, stop in spans
            ]
            return sum(pieces[1:], pieces[0]) / len(targets)

        residual = self.embeddings(embeddings)
        kept = self.kept_blocks(input_ids)
        for index, module in enumerate(self.blocks):
            if index < kept:
                residual = module(block(index), residual)
            else:
                residual = checkpoint(module, _trimmed(block(index)), residual, use_reentrant=False)
        return self.head(loss, residual)

    def memory(self, tokens: int, seq_len: int) -> StepMemory:
        """What a step on ``tokens`` tokens (this process's) in sequences of ``seq_len``
        holds (:func:`step_memory`)."""
        itemsize = next(self.blocks[0].parameters()).element_size()
        return step_memory(
            self.spec,
            len(self.learns),
            itemsize,
            tokens,
            seq_len,
            processes=self.processes,
            scores=self.runner.keeps_attention_scores,
            reads_tokens=self.reads_tokens,
            casts=self.blocks[0].compute_dtype is not None and itemsize < 4,
        )

    def kept_blocks(self, input_ids: torch.Tensor) -> int:
        """How many blocks (the first ones) keep their work for the backward on
        ``input_ids``; the others recompute it there, one at a time. None under several
        processes: FSDP gathers a part again for its recomputation, so memory is one part's,
        and every process must gather in the same order."""
        if self.processes > 1 or not torch.is_grad_enabled():
            return 0
        return self.memory(input_ids.numel(), input_ids.shape[-1]).kept_blocks(self.free)

    def _reader(self, index: int, part: Head, probe: Head) -> HeadReader:
        """Endpoint ``index``'s head ``part`` read through its moved ``probe`` (``M``, ``μ``):
        its held head, or where the part is a ``d × d`` map ``C`` of the endpoint's tokens,
        those tokens: ``(x·Mᵀ + μ)·Cᵀ = x·(C·M)ᵀ + μ·Cᵀ``."""
        if not self.reads_tokens:
            return HeadReader(part.weight, probe.weight, probe.bias, part.bias)
        tokens = getattr(self.embeddings, _key(index, "tokens"))
        matrix = part.weight
        shift = None if probe.bias is None else probe.bias.to(matrix) @ matrix.T
        return HeadReader(tokens, matrix @ probe.weight.to(matrix), shift, None)


class HeadReader(NamedTuple):
    """One endpoint's moved head as ``(x·Mᵀ + β)·Wᵀ + b``: its stored head ``W``, ``b`` and
    the ``M``, ``β`` its symmetry made of an identity."""

    weight: torch.Tensor
    matrix: torch.Tensor
    shift: torch.Tensor | None
    bias: torch.Tensor | None

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        states = normed @ self.matrix.to(normed).T
        if self.shift is not None:
            states = states + self.shift.to(normed)
        return head_logits(states, self.weight, self.bias)


def _probe(head: Head) -> Head:
    """``head`` with a d × d identity for its weight (a zero shift where it has a bias: an
    absorbed norm bias folds into it as it would into the head's bias)."""
    d = head.weight.shape[1]
    eye = torch.eye(d, dtype=head.norm.gain.dtype, device=head.weight.device)
    shift = None if head.bias is None else eye.new_zeros(d)
    return replace(head, weight=eye, bias=shift)


def _summed_loss(
    norm, readers: list[HeadReader], weights: torch.Tensor, states, targets, spec
) -> torch.Tensor:
    """The summed next-token cross-entropy of ``states`` ``(n, d)`` through the final ``norm``
    and the ``weights``-mix of the endpoints' heads."""
    # Each piece's freed logits back to the system first (in the forward and again when the
    # backward makes them again): glibc's heap otherwise keeps most of every piece's, and a
    # step's resident memory grows by a piece's worth per piece.
    trim_heap()
    normed = final_norm(norm, states, spec)
    # Summed in place: one tokens × vocabulary tensor for the mix, not one per endpoint and
    # their sum (the weights are sampled, not learned: the gradient needs no copy of a term).
    logits = None
    for weight, reader in zip(weights, readers, strict=True):
        term = reader.logits(normed)
        logits = term.mul_(weight) if logits is None else logits.add_(term.mul_(weight))
        del term
    return F.cross_entropy(soft_capped(logits, spec).float(), targets, reduction="sum")


def _trimmed(run: Callable) -> Callable:
    """``run`` for a block whose work is recomputed in the backward: the heap's free memory
    goes back to the system first, as each loss piece's does (see :func:`_summed_loss`), so
    that each recomputation's transients do not add up."""

    def trimmed(*args):
        trim_heap()
        return run(*args)

    return trimmed


def _first_unrotated(
    transforms: list[Transform | None], permutation: bool, num_layers: int
) -> list[Transform | None]:
    """``transforms`` with the first one's residual rotation ``Q_0`` moved onto the others
    (``Q_i·Q_0ᵀ``; the first unrotated). The loss is invariant under one rotation of the
    whole mix and the actions are linear in the weights, so the mix's loss is the same, with
    the same gradients (``Q_0`` is a parametrised orthogonal map), and the first endpoint's
    blocks are not rotated at all. Not where the first's rotation is a ``permutation``
    learned through a straight-through estimator: its gradient is not the manifold's."""
    first = transforms[0]
    if first is None or first.rotation is None or permutation:
        return transforms
    turn = first.rotation.mT
    others = [t or Transform(num_layers, absorb_norms=True) for t in transforms[1:]]
    return [replace(first, rotation=None)] + [
        replace(t, rotation=turn if t.rotation is None else t.rotation @ turn) for t in others
    ]


def _spans(count: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, count)) for start in range(0, count, size)]


def _mix(parts: list, weights: torch.Tensor):
    """``Σ weights_i parts_i``, tensor by tensor."""
    tensors = [dict(iter_tensors(part)) for part in parts]

    def mixed(name: str, _: torch.Tensor) -> torch.Tensor:
        terms = [weight * t[name] for weight, t in zip(weights, tensors, strict=True)]
        return sum(terms[1:], terms[0])

    return map_named_tensors(parts[0], mixed)
