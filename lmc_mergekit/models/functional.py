"""A stock ``transformers`` module of a folder's architecture, described by a canonical spec,
whose weights are supplied per call (:func:`torch.func.functional_call`).

The block runner builds its one-layer modules on this, so learned matching and size conversion
run exactly the computation ``transformers`` runs on a written checkpoint, and gradients flow
back into whatever the supplied weights were built from.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.initialization import no_init_weights

from lmc_mergekit.models.adapters.base import Adapter, load_config
from lmc_mergekit.models.checkpoint import read_config
from lmc_mergekit.models.view import ModelSpec


def module_config(
    folder: Path, adapter: Adapter, spec: ModelSpec, trust_remote_code: bool = False
) -> PretrainedConfig:
    """The transformers config of ``folder``'s model rewritten to describe ``spec``: the config
    a checkpoint of ``spec`` written from ``folder`` gets (of its text model, where the family
    nests one: the canonical view is the text model)."""
    config = load_config(folder, trust_remote_code)
    updated = type(config).from_dict(adapter.updated_config(read_config(folder), spec))
    return adapter.text_config(updated)


def stock_module(
    config: PretrainedConfig,
    device: torch.device,
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
):
    """A module of ``config`` in ``dtype`` (float32 unless told) in eval mode with frozen
    placeholder parameters, left uninitialised: every call supplies the weights it runs
    (initialising a 7B layer's placeholders would take seconds and make their 0.8 GB
    resident; untouched, they are not)."""
    with no_init_weights():
        module = AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=trust_remote_code
        )
    return module.to(device).eval().requires_grad_(False)


class FunctionalModel:
    """A stock ``transformers`` module of ``folder``'s architecture (embeddings untied, norms'
    eps taken from ``spec``) in ``dtype`` whose block weights come with every call."""

    def __init__(
        self,
        folder: Path,
        adapter: Adapter,
        spec: ModelSpec,
        device: torch.device,
        trust_remote_code: bool = False,
        dtype: torch.dtype = torch.float32,
    ):
        config = module_config(folder, adapter, spec, trust_remote_code)
        config.tie_word_embeddings = False
        # The runs feed the residual stream in and stop after a block: the embeddings and the
        # head are never used, so they are placeholders of a one-token vocabulary (a real one
        # would cost vocabulary × width twice: 4.7 GB at Gemma 2's 256k × 2304).
        config.vocab_size, config.pad_token_id = 1, None
        self.adapter, self.spec = adapter, spec
        self.module = stock_module(config, device, trust_remote_code, dtype)
        self.device, self.dtype = device, dtype
