"""Llama, Mistral and Qwen2: RMSNorm, rotary attention with GQA, SwiGLU MLP."""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import PretrainedConfig

from lmc_mergekit.models.adapters.base import Adapter, read_norm, rope_theta, rotary_dims
from lmc_mergekit.models.checkpoint import CheckpointReader
from lmc_mergekit.models.view import MLP, Attention, Block, Embeddings, Head, ModelSpec


class LlamaAdapter(Adapter):
    """The ``model.layers.N.self_attn.*_proj`` layout shared by Llama, Mistral and Qwen2."""

    model_types = ("llama", "mistral", "qwen2")
    eps_key = "rms_norm_eps"
    block_modules: ClassVar[dict[str, str]] = {
        "block": "model.layers.0",
        "attn_out": "model.layers.0.self_attn.o_proj",
        "mlp_out": "model.layers.0.mlp.down_proj",
        "mlp_norm": "model.layers.0.post_attention_layernorm",
    }
    head_dim_from_hidden: ClassVar[bool] = False
    size_keys: ClassVar[dict[str, str]] = {
        "hidden_size": "hidden_size",
        "num_hidden_layers": "num_layers",
        "num_attention_heads": "num_heads",
        "num_key_value_heads": "num_kv_heads",
        "head_dim": "head_dim",
        "intermediate_size": "intermediate_size",
    }

    def spec_from_config(self, config: PretrainedConfig) -> ModelSpec:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return ModelSpec(
            architecture=config.model_type,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rotary_dims=rotary_dims(config, head_dim),
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            norm="rmsnorm",
            norm_eps=config.rms_norm_eps,
            parallel_residual=False,
            gated_mlp=True,
            activation=config.hidden_act,
            tied_embeddings=bool(config.tie_word_embeddings),
            rope_theta=rope_theta(config),
        )

    def read_embeddings(self, reader: CheckpointReader, spec: ModelSpec) -> Embeddings:
        return Embeddings(tokens=reader.get("model.embed_tokens.weight"))

    def read_block(self, reader: CheckpointReader, spec: ModelSpec, index: int) -> Block:
        p = f"model.layers.{index}."

        def linear(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
            return reader.get(p + name + ".weight"), reader.get(p + name + ".bias", optional=True)

        q, q_bias = linear("self_attn.q_proj")
        k, k_bias = linear("self_attn.k_proj")
        v, v_bias = linear("self_attn.v_proj")
        o, o_bias = linear("self_attn.o_proj")
        gate, gate_bias = linear("mlp.gate_proj")
        up, up_bias = linear("mlp.up_proj")
        down, down_bias = linear("mlp.down_proj")
        return Block(
            attn_norm=read_norm(reader, p + "input_layernorm"),
            attn=Attention(q, k, v, o, q_bias, k_bias, v_bias, o_bias),
            mlp_norm=read_norm(reader, p + "post_attention_layernorm"),
            mlp=MLP(
                up=up,
                down=down,
                gate=gate,
                up_bias=up_bias,
                gate_bias=gate_bias,
                down_bias=down_bias,
            ),
        )

    def read_head(self, reader: CheckpointReader, spec: ModelSpec) -> Head:
        name = "lm_head.weight"
        if spec.tied_embeddings or not reader.has(name):
            name = "model.embed_tokens.weight"
        return Head(norm=read_norm(reader, "model.norm"), weight=reader.get(name))

    def embeddings_tensors(self, emb: Embeddings, spec: ModelSpec) -> dict[str, torch.Tensor]:
        return {"model.embed_tokens.weight": emb.tokens}

    def block_tensors(self, block: Block, spec: ModelSpec, index: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{index}."
        a, m = block.attn, block.mlp
        named = {
            "input_layernorm.weight": block.attn_norm.weight,
            "post_attention_layernorm.weight": block.mlp_norm.weight,
            "self_attn.q_proj.weight": a.q,
            "self_attn.q_proj.bias": a.q_bias,
            "self_attn.k_proj.weight": a.k,
            "self_attn.k_proj.bias": a.k_bias,
            "self_attn.v_proj.weight": a.v,
            "self_attn.v_proj.bias": a.v_bias,
            "self_attn.o_proj.weight": a.o,
            "self_attn.o_proj.bias": a.o_bias,
            "mlp.gate_proj.weight": m.gate,
            "mlp.gate_proj.bias": m.gate_bias,
            "mlp.up_proj.weight": m.up,
            "mlp.up_proj.bias": m.up_bias,
            "mlp.down_proj.weight": m.down,
            "mlp.down_proj.bias": m.down_bias,
        }
        return {p + k: t for k, t in named.items() if t is not None}

    def head_tensors(self, head: Head, spec: ModelSpec) -> dict[str, torch.Tensor]:
        tensors = {"model.norm.weight": head.norm.weight}
        if not spec.tied_embeddings:
            tensors["lm_head.weight"] = head.weight
        return tensors
