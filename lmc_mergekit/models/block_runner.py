"""Running one transformer block of a model on residual-stream inputs, and watching inside it.

Size conversion works layer by layer: it needs what each block reads and writes (the residual
stream before and after it, the input of the projections that write to the stream). A
:class:`BlockRunner` holds a one-layer stock ``transformers`` module of the architecture and
runs it with :func:`torch.func.functional_call` on a given block's weights, feeding the residual
stream in as ``inputs_embeds`` and stopping right after the block; forward hooks on the modules
the adapter names (:attr:`Adapter.block_modules`) record the activations. The computation is
therefore exactly the one ``transformers`` runs on a written checkpoint, for any supported
family, without a second implementation of attention, rotary embeddings or norms.

The embedding, final norm and head helpers (:func:`embed`, :func:`final_logits`,
:func:`head_logits`) compute the rest of the model around the blocks. Mixes of several models'
blocks run in :mod:`lmc_mergekit.models.block_mixing`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
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


class OneLayer(FunctionalModel):
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
        self._layers: dict[tuple[type, tuple[str, ...]], OneLayer] = {}

    def _layer(self, index: int, kind: type[OneLayer] = OneLayer) -> OneLayer:
        """The one-layer module of class ``kind`` (a subclass's, such as the mixer's) for layer
        ``index``'s attention type, made once."""
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
