"""Running one transformer block of a model on residual-stream inputs, and watching inside it.

Size conversion works layer by layer: it needs what each block reads and writes (the residual
stream before and after it, the input of the projections that write to the stream). A
:class:`BlockRunner` holds a one-layer stock ``transformers`` module of the architecture and
runs it with :func:`torch.func.functional_call` on a given block's weights, feeding the residual
stream in as ``inputs_embeds`` and stopping right after the block; forward hooks on the modules
the adapter names (:attr:`Adapter.block_modules`) record the activations. The computation is
therefore exactly the one ``transformers`` runs on a written checkpoint, for any supported
family, without a second implementation of attention, rotary embeddings or norms.

Learned matching runs mixes of several models' blocks, each model moved by its own symmetry,
through a second such module whose projections are stand-ins (:class:`_Mixer`): each runs
the module's own projection once per model, on that model's weights, with the model's moves
(:class:`StreamMaps`) on its input and output, and sums them; the norms, the attention and
the MLP around them run unchanged. Where each canonical piece sits in a fused projection's
outputs is found by running the projection itself on weights that hold their own positions,
so no layout is known here that the adapter does not write.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.adapters.base import Adapter
from lmc_mergekit.models.checkpoint import read_config
from lmc_mergekit.models.functional import FunctionalModel
from lmc_mergekit.models.view import (
    VOCAB_ROWS,
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


@dataclass(frozen=True)
class BlockActivations:
    """What one block read and wrote, each ``(batch, length, features)``.

    ``mlp_reads`` is the residual stream the MLP's norm reads: the block's input when the
    residual is parallel, the stream after the attention otherwise.
    """

    output: torch.Tensor
    mlp_reads: torch.Tensor
    attn_out_input: torch.Tensor
    mlp_out_input: torch.Tensor


class _Stop(Exception):
    """Raised by the hook after the block: nothing later in the module needs to run."""


class _OneLayer(FunctionalModel):
    """A one-layer stock module of the architecture, with hooks on the modules the adapter
    names, run on one block's weights."""

    def __init__(self, folder, adapter, spec, device, trust_remote_code, dtype=torch.float32):
        super().__init__(folder, adapter, spec, device, trust_remote_code, dtype)
        modules = dict(self.module.named_modules())
        self.seen: dict[str, torch.Tensor] = {}
        for role in ("attn_out", "mlp_out", "mlp_norm"):
            modules[adapter.block_modules[role]].register_forward_pre_hook(self._reader(role))
        modules[adapter.block_modules["block"]].register_forward_hook(self._after_block)
        # Every weight of the block must come with the call: one left out would silently run
        # the module's random placeholder.
        prefix = adapter.block_modules["block"] + "."
        self._block_weights = {n for n, _ in self.module.named_parameters() if n.startswith(prefix)}
        # Positions are already in the residual stream that is fed in: learned ones are zeroed.
        self._positions = None
        if spec.learned_positions:
            self._positions = self.adapter.embeddings_tensors(
                Embeddings(
                    tokens=self.module.get_input_embeddings().weight,
                    positions=torch.zeros(
                        spec.learned_positions, spec.hidden_size, device=device, dtype=dtype
                    ),
                ),
                self.spec,
            )

    def _reader(self, role: str):
        def hook(module, args):
            self.seen[role] = args[0]

        return hook

    def _after_block(self, module, args, output):
        self.seen["output"] = output[0] if isinstance(output, tuple) else output
        raise _Stop

    def _state(self, block: Block) -> dict[str, torch.Tensor]:
        """The module's weights for ``block`` (as layer 0), in its dtype on its device."""
        return self._checked({k: t.to(self.device, self.dtype) for k, t in self._tensors(block)})

    def _tensors(self, block: Block) -> Iterator[tuple[str, torch.Tensor]]:
        """``block``'s tensors (as layer 0) under the module's names, as they are."""
        for key, tensor in self.adapter.block_tensors(block, self.spec, 0).items():
            yield self.adapter.module_key(key), tensor

    def _checked(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` with the zeroed learned positions, once every block weight is in it."""
        missing = self._block_weights - state.keys()
        if missing:
            raise LmcError(
                f"the {self.spec.architecture} adapter does not name the module's block weights "
                f"({', '.join(sorted(missing)[:3])}); this architecture cannot be run block by "
                "block"
            )
        if self._positions is not None:
            state.update(self._positions)
        return state

    def _run(self, state: dict[str, torch.Tensor], residual: torch.Tensor) -> dict:
        self.seen.clear()
        try:
            functional_call(
                self.module,
                state,
                args=(),
                kwargs={"inputs_embeds": residual.to(self.device), "use_cache": False},
            )
        except _Stop:
            pass
        seen, self.seen = self.seen, {}
        return seen

    def output(self, block: Block, residual: torch.Tensor) -> torch.Tensor:
        """The residual stream after ``block`` (differentiable in both)."""
        return self._run(self._state(block), residual)["output"]

    @torch.no_grad()
    def each(self, block: Block, residuals: Iterable[torch.Tensor]) -> Iterator[BlockActivations]:
        state = self._state(block)
        for residual in residuals:
            seen = self._run(state, residual.to(self.dtype))
            yield BlockActivations(
                output=seen["output"],
                mlp_reads=seen["mlp_norm"],
                attn_out_input=seen["attn_out"],
                mlp_out_input=seen["mlp_out"],
            )


class StreamMaps(Protocol):
    """How one model of a mix is moved, seen from a block's activations: what
    :meth:`BlockRunner.mixed_output` asks of each model (learned matching's
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


class _MixingLayer(_OneLayer):
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
        """See :meth:`BlockRunner.lay_out`."""
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
        """See :meth:`BlockRunner.mixed_output`."""
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


class BlockRunner:
    """Runs blocks of models of ``spec``'s shape (``folder`` supplies the rest of the config),
    each in a one-layer functional model of its layer's attention type, in ``dtype`` (float32;
    the self-check's reference runs in float64)."""

    def __init__(
        self,
        folder: Path,
        adapter: Adapter,
        spec: ModelSpec,
        device: torch.device,
        trust_remote_code: bool = False,
        dtype: torch.dtype = torch.float32,
    ):
        if not adapter.block_modules:
            raise LmcError(
                f"the {spec.architecture} adapter names no block modules; running it block by "
                "block (size conversion, learned matching) is not supported"
            )
        problem = adapter.blockwise_problem(read_config(folder))
        if problem is not None:
            raise LmcError(problem)
        self.folder, self.adapter, self.spec, self.device = folder, adapter, spec, device
        self.dtype, self._trust_remote_code = dtype, trust_remote_code
        self._layers: dict[tuple[type, tuple[str, ...]], _OneLayer] = {}

    def _layer(self, index: int, kind: type[_OneLayer] = _OneLayer) -> _OneLayer:
        types = self.spec.layer_types[index : index + 1]
        if (kind, types) not in self._layers:
            one = replace(self.spec, num_layers=1, tied_embeddings=False, layer_types=types)
            self._layers[kind, types] = kind(
                self.folder, self.adapter, one, self.device, self._trust_remote_code, self.dtype
            )
        return self._layers[kind, types]

    def run(self, block: Block, residual: torch.Tensor, layer: int = 0) -> BlockActivations:
        """Run ``block`` (layer ``layer`` of the model) on the residual stream ``residual``
        ``(batch, length, hidden)``."""
        return next(self.each(block, [residual], layer))

    def each(
        self, block: Block, residuals: Iterable[torch.Tensor], layer: int = 0
    ) -> Iterator[BlockActivations]:
        """Run ``block`` (layer ``layer``) on each of ``residuals`` in turn (its weights laid
        out once)."""
        return self._layer(layer).each(block, residuals)

    @torch.no_grad()
    def logits(self, view: ModelView, input_ids: torch.Tensor) -> torch.Tensor:
        """The logits of the model ``view`` (of this runner's shape) on ``input_ids``, computed
        block by block: what a checkpoint written from ``view`` must reproduce."""
        spec = view.spec
        residual = embedded(view, input_ids).to(self.device, self.dtype)
        for index in range(spec.num_layers):
            residual = self.run(view.block(index), residual, index).output
        chunks = row_chunks(view, "head", VOCAB_ROWS)
        return torch.cat([final_logits(head, residual, spec) for head in chunks], dim=-1)

    def output(self, block: Block, residual: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """The residual stream after ``block`` (layer ``layer``), differentiable in the block's
        weights and in ``residual``."""
        return self._layer(layer).output(block, residual)

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


def final_logits(head: Head, residual: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """The logits the final norm and the head compute from the last residual stream
    (differentiable; soft-capped where the family caps them)."""
    normed = final_norm(head.norm, residual, spec)
    return soft_capped(head_logits(normed, head.weight, head.bias), spec)


def final_norm(norm: Norm, residual: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """The final norm of the residual stream (differentiable)."""
    gain, bias = (t if t is None else t.to(residual) for t in (norm.gain, norm.bias))
    width = (residual.shape[-1],)
    if spec.norm == "layernorm":
        return F.layer_norm(residual, width, gain, bias, spec.norm_eps)
    return F.rms_norm(residual, width, gain, spec.norm_eps)


#: Vocabulary rows of a half-precision head cast to the states' dtype at a time.
HEAD_ROWS = 16384
#: Bytes of float32 logits one piece of a loss makes at a time (the cross-entropy copies them
#: once more, its gradient again): 64 tokens at a 262k vocabulary, 341 at 49k.
LOGITS_BYTES = 64 * 2**20


def loss_tokens(vocab_size: int) -> int:
    """Tokens whose float32 logits over ``vocab_size`` fit :data:`LOGITS_BYTES` (one at
    least): how many a chunked loss runs through the head at a time."""
    return max(1, LOGITS_BYTES // (4 * vocab_size))


def head_logits(
    states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``states·Wᵀ + b``. A frozen head stored in another dtype is cast a slice of vocabulary
    rows at a time, in the forward and again in the backward: never a whole vocab × d copy
    (under autocast, autocast casts)."""
    sliced = weight.dtype != states.dtype and not weight.requires_grad
    if sliced and not torch.is_autocast_enabled(states.device.type):
        logits = _FrozenHead.apply(states, weight)
    else:
        logits = states @ weight.to(states).T
    return logits if bias is None else logits + bias.to(states)


class _FrozenHead(torch.autograd.Function):
    """``states·Wᵀ`` for a frozen ``W`` of another dtype, cast :data:`HEAD_ROWS` rows at a
    time; the backward casts the slices again rather than keeping them."""

    @staticmethod
    def forward(ctx, states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.dtype = states.dtype
        out = states.new_empty(*states.shape[:-1], len(weight))
        for start in range(0, len(weight), HEAD_ROWS):  # filled in place: no second copy
            rows = weight[start : start + HEAD_ROWS].to(states.device, states.dtype)
            out[..., start : start + len(rows)] = states @ rows.T
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        rows = torch.split(weight, HEAD_ROWS)
        grads = torch.split(grad, HEAD_ROWS, dim=-1)
        total = sum(g @ r.to(g.device, ctx.dtype) for g, r in zip(grads, rows, strict=True))
        return total, None


def soft_capped(logits: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """``c·tanh(logits/c)`` where the family caps its final logits."""
    if not spec.final_softcap:
        return logits
    return spec.final_softcap * torch.tanh(logits / spec.final_softcap)


def embedded(view: ModelView, input_ids: torch.Tensor) -> torch.Tensor:
    """:func:`embed` of ``input_ids`` by ``view``'s embeddings, read (moved, mixed) a slice of
    vocabulary rows at a time (:func:`~lmc_mergekit.models.view.row_chunks`), only the rows
    of the tokens in ``input_ids`` kept: no whole float32 or float64 vocabulary."""
    rows, positions = torch.unique(input_ids.cpu(), return_inverse=True)
    pieces, first, start = [], None, 0
    for chunk in row_chunks(view, "embeddings", VOCAB_ROWS):
        stop = start + len(chunk.tokens)
        inside = rows[(rows >= start) & (rows < stop)]
        pieces.append(chunk.tokens[(inside - start).to(chunk.tokens.device)])
        first, start = first or chunk, stop
    table = replace(first, tokens=torch.cat(pieces))
    return embed(table, positions.to(input_ids.device), view.spec)


def embed(embeddings: Embeddings, input_ids: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """The residual stream entering the first block: token embeddings (times the family's
    multiplier) and learned positions, in float32 at least (a half-precision product would
    round the stream before the first block), on the device of ``input_ids``. Rows are picked
    where the table lies: a vocabulary read to the CPU is never copied whole to the GPU."""
    table = embeddings.tokens
    residual = table[input_ids.to(table.device)].to(input_ids.device)
    if residual.dtype in (torch.bfloat16, torch.float16):
        residual = residual.float()
    if spec.embedding_multiplier != 1.0:
        residual = residual * spec.embedding_multiplier
    if embeddings.positions is not None:
        residual = residual + embeddings.positions[: input_ids.shape[-1]].to(residual.device)
    return residual
