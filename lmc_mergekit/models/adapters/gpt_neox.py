"""GPT-NeoX (Pythia): LayerNorm with biases, fused per-head ``[q|k|v]``, partial rotary,
parallel or sequential residual."""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import PretrainedConfig

from lmc_mergekit.models.adapters.base import (
    Adapter,
    first_present,
    read_norm,
    rope_theta,
    rope_type,
    rotary_dims,
)
from lmc_mergekit.models.checkpoint import CheckpointReader
from lmc_mergekit.models.view import MLP, Attention, Block, Embeddings, Head, ModelSpec

# Hub checkpoints (Pythia) name the head embed_out; some tools write lm_head.
HEAD_NAMES = ("embed_out.weight", "lm_head.weight")


class GPTNeoXAdapter(Adapter):
    """``gpt_neox.layers.N.attention.query_key_value`` holds rows grouped per head as q, k, v."""

    model_types = ("gpt_neox",)
    eps_key = "layer_norm_eps"
    module_names: ClassVar[dict[str, str]] = {"embed_out.weight": "lm_head.weight"}
    block_modules: ClassVar[dict[str, str]] = {
        "block": "gpt_neox.layers.0",
        "attn_out": "gpt_neox.layers.0.attention.dense",
        "mlp_out": "gpt_neox.layers.0.mlp.dense_4h_to_h",
        "mlp_norm": "gpt_neox.layers.0.post_attention_layernorm",
    }
    size_keys: ClassVar[dict[str, str]] = {
        "hidden_size": "hidden_size",
        "num_hidden_layers": "num_layers",
        "num_attention_heads": "num_heads",
        "intermediate_size": "intermediate_size",
    }

    def spec_from_config(self, config: PretrainedConfig) -> ModelSpec:
        heads = config.num_attention_heads
        head_dim = config.hidden_size // heads
        return ModelSpec(
            architecture="gpt_neox",
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=head_dim,
            rotary_dims=rotary_dims(config, head_dim),
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            norm="layernorm",
            norm_eps=config.layer_norm_eps,
            parallel_residual=bool(config.use_parallel_residual),
            gated_mlp=False,
            activation=config.hidden_act,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            rope_theta=rope_theta(config),
            rope_type=rope_type(config),
        )

    def read_embeddings(self, reader: CheckpointReader, spec: ModelSpec) -> Embeddings:
        return Embeddings(tokens=reader.get("gpt_neox.embed_in.weight"))

    def read_block(self, reader: CheckpointReader, spec: ModelSpec, index: int) -> Block:
        p = f"gpt_neox.layers.{index}."
        d, h = spec.hidden_size, spec.num_heads
        qkv = reader.get(p + "attention.query_key_value.weight").reshape(h, 3, -1, d)
        qkv_bias = reader.get(p + "attention.query_key_value.bias", optional=True)
        q, k, v = (qkv[:, i].reshape(-1, d) for i in range(3))
        biases = (None, None, None)
        if qkv_bias is not None:
            qkv_bias = qkv_bias.reshape(h, 3, -1)
            biases = tuple(qkv_bias[:, i].reshape(-1) for i in range(3))
        return Block(
            attn_norm=read_norm(reader, p + "input_layernorm"),
            attn=Attention(
                q,
                k,
                v,
                o=reader.get(p + "attention.dense.weight"),
                q_bias=biases[0],
                k_bias=biases[1],
                v_bias=biases[2],
                o_bias=reader.get(p + "attention.dense.bias", optional=True),
            ),
            mlp_norm=read_norm(reader, p + "post_attention_layernorm"),
            mlp=MLP(
                up=reader.get(p + "mlp.dense_h_to_4h.weight"),
                up_bias=reader.get(p + "mlp.dense_h_to_4h.bias", optional=True),
                down=reader.get(p + "mlp.dense_4h_to_h.weight"),
                down_bias=reader.get(p + "mlp.dense_4h_to_h.bias", optional=True),
            ),
        )

    def read_head(self, reader: CheckpointReader, spec: ModelSpec) -> Head:
        norm = read_norm(reader, "gpt_neox.final_layer_norm")
        return Head(norm=norm, weight=reader.get(self.head_key(reader, spec)))

    def tie_keys(self, reader: CheckpointReader) -> tuple[str, str]:
        return first_present(reader, HEAD_NAMES), "gpt_neox.embed_in.weight"

    def embeddings_tensors(self, emb: Embeddings, spec: ModelSpec) -> dict[str, torch.Tensor]:
        return {"gpt_neox.embed_in.weight": emb.tokens}

    def block_tensors(self, block: Block, spec: ModelSpec, index: int) -> dict[str, torch.Tensor]:
        p = f"gpt_neox.layers.{index}."
        d, h = spec.hidden_size, spec.num_heads
        a, m = block.attn, block.mlp
        named = {
            "input_layernorm.weight": block.attn_norm.weight,
            "input_layernorm.bias": block.attn_norm.bias,
            "post_attention_layernorm.weight": block.mlp_norm.weight,
            "post_attention_layernorm.bias": block.mlp_norm.bias,
            "attention.query_key_value.weight": torch.stack(
                [t.reshape(h, -1, d) for t in (a.q, a.k, a.v)], dim=1
            ).reshape(-1, d),
            "attention.dense.weight": a.o,
            "attention.dense.bias": a.o_bias,
            "mlp.dense_h_to_4h.weight": m.up,
            "mlp.dense_h_to_4h.bias": m.up_bias,
            "mlp.dense_4h_to_h.weight": m.down,
            "mlp.dense_4h_to_h.bias": m.down_bias,
        }
        if a.q_bias is not None:
            named["attention.query_key_value.bias"] = torch.stack(
                [t.reshape(h, -1) for t in (a.q_bias, a.k_bias, a.v_bias)], dim=1
            ).reshape(-1)
        return {p + k: t for k, t in named.items() if t is not None}

    def head_tensors(self, head: Head, spec: ModelSpec) -> dict[str, torch.Tensor]:
        tensors = {
            "gpt_neox.final_layer_norm.weight": head.norm.weight,
            "gpt_neox.final_layer_norm.bias": head.norm.bias,
        }
        if not spec.tied_embeddings:
            tensors["embed_out.weight"] = head.weight
        return tensors
