"""The learned-matching objective: the loss of ``Σ λ_i π_i(Θ_i)`` as a function of the symmetries.

The endpoints ``Θ_i`` are frozen (already moved by weight matching, norms absorbed); ``π_i`` is
the continuous symmetry :class:`LearnedSymmetry` ``i`` stands for. The mix is run part by part:
the embeddings, each block, the head. Each part is one module holding that part of every
endpoint as frozen parameters; its forward rebuilds the endpoints' parts, moves each by its
symmetry with the same differentiable actions that write checkpoints, mixes them with weights
``λ`` and runs the result (a block through a one-layer stock ``transformers`` module,
:class:`~lmc_mergekit.models.block_runner.BlockRunner`). Each block runs under activation
checkpointing, so a step keeps the residual stream between blocks, not a mixed model: memory
is the endpoints plus one block's work.

Under several processes every part module is sharded with torch's FSDP (``fully_shard``): each
process holds a ``1/world_size`` slice of every endpoint, and a part's forward (and its
recomputation in the backward) gathers that part's endpoints, and only that part's, for the
time it runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmc_mergekit.models.block_runner import BlockRunner, embed, final_logits
from lmc_mergekit.models.view import ModelView, iter_tensors, map_named_tensors, map_tensors
from lmc_mergekit.runtime.distributed import Processes
from lmc_mergekit.symmetry.actions import transform_block, transform_embeddings, transform_head
from lmc_mergekit.symmetry.parametrize import LearnedSymmetry
from lmc_mergekit.symmetry.transform import Transform


def endpoint_dtype(device: torch.device) -> torch.dtype:
    """How endpoints are held: bfloat16 on a GPU (learning runs under bf16 autocast there),
    float32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class EndpointPart(nn.Module):
    """One part (the embeddings, a block or the head) of every endpoint, as frozen parameters:
    the unit FSDP shards and gathers."""

    def __init__(self, parts: list, device: torch.device):
        super().__init__()
        dtype = endpoint_dtype(device)
        # The parts' structure, without their data, to rebuild them from the parameters.
        self.templates = [map_tensors(part, lambda t: t.to("meta")) for part in parts]
        for index, part in enumerate(parts):
            for name, tensor in iter_tensors(part):
                data = tensor.to(device=device, dtype=dtype)
                self.register_parameter(_key(index, name), nn.Parameter(data, requires_grad=False))

    def forward(self, compute: Callable, *inputs: torch.Tensor) -> torch.Tensor:
        """``compute(parts, *inputs)``, run while the parameters are gathered."""
        parts = [
            map_named_tensors(template, lambda name, _, i=index: getattr(self, _key(i, name)))
            for index, template in enumerate(self.templates)
        ]
        return compute(parts, *inputs)


def _key(index: int, name: str) -> str:
    return f"e{index}__{name.replace('.', '__')}"


class InterpolationObjective(nn.Module):
    """Frozen endpoints, one :class:`LearnedSymmetry` per endpoint that learns (``None`` for an
    endpoint held fixed), and the runner that evaluates their mix block by block."""

    def __init__(
        self,
        endpoints: list[ModelView],
        symmetries: list[LearnedSymmetry | None],
        runner: BlockRunner,
        processes: Processes | None = None,
    ):
        super().__init__()
        self.spec, self.runner = endpoints[0].spec, runner
        self.symmetries = nn.ModuleList(s for s in symmetries if s is not None)
        self.learns = [symmetry is not None for symmetry in symmetries]
        processes = processes or Processes()
        mesh = processes.mesh(runner.device)

        def part(parts: list) -> EndpointPart:
            module = EndpointPart(parts, runner.device)
            if mesh is not None:
                from torch.distributed.fsdp import fully_shard

                # Explicit: a module sharded on its own is a root, and FSDP keeps a root
                # gathered after its forward unless told otherwise.
                fully_shard(module, mesh=mesh, reshard_after_forward=True)
            return module

        # Read and (when sharded) shard one part at a time: no process holds a whole endpoint.
        self.embeddings = part([view.embeddings() for view in endpoints])
        self.blocks = nn.ModuleList(
            part([view.block(index) for view in endpoints]) for index in range(self.spec.num_layers)
        )
        self.head = part([view.head() for view in endpoints])
        #: The most parts held whole at once while a part ran (forward or recomputation).
        self.most_gathered = 0

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
        learned = iter(self.symmetries)
        return [next(learned).transform() if learns else None for learns in self.learns]

    def forward(self, weights: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss of the mix with ``weights`` on ``input_ids``."""
        spec, transforms = self.spec, self._transforms()
        input_ids = input_ids.to(self.runner.device)

        def moved(parts: list, action: Callable) -> list:
            pairs = zip(parts, transforms, strict=True)
            return [p if t is None else action(p, t) for p, t in pairs]

        def embeddings(parts: list) -> torch.Tensor:
            self._note_gathered()
            mixed = _mix(moved(parts, transform_embeddings), weights)
            return embed(mixed, input_ids, spec).float()

        def block(index: int) -> Callable:
            def run(parts: list, residual: torch.Tensor) -> torch.Tensor:
                self._note_gathered()
                act = lambda b, t: transform_block(b, spec, t, index)  # noqa: E731
                return self.runner.output(_mix(moved(parts, act), weights), residual, index)

            return run

        def loss(parts: list, residual: torch.Tensor) -> torch.Tensor:
            self._note_gathered()
            logits = final_logits(_mix(moved(parts, transform_head), weights), residual, spec)
            # transformers' causal-LM loss: every position predicts the next token.
            return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())

        residual = self.embeddings(embeddings)
        for index, module in enumerate(self.blocks):
            residual = checkpoint(module, block(index), residual, use_reentrant=False)
        return self.head(loss, residual)


def _mix(parts: list, weights: torch.Tensor):
    """``Σ weights_i parts_i``, tensor by tensor."""
    tensors = [dict(iter_tensors(part)) for part in parts]

    def mixed(name: str, _: torch.Tensor) -> torch.Tensor:
        terms = [weight * t[name] for weight, t in zip(weights, tensors, strict=True)]
        return sum(terms[1:], terms[0])

    return map_named_tensors(parts[0], mixed)
