"""Running the mix of several models' blocks, each model moved by its own symmetry: what
learned matching trains through.

A :class:`BlockMixer` is a :class:`~lmc_mergekit.models.block_runner.BlockRunner` whose mixes
run through a one-layer module whose projections are stand-ins (:class:`_Mixer`): each runs
the module's own projection once per model, on that model's weights, with the model's moves
(:class:`StreamMaps`) on its input and output, and sums them; the norms, the attention and
the MLP around them run unchanged. Where each canonical piece sits in a fused projection's
outputs is found by running the projection itself on weights that hold their own positions,
so no layout is known here that the adapter does not write.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.func import functional_call

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.block_runner import BlockRunner, OneLayer
from lmc_mergekit.models.view import Block, iter_tensors, map_named_tensors, map_tensors


class StreamMaps(Protocol):
    """How one model of a mix is moved, seen from a block's activations: what
    :meth:`BlockMixer.mixed_output` asks of each model (learned matching's
    :class:`~lmc_mergekit.symmetry.activation_actions.ActivationAction`). Pieces are the
    canonical view's (``attn.q``, ``mlp.down``), their rows (a reader's outputs) or columns (a
    writer's inputs) last; ``layer`` is the block's layer in the model."""

    def norms(self, block: Block, layer: int) -> Block:
        """``block`` with its vectors (norms) as the model's are; its matrices are meta."""
        ...

    def reads(self, x: torch.Tensor) -> torch.Tensor:
        """What the model's readers of the stream take for ``x``, the stream they read."""
        ...

    def read(self, piece: str, y: torch.Tensor, layer: int) -> torch.Tensor:
        """The model's outputs of reader ``piece`` from its held weights' outputs ``y``."""
        ...

    def writes_from(self, piece: str, z: torch.Tensor, layer: int) -> torch.Tensor:
        """What writer ``piece`` takes, with its held weights, for its input ``z``."""
        ...

    def writes(self, y: torch.Tensor) -> torch.Tensor:
        """What the model adds to the stream for its writer's held-weight output ``y``."""
        ...


@dataclass
class _Mix:
    """One call of a mix: each model's block tensors (under the module's names), its moves,
    the weights, the model's layer, and what each model's readers take for each input they
    read (made once for all the readers of one tensor: ``q_proj``, ``k_proj`` and ``v_proj``
    read the same normalised stream)."""

    states: list[dict[str, torch.Tensor]]
    moves: list[StreamMaps]
    weights: list[float]
    layer: int
    taken: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)

    def reads(self, x: torch.Tensor) -> list[torch.Tensor]:
        if id(x) not in self.taken:  # x is kept with its reads: its id is not reused
            self.taken[id(x)] = (x, [move.reads(x) for move in self.moves])
        return self.taken[id(x)][1]


