"""The families people merge today, each a small delta on the Llama layout (as transformers'
``modular_*.py`` files define them): what each one changes is data on its adapter."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import ClassVar

import torch

from lmc_mergekit.models.adapters.base import first_present
from lmc_mergekit.models.adapters.llama import LlamaAdapter
from lmc_mergekit.models.checkpoint import CheckpointReader
from lmc_mergekit.models.view import Embeddings, ModelSpec


class Qwen3Adapter(LlamaAdapter):
    """Qwen3: Llama with an RMSNorm of ``head_dim`` on queries and keys (one gain for every
    head), applied after the projection and before RoPE."""

    model_types = ("qwen3",)
    qk_norm: ClassVar[str] = "head"


class GemmaAdapter(LlamaAdapter):
    """Gemma: norm gains stored as ``1 + w``, token embeddings multiplied by ``sqrt(d)`` inside
    the model (in the model's dtype), tied embeddings."""

    model_types = ("gemma",)
    norm_offset: ClassVar[float] = 1.0

    def embedding_multiplier(self, hidden_size: int) -> float:
        # transformers keeps sqrt(d) as a float32 buffer and casts it to the weights' dtype; the
        # tool computes in float32.
        return float(torch.tensor(hidden_size**0.5, dtype=torch.float32))


class Gemma2Adapter(GemmaAdapter):
    """Gemma 2: Gemma with sandwich norms (a norm before and after the attention and the MLP),
    attention scaled by ``query_pre_attn_scalar``, soft-capped attention and final logits,
    and alternating sliding-window and full-attention layers."""

    model_types = ("gemma2",)
    block_norms: ClassVar[dict[str, str]] = {
        "attn_norm": "input_layernorm",
        "attn_post_norm": "post_attention_layernorm",
        "mlp_norm": "pre_feedforward_layernorm",
        "mlp_post_norm": "post_feedforward_layernorm",
    }


class Gemma3TextAdapter(Gemma2Adapter):
    """Gemma 3 (text): Gemma 2 with a per-head QK-norm (gains ``1 + w`` too) instead of the
    attention soft-cap, and local layers with their own rotary base."""

    model_types = ("gemma3_text",)
    qk_norm: ClassVar[str] = "head"


class Gemma3Adapter(Gemma3TextAdapter):
    """Gemma 3 with vision (``Gemma3ForConditionalGeneration``, every Gemma 3 from 4B up): the
    Gemma 3 text model under ``language_model``, its config under ``text_config``. The
    projector's matrix (vision width × d) writes pooled image features into the residual
    stream in place of the image tokens' embeddings, so it joins the canonical embeddings
    (:attr:`Embeddings.projector`); the vision tower and the projector's norm act on vision
    features only and are carried through unchanged.

    Checkpoints are read as the Hub stores them (``vision_tower.vision_model.*``), as
    transformers 5 saves them and under transformers' module names (``model.language_model.*``,
    ``model.vision_tower.*``); they are written as transformers 5 saves them.
    """

    model_types = ("gemma3",)
    text_config_key: ClassVar[str | None] = "text_config"
    text_prefixes: ClassVar[tuple[str, ...]] = ("language_model.model.", "model.language_model.")
    head_keys: ClassVar[tuple[str, ...]] = ("language_model.lm_head.weight", "lm_head.weight")
    #: The projector's matrix: the name written, then any other name read.
    projector_keys: ClassVar[tuple[str, ...]] = (
        "multi_modal_projector.mm_input_projection_weight",
        "model.multi_modal_projector.mm_input_projection_weight",
    )
    #: Renames, applied in order, that give carried tensors of any stored layout their
    #: transformers 5 names.
    passthrough_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        ("model.vision_tower.", "vision_tower."),
        ("vision_tower.vision_model.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )

    def read_embeddings(self, reader: CheckpointReader, spec: ModelSpec) -> Embeddings:
        projector = reader.get(first_present(reader, self.projector_keys))
        return replace(super().read_embeddings(reader, spec), projector=projector)

    def embeddings_tensors(self, emb: Embeddings, spec: ModelSpec) -> dict[str, torch.Tensor]:
        return {**super().embeddings_tensors(emb, spec), self.projector_keys[0]: emb.projector}

    def passthrough_keys(self, stored: Iterable[str]) -> dict[str, str]:
        """Every stored tensor outside the text model and the projector's matrix."""
        viewed = (*self.head_keys, *self.projector_keys)
        keys = {}
        for name in sorted(stored):
            if name.startswith(self.text_prefixes) or name in viewed:
                continue
            written = name
            for old, new in self.passthrough_renames:
                if written.startswith(old):
                    written = new + written[len(old) :]
            keys[written] = name
        return keys


class Phi3Adapter(LlamaAdapter):
    """Phi-3: Llama with ``qkv_proj`` (rows ``[Q | K | V]``) and ``gate_up_proj`` (rows
    ``[gate | up]``) stored fused; ``partial_rotary_factor`` below 1 as in Phi-4-mini."""

    model_types = ("phi3",)
    fused_qkv: ClassVar[str | None] = "self_attn.qkv_proj"
    fused_gate_up: ClassVar[str | None] = "mlp.gate_up_proj"


class Olmo2Adapter(LlamaAdapter):
    """OLMo 2: no norm before the attention or the MLP; their outputs are normalised before they
    join the stream (post-norms), and queries and keys are normalised over the whole
    projection."""

    model_types = ("olmo2",)
    block_norms: ClassVar[dict[str, str]] = {
        "attn_post_norm": "post_attention_layernorm",
        "mlp_post_norm": "post_feedforward_layernorm",
    }
    qk_norm: ClassVar[str] = "projection"
