"""The learned-matching objective: the loss of ``Σ λ_i π_i(Θ_i)`` as a function of the symmetries.

The endpoints ``Θ_i`` are frozen (already moved by weight matching, norms absorbed); ``π_i`` is
the continuous symmetry :class:`LearnedSymmetry` ``i`` stands for. Each call moves every
endpoint by its current symmetry with the same differentiable actions that write checkpoints,
mixes the results with weights ``λ``, and runs the stock ``transformers`` module on the mix. No
copy of a whole model is kept between calls.
"""

from __future__ import annotations

import torch
from torch import nn

from lmc_mergekit.models.functional import FunctionalModel
from lmc_mergekit.models.view import InMemoryView, map_tensors
from lmc_mergekit.symmetry.actions import transform_block, transform_embeddings, transform_head
from lmc_mergekit.symmetry.parametrize import LearnedSymmetry


class InterpolationObjective(nn.Module):
    """Frozen endpoints, one :class:`LearnedSymmetry` per endpoint that learns (``None`` for an
    endpoint held fixed), and the module that evaluates their mix."""

    def __init__(
        self,
        endpoints: list[InMemoryView],
        symmetries: list[LearnedSymmetry | None],
        model: FunctionalModel,
    ):
        super().__init__()
        self.endpoints = [_on(view, model.device) for view in endpoints]
        self.learns = [symmetry is not None for symmetry in symmetries]
        self.symmetries = nn.ModuleList(s for s in symmetries if s is not None)
        self.model = model
        # An endpoint held fixed has the same module state at every step.
        self.fixed_states = {
            index: model.state(view.embeddings_, view.blocks, view.head_)
            for index, (view, learns) in enumerate(zip(self.endpoints, self.learns, strict=True))
            if not learns
        }

    def mixed_state(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """The module state of ``Σ weights_i π_i(Θ_i)``."""
        learned = iter(self.symmetries)
        mixed: dict[str, torch.Tensor] = {}
        for index, (weight, view) in enumerate(zip(weights, self.endpoints, strict=True)):
            state = self.fixed_states.get(index)
            if state is None:
                t = next(learned).transform()
                state = self.model.state(
                    transform_embeddings(view.embeddings_, t),
                    [transform_block(b, view.spec, t, i) for i, b in enumerate(view.blocks)],
                    transform_head(view.head_, t),
                )
            for name, tensor in state.items():
                term = weight * tensor
                mixed[name] = term if name not in mixed else mixed[name] + term
        return mixed

    def forward(self, weights: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss of the mix with ``weights`` on ``input_ids``."""
        return self.model.loss(self.mixed_state(weights), input_ids)


def _on(view: InMemoryView, device: torch.device) -> InMemoryView:
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=torch.float32) if t.is_floating_point() else t.to(device)

    return InMemoryView(
        spec=view.spec,
        embeddings_=map_tensors(view.embeddings_, move),
        blocks=[map_tensors(block, move) for block in view.blocks],
        head_=map_tensors(view.head_, move),
    )
