"""Running a ``transformers`` model on weights supplied per call, given in canonical parts.

Learned matching builds new weights at every step from frozen endpoints and small symmetry
parameters; :func:`torch.func.functional_call` runs the stock module on them, so gradients flow
back into the parameters and the forward pass is exactly the one ``transformers`` runs on the
written checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.func import functional_call
from transformers import AutoModelForCausalLM, PretrainedConfig

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.adapters.base import Adapter, load_config
from lmc_mergekit.models.checkpoint import read_config
from lmc_mergekit.models.view import Block, Embeddings, Head, ModelSpec


def module_config(
    folder: Path, adapter: Adapter, spec: ModelSpec, trust_remote_code: bool = False
) -> PretrainedConfig:
    """The transformers config of ``folder``'s model rewritten to describe ``spec``: the config
    a checkpoint of ``spec`` written from ``folder`` gets."""
    config = load_config(folder, trust_remote_code)
    return type(config).from_dict(adapter.updated_config(read_config(folder), spec))


def stock_module(config: PretrainedConfig, device: torch.device, trust_remote_code: bool = False):
    """A float32 module of ``config`` in eval mode with frozen (placeholder) parameters."""
    module = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, trust_remote_code=trust_remote_code
    )
    return module.to(device).eval().requires_grad_(False)


class FunctionalModel:
    """A stock ``transformers`` module of ``folder``'s architecture (embeddings untied, norms'
    eps taken from ``spec``) whose weights come with every call."""

    def __init__(
        self,
        folder: Path,
        adapter: Adapter,
        spec: ModelSpec,
        device: torch.device,
        trust_remote_code: bool = False,
    ):
        config = module_config(folder, adapter, spec, trust_remote_code)
        config.tie_word_embeddings = False
        self.adapter, self.spec = adapter, spec
        self.module = stock_module(config, device, trust_remote_code)
        self.names = {name for name, _ in self.module.named_parameters()}
        self.device = device

    def state(self, emb: Embeddings, blocks: list[Block], head: Head) -> dict[str, torch.Tensor]:
        """The module's parameters from canonical parts (checked once by :meth:`loss`)."""
        return self.adapter.module_state((emb, blocks, head), self.spec)

    def loss(self, state: dict[str, torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of the module with weights ``state`` on ``input_ids``."""
        if state.keys() != self.names:
            missing = sorted(self.names ^ state.keys())[:3]
            raise LmcError(
                f"the {self.spec.architecture} adapter does not name the module's parameters "
                f"({', '.join(missing)}); this architecture cannot be learned functionally"
            )
        out = functional_call(
            self.module, state, args=(), kwargs={"input_ids": input_ids, "labels": input_ids}
        )
        return out.loss
