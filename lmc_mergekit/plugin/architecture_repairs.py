"""Repairs of mergekit 0.1.5's architecture definitions that current checkpoints do not match,
in force during the plugin's own merges only (:func:`repaired_architectures`): mergekit's
commands, the start-up hook loaded or not, merge built-in recipes with mergekit's definitions.

- GPT-NeoX: the shipped ``gpt-neox.json`` requires ``attention.bias``,
  ``attention.masked_bias`` and ``attention.rotary_emb.inv_freq`` in every layer; checkpoints
  saved by current transformers lack these buffers, so every GPT-NeoX merge fails. They become
  optional, and the head is read under either of its names (``embed_out`` on the Hub,
  ``lm_head`` from some tools).
- Gemma has no ``lm_head`` at all, and Phi-3 requires one: a Gemma whose head was untied (by any
  residual rotation, so by every ``lmc_dm`` merge) would silently lose it in a merge, and a Phi
  model with tied embeddings (Phi-4-mini) fails. Both get the optional head, tied to the
  embeddings, that the Llama definition has.
- Multimodal Gemma 3 (``gemma3vl.json``) names the vision tower as the Hub stores it
  (``vision_tower.vision_model.*``); transformers 5 saves it as ``vision_tower.*``, so every
  merge of such a checkpoint (and of every folder the plugin writes) fails. The tower's
  tensors get their transformers 5 names with the Hub names as aliases, and the SigLIP
  attention-pooling head (``vision_use_head``) as optional tensors.
"""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mergekit._data.architectures
from mergekit.architecture import json_definitions

TIED_HEAD = {
    "name": "lm_head.weight",
    "vocabulary_axis": 0,
    "optional": True,
    "tied_names": ["model.embed_tokens.weight"],
}


def _gpt_neox(data: dict) -> None:
    stale = ("attention.bias", "attention.masked_bias", "attention.rotary_emb.inv_freq")
    for weight in data["layer_templates"]["weights"]:
        if weight["name"].endswith(stale):
            weight["optional"] = True
    for weight in data["post_weights"]:
        if weight["name"] == "embed_out.weight":
            weight["aliases"] = ["lm_head.weight"]


# The SigLIP vision tower's attention-pooling head (present where ``vision_use_head`` is true).
SIGLIP_HEAD = (
    "head.probe",
    "head.attention.in_proj_weight",
    "head.attention.in_proj_bias",
    "head.attention.out_proj.weight",
    "head.attention.out_proj.bias",
    "head.layernorm.weight",
    "head.layernorm.bias",
    "head.mlp.fc1.weight",
    "head.mlp.fc1.bias",
    "head.mlp.fc2.weight",
    "head.mlp.fc2.bias",
)


def _gemma3_vision_tower(data: dict) -> None:
    tower = data["modules"]["vision_tower"]
    hub = tower["weight_prefix"].removeprefix("vision_tower.")  # "vision_model."
    tower["weight_prefix"] = "vision_tower."
    definition = tower["architecture"]
    for weights in (
        definition["pre_weights"],
        definition["layer_templates"]["weights"],
        definition["post_weights"],
    ):
        for weight in weights:
            weight["aliases"] = [hub + weight["name"]]
    # No aliases here: mergekit 0.1.5 fails on an optional weight with aliases (it adds a
    # tuple to a list); the Hub's Gemma 3 towers have no head anyway.
    definition["post_weights"] += [{"name": name, "optional": True} for name in SIGLIP_HEAD]


def _optional_tied_head(data: dict) -> None:
    data["post_weights"] = [w for w in data["post_weights"] if w["name"] != "lm_head.weight"]
    data["post_weights"].append(dict(TIED_HEAD))


@dataclass(frozen=True)
class Repair:
    """One definition file, the architecture and model type it is registered under, and the
    edit that makes it match current checkpoints."""

    file: str
    architecture: str
    model_type: str
    edit: Callable[[dict], None]

    def definition(self) -> dict:
        """The repaired definition."""
        text = importlib.resources.files(mergekit._data.architectures).joinpath(self.file)
        data = json.loads(text.read_text())
        self.edit(data)
        return data


REPAIRS = (
    Repair("gpt-neox.json", "GPTNeoXForCausalLM", "gpt_neox", _gpt_neox),
    Repair("gemma.json", "GemmaForCausalLM", "gemma", _optional_tied_head),
    Repair("phi3.json", "Phi3ForCausalLM", "phi3", _optional_tied_head),
    Repair("gemma3vl.json", "Gemma3ForConditionalGeneration", "gemma3", _gemma3_vision_tower),
)


@contextmanager
def repaired_architectures() -> Iterator[None]:
    """mergekit's entries replaced by the repaired ones for the block, and put back after."""
    saved = {r.architecture: json_definitions.NAME_TO_ARCH.get(r.architecture) for r in REPAIRS}
    repair_architectures()
    try:
        yield
    finally:
        for architecture, entries in saved.items():
            if entries is None:
                json_definitions.NAME_TO_ARCH.pop(architecture, None)
            else:
                json_definitions.NAME_TO_ARCH[architecture] = entries


def repair_architectures() -> None:
    """Replace mergekit's entries by the repaired ones (idempotent; new lists, so that what
    :func:`repaired_architectures` saved stays as it was)."""
    for repair in REPAIRS:
        fixed = json_definitions._load_architecture_json(json.dumps(repair.definition()))
        entries = json_definitions.NAME_TO_ARCH.get(repair.architecture, [])
        json_definitions.NAME_TO_ARCH[repair.architecture] = [
            fixed if arch.expected_model_type == repair.model_type else arch for arch in entries
        ] or [fixed]