class _Mixer(nn.Module):
    """Stands, in a one-layer module, for one projection of the block, a reader of the stream
    or a writer to it (``attn_out``, ``mlp_out``): the projection runs once per model of the
    mix, on that model's weights, its input and output moved by the model's
    :class:`StreamMaps`, and the weighted sum is the output. By linearity that is what the
    projection computes on the mix of the moved weights, so the stock module around it runs
    the mixed block exactly, at the cost of the models' projections on the tokens."""

    def __init__(self, projection: nn.Module, path: str, writer: bool):
        super().__init__()
        # Not a submodule: its weights come with each call, one model's at a time, so its own
        # placeholders go.
        self.projection = (projection.to("meta"),)
        self.prefix, self.writer = path + ".", writer
        #: Its outputs (its inputs, for a writer) as ``groups`` repeats of one block of rows
        #: of each canonical piece in turn: ``[q|k|v]`` is one group of three pieces,
        #: GPT-NeoX's fused projection one group per head (:meth:`locate`).
        self.groups = 1
        self.pieces: list[tuple[str, int]] = []
        self.mix: _Mix | None = None

    def local(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The projection's own tensors in a block's ``state``."""
        cut = len(self.prefix)
        return {key[cut:]: t for key, t in state.items() if key.startswith(self.prefix)}

    def locate(self, pieces: list[str], rows: torch.Tensor) -> None:
        """Record where the pieces are, given that the projection's output (input, for a
        writer) ``f`` is row (column) ``rows[f]`` of canonical piece ``pieces[f]``: they must
        be groups of one block of rows of each piece in turn, the blocks in row order."""
        runs = [(name, len(list(run))) for name, run in itertools.groupby(pieces)]
        period = len(dict.fromkeys(name for name, _ in runs))
        groups = len(runs) // period
        expected = []
        for group in range(groups):
            for name, block in runs[:period]:
                expected += [(name, group * block + row) for row in range(block)]
        found = list(zip(pieces, rows.tolist(), strict=True))
        if runs != runs[:period] * groups or expected != found:
            raise LmcError(
                f"cannot mix {self.prefix[:-1]}: its rows are not blocks of canonical rows"
            )
        self.groups, self.pieces = groups, runs[:period]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mix = self.mix
        taken = [self._into(move, x) for move in mix.moves] if self.writer else mix.reads(x)
        out = None
        for weight, move, state, given in zip(
            mix.weights, mix.moves, mix.states, taken, strict=True
        ):
            y = functional_call(self.projection[0], self.local(state), (given,))
            y = move.writes(y) if self.writer else self._moved(y, move.read)
            out = y * weight if out is None else out.add(y, alpha=weight)
        return out

    def _into(self, move: StreamMaps, z: torch.Tensor) -> torch.Tensor:
        """A writer's input ``z`` as ``move`` has the writer take it."""
        return self._moved(z, move.writes_from)

    def _moved(self, y: torch.Tensor, act) -> torch.Tensor:
        """``y`` (outputs of a reader, inputs of a writer) with ``act(piece, rows, layer)``
        applied to each piece's canonical rows; ``y`` itself where no piece changes. Views
        and one split and one concatenation: their gradients are a concatenation and views."""
        blocks = [block for _, block in self.pieces]
        grouped = y.unflatten(-1, (self.groups, sum(blocks)))
        parts = [part.flatten(-2) for part in grouped.split(blocks, dim=-1)]
        moved = [
            act(piece, part, self.mix.layer)
            for (piece, _), part in zip(self.pieces, parts, strict=True)
        ]
        if all(m is part for m, part in zip(moved, parts, strict=True)):
            return y
        if len(moved) == 1:
            return moved[0]
        rows = [m.unflatten(-1, (self.groups, b)) for m, b in zip(moved, blocks, strict=True)]
        return torch.cat(rows, dim=-1).flatten(-2)


