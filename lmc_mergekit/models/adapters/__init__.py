"""Architecture adapters and the lookup from a checkpoint folder to its adapter."""

from __future__ import annotations

from pathlib import Path

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.adapters.base import Adapter, CheckpointView, load_config
from lmc_mergekit.models.adapters.gpt2 import GPT2Adapter
from lmc_mergekit.models.adapters.gpt_neox import GPTNeoXAdapter
from lmc_mergekit.models.adapters.llama import LlamaAdapter
from lmc_mergekit.models.adapters.modern import (
    Gemma2Adapter,
    Gemma3Adapter,
    Gemma3TextAdapter,
    GemmaAdapter,
    Olmo2Adapter,
    Phi3Adapter,
    Qwen3Adapter,
)
from lmc_mergekit.models.checkpoint import check_checkpoint, model_dir, read_config

ADAPTERS: tuple[Adapter, ...] = (
    GPTNeoXAdapter(),
    LlamaAdapter(),
    GPT2Adapter(),
    Qwen3Adapter(),
    GemmaAdapter(),
    Gemma2Adapter(),
    Gemma3TextAdapter(),
    Gemma3Adapter(),
    Phi3Adapter(),
    Olmo2Adapter(),
)
SUPPORTED_MODEL_TYPES = tuple(sorted(t for a in ADAPTERS for t in a.model_types))


def adapter_for(model_type: str) -> Adapter:
    """The adapter for a config.json ``model_type``, or an error listing the supported ones."""
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            return adapter
    raise LmcError(
        f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


def open_model(path: str | Path, trust_remote_code: bool = False) -> CheckpointView:
    """A lazy canonical view of the checkpoint folder at ``path``."""
    folder = model_dir(path)
    check_checkpoint(folder)
    model_type = read_config(folder).get("model_type")
    adapter = adapter_for(str(model_type))
    return adapter.open(folder, load_config(folder, trust_remote_code))


__all__ = [
    "ADAPTERS",
    "SUPPORTED_MODEL_TYPES",
    "Adapter",
    "CheckpointView",
    "adapter_for",
    "open_model",
]
