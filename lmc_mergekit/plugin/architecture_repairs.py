"""Repairs of mergekit 0.1.5's architecture definitions that current checkpoints do not match.

GPT-NeoX: the shipped ``gpt-neox.json`` requires ``attention.bias``, ``attention.masked_bias`` and
``attention.rotary_emb.inv_freq`` in every layer; checkpoints saved by current transformers lack
these buffers, so every GPT-NeoX merge fails. The repaired entry marks them optional and lets the
head be read under either of its names (``embed_out`` on the Hub, ``lm_head`` from some tools).
"""

from __future__ import annotations

import importlib.resources
import json

import mergekit._data.architectures
from mergekit.architecture import json_definitions

ARCH_NAME = "GPTNeoXForCausalLM"
OPTIONAL_SUFFIXES = ("attention.bias", "attention.masked_bias", "attention.rotary_emb.inv_freq")


def repaired_definition() -> dict:
    """The GPT-NeoX definition with the stale buffers optional and the head aliased."""
    text = importlib.resources.files(mergekit._data.architectures).joinpath("gpt-neox.json")
    data = json.loads(text.read_text())
    for weight in data["layer_templates"]["weights"]:
        if weight["name"].endswith(OPTIONAL_SUFFIXES):
            weight["optional"] = True
    for weight in data["post_weights"]:
        if weight["name"] == "embed_out.weight":
            weight["aliases"] = ["lm_head.weight"]
    return data


def repair_architectures() -> None:
    """Replace mergekit's entries by the repaired ones (idempotent)."""
    fixed = json_definitions._load_architecture_json(json.dumps(repaired_definition()))
    entries = json_definitions.NAME_TO_ARCH.get(ARCH_NAME, [])
    json_definitions.NAME_TO_ARCH[ARCH_NAME] = [
        fixed if arch.expected_model_type == "gpt_neox" else arch for arch in entries
    ] or [fixed]