class _MixingLayer(OneLayer):
    """A one-layer module whose projections are :class:`_Mixer` s: it runs the mix of
    several models' blocks, the norms' vectors mixed as weights, each projection once per
    model."""

    def __init__(self, folder, adapter, spec, device, trust_remote_code, dtype=torch.float32):
        super().__init__(folder, adapter, spec, device, trust_remote_code, dtype)
        prefix = adapter.block_modules["block"] + "."
        writers = {adapter.block_modules[role] for role in ("attn_out", "mlp_out")}
        paths = [
            name.removesuffix(".weight")
            for name, param in self.module.named_parameters()
            if name.startswith(prefix) and param.dim() == 2
        ]
        self.mixers = []
        for path in paths:
            mixer = _Mixer(self.module.get_submodule(path), path, path in writers)
            self.module.set_submodule(path, mixer)
            self.mixers.append(mixer)
        # What the call still supplies: the vectors.
        self._block_weights = {n for n, _ in self.module.named_parameters() if n.startswith(prefix)}
        #: Set by the first block laid out: the canonical block's structure (meta tensors),
        #: and the module's name of each of its vectors (norms: what is not a projection's).
        self._template: Block | None = None
        self._vectors: dict[str, str] = {}

    def lay_out(self, block: Block) -> dict[str, torch.Tensor]:
        """See :meth:`BlockMixer.lay_out`."""
        state = dict(self._tensors(block))
        if self._template is None:
            self._locate(block)
            names = {id(tensor): name for name, tensor in iter_tensors(block)}
            for key, tensor in state.items():
                if any(key.startswith(mixer.prefix) for mixer in self.mixers):
                    continue
                if id(tensor) not in names:
                    raise LmcError(f"cannot mix {key}: the adapter computes it from the block")
                self._vectors[names[id(tensor)]] = key
            self._template = map_tensors(block, lambda tensor: tensor.to("meta"))
        return state

    def mixed(
        self,
        states: list[dict[str, torch.Tensor]],
        moves: list[StreamMaps],
        weights: list[float],
        residual: torch.Tensor,
        layer: int,
    ) -> torch.Tensor:
        """See :meth:`BlockMixer.mixed_output`."""
        vectors = []
        for state, move in zip(states, moves, strict=True):
            # The canonical block's vectors (its matrices stay meta: the mixers run them).
            block = map_named_tensors(
                self._template, lambda name, t, state=state: state.get(self._vectors.get(name), t)
            )
            moved = dict(iter_tensors(move.norms(block, layer)))
            vectors.append({key: moved[name] for name, key in self._vectors.items()})
        mixed = {}
        for key in self._vectors.values():
            terms = [w * moved[key] for w, moved in zip(weights, vectors, strict=True)]
            mixed[key] = sum(terms[1:], terms[0]).to(self.device, torch.float32)
        mix = _Mix(states, moves, weights, layer)
        for mixer in self.mixers:
            mixer.mix = mix
        try:
            return self._run(self._checked(mixed), residual)["output"]
        finally:
            for mixer in self.mixers:
                mixer.mix = None

    def _locate(self, block: Block) -> None:
        """Where each mixer's canonical pieces are, found by running its projection (on the
        CPU, in float32, which holds these integers exactly) on a block whose matrices hold
        their own row positions in their first column and column positions in their first
        row: its outputs for the first input feature name the rows they are (the gradient of
        its first output names the columns a writer's inputs are). Outside any autocast or
        graph of the caller's."""
        matrices = [name for name, t in iter_tensors(block) if t.dim() == 2]
        size = 1 + max(max(t.shape) for _, t in iter_tensors(block) if t.dim() == 2)

        def marked(name: str, tensor: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(tensor.shape)
            if tensor.dim() == 2:
                start = 1 + matrices.index(name) * size
                out[:, 0] = start + torch.arange(tensor.shape[0])
                out[0, :] = start + torch.arange(tensor.shape[1])
            return out

        state = dict(self._tensors(map_named_tensors(block, marked)))
        with torch.enable_grad(), torch.autocast("cpu", enabled=False):
            for mixer in self.mixers:
                local = mixer.local(state)
                width = local["weight"].numel() // self.spec.hidden_size
                probe = torch.zeros(1, width if mixer.writer else self.spec.hidden_size)
                probe[0, 0] = 1
                probe.requires_grad_()
                out = functional_call(mixer.projection[0], local, (probe,))[0]
                found = torch.autograd.grad(out[0], probe)[0][0] if mixer.writer else out
                codes = found.detach().round().long() - 1
                if bool((codes < 0).any()):
                    raise LmcError(f"cannot locate the pieces of {mixer.prefix[:-1]}")
                mixer.locate([matrices[i] for i in (codes // size).tolist()], codes % size)


class BlockMixer(BlockRunner):
    """A :class:`~lmc_mergekit.models.block_runner.BlockRunner` that also runs mixes of several
    models' blocks (:meth:`mixed_output`), each layer's in a :class:`_MixingLayer` of its own."""

    @property
    def keeps_attention_scores(self) -> bool:
        """Whether the module's attention keeps its probabilities for the backward (eager
        attention, as transformers runs soft-capped Gemma 2; sdpa keeps none)."""
        return self._layer(0, _MixingLayer).module.config._attn_implementation == "eager"

    def lay_out(self, block: Block, layer: int) -> dict[str, torch.Tensor]:
        """``block`` (layer ``layer``) as :meth:`mixed_output` takes it: its tensors under the
        one-layer module's names, rearranged once where the module fuses them (held so, a
        mix makes no fused copy per call for autograd to keep)."""
        return self._layer(layer, _MixingLayer).lay_out(block)

    def mixed_output(
        self,
        states: list[dict[str, torch.Tensor]],
        moves: list[StreamMaps],
        weights: list[float],
        residual: torch.Tensor,
        layer: int = 0,
    ) -> torch.Tensor:
        """The residual stream after the block ``Σ weights_i·moved_i(block_i)`` (layer
        ``layer``; ``states_i`` is ``block_i`` laid out by :meth:`lay_out`), where ``moved_i``
        is the model's :class:`StreamMaps` ``moves_i``: what learned matching runs its mixes
        through. The norms are moved and mixed as weights; each projection runs once per
        model on its held weights, its input and output moved by the model's maps (no moved or
        mixed matrix is made), which by linearity is what the mixed weights compute.
        Differentiable in the moves, the vectors and ``residual``; the matrices are held."""
        return self._layer(layer, _MixingLayer).mixed(states, moves, weights, residual, layer)
