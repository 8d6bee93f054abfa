"""Running one transformer block of a model on residual-stream inputs, and watching inside it.

Size conversion works layer by layer: it needs what each block reads and writes (the residual
stream before and after it, the input of the projections that write to the stream). A
:class:`BlockRunner` holds a one-layer stock ``transformers`` module of the architecture and
runs it with :func:`torch.func.functional_call` on a given block's weights, feeding the residual
stream in as ``inputs_embeds`` and stopping right after the block; forward hooks on the modules
the adapter names (:attr:`Adapter.block_modules`) record the activations. The computation is
therefore exactly the one ``transformers`` runs on a written checkpoint, for any supported
family, without a second implementation of attention, rotary embeddings or norms.
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
from lmc_mergekit.models.view import Block, Embeddings, ModelSpec, ModelView


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


class BlockRunner(FunctionalModel):
    """Runs blocks of models of ``spec``'s shape (``folder`` supplies the rest of the config)
    in a one-layer functional model."""

    def __init__(
        self,
        folder: Path,
        adapter: Adapter,
        spec: ModelSpec,
        device: torch.device,
        trust_remote_code: bool = False,
    ):
        if not adapter.block_modules:
            raise LmcError(
                f"the {spec.architecture} adapter names no block modules; layer-by-layer "
                "conversion does not support this architecture"
            )
        problem = adapter.blockwise_problem(read_config(folder))
        if problem is not None:
            raise LmcError(problem)
        one_layer = replace(spec, num_layers=1, tied_embeddings=False)
        super().__init__(folder, adapter, one_layer, device, trust_remote_code)
        modules = dict(self.module.named_modules())
        self._seen: dict[str, torch.Tensor] = {}
        for role in ("attn_out", "mlp_out", "mlp_norm"):
            modules[adapter.block_modules[role]].register_forward_pre_hook(self._reader(role))
        modules[adapter.block_modules["block"]].register_forward_hook(self._after_block)
        # Positions are already in the residual stream that is fed in: learned ones are zeroed.
        self._positions = None
        if spec.learned_positions:
            self._positions = self.adapter.embeddings_tensors(
                Embeddings(
                    tokens=self.module.get_input_embeddings().weight,
                    positions=torch.zeros(spec.learned_positions, spec.hidden_size, device=device),
                ),
                self.spec,
            )

    def _reader(self, role: str):
        def hook(module, args):
            self._seen[role] = args[0]

        return hook

    def _after_block(self, module, args, output):
        self._seen["output"] = output[0] if isinstance(output, tuple) else output
        raise _Stop

    def run(self, block: Block, residual: torch.Tensor) -> BlockActivations:
        """Run ``block`` on the residual stream ``residual`` ``(batch, length, hidden)``."""
        return next(self.each(block, [residual]))

    @torch.no_grad()
    def each(self, block: Block, residuals: Iterable[torch.Tensor]) -> Iterator[BlockActivations]:
        """Run ``block`` on each of ``residuals`` in turn (its weights laid out once)."""
        tensors = self.adapter.block_tensors(block, self.spec, 0)
        state = {
            self.adapter.module_names.get(k, k): t.to(self.device, torch.float32)
            for k, t in tensors.items()
        }
        if self._positions is not None:
            state.update(self._positions)
        for residual in residuals:
            self._seen.clear()
            try:
                functional_call(
                    self.module,
                    state,
                    args=(),
                    kwargs={
                        "inputs_embeds": residual.to(self.device, torch.float32),
                        "use_cache": False,
                    },
                )
            except _Stop:
                pass
            seen = self._seen
            yield BlockActivations(
                output=seen["output"],
                mlp_reads=seen["mlp_norm"],
                attn_out_input=seen["attn_out"],
                mlp_out_input=seen["mlp_out"],
            )

    @torch.no_grad()
    def logits(self, view: ModelView, input_ids: torch.Tensor) -> torch.Tensor:
        """The logits of the model ``view`` (of this runner's shape) on ``input_ids``, computed
        block by block: what a checkpoint written from ``view`` must reproduce."""
        residual = embed(view.embeddings(), input_ids).to(self.device, torch.float32)
        for index in range(view.spec.num_layers):
            residual = self.run(view.block(index), residual).output
        head = view.head()
        norm = [t if t is None else t.to(residual) for t in (head.norm.weight, head.norm.bias)]
        width = (residual.shape[-1],)
        if view.spec.norm == "layernorm":
            normed = F.layer_norm(residual, width, norm[0], norm[1], view.spec.norm_eps)
        else:
            normed = F.rms_norm(residual, width, norm[0], view.spec.norm_eps)
        logits = normed @ head.weight.to(residual).T
        return logits if head.bias is None else logits + head.bias.to(residual)


def embed(embeddings: Embeddings, input_ids: torch.Tensor) -> torch.Tensor:
    """The residual stream entering the first block: token (and learned position) embeddings."""
    residual = embeddings.tokens[input_ids]
    if embeddings.positions is not None:
        residual = residual + embeddings.positions[: input_ids.shape[-1]]
    return residual
