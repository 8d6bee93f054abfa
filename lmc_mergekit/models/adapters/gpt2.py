"""GPT-2: LayerNorm with biases, learned positions, Conv1D weights stored ``(in, out)``, fused
``c_attn`` as ``[Q|K|V]`` column blocks, no rotary, tied embeddings by default."""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import PretrainedConfig

from lmc_mergekit.models.adapters.base import Adapter, read_norm
from lmc_mergekit.models.checkpoint import CheckpointReader
from lmc_mergekit.models.view import MLP, Attention, Block, Embeddings, Head, ModelSpec


class GPT2Adapter(Adapter):
    """``transformer.h.N.*`` with Conv1D weights, transposed to and from the canonical layout."""

    model_types = ("gpt2",)
    eps_key = "layer_norm_epsilon"
    block_modules: ClassVar[dict[str, str]] = {
        "block": "transformer.h.0",
        "attn_out": "transformer.h.0.attn.c_proj",
        "mlp_out": "transformer.h.0.mlp.c_proj",
        "mlp_norm": "transformer.h.0.ln_2",
    }
    size_keys: ClassVar[dict[str, str]] = {
        "n_embd": "hidden_size",
        "n_layer": "num_layers",
        "n_head": "num_heads",
        "n_inner": "intermediate_size",
        "n_positions": "learned_positions",
    }

    def blockwise_problem(self, raw: dict) -> str | None:
        if raw.get("scale_attn_by_inverse_layer_idx"):
            return (
                "this gpt2 model scales attention by its layer index "
                "(scale_attn_by_inverse_layer_idx); it cannot be run block by block (size "
                "conversion, learned matching)"
            )
        return super().blockwise_problem(raw)

    def spec_from_config(self, config: PretrainedConfig) -> ModelSpec:
        d = config.n_embd
        return ModelSpec(
            architecture="gpt2",
            hidden_size=d,
            num_layers=config.n_layer,
            num_heads=config.n_head,
            num_kv_heads=config.n_head,
            head_dim=d // config.n_head,
            rotary_dims=0,
            intermediate_size=config.n_inner or 4 * d,
            vocab_size=config.vocab_size,
            norm="layernorm",
            norm_eps=config.layer_norm_epsilon,
            parallel_residual=False,
            gated_mlp=False,
            activation=config.activation_function,
            tied_embeddings=bool(config.tie_word_embeddings),
            learned_positions=config.n_positions,
        )

    def read_embeddings(self, reader: CheckpointReader, spec: ModelSpec) -> Embeddings:
        return Embeddings(
            tokens=reader.get("transformer.wte.weight"),
            positions=reader.get("transformer.wpe.weight"),
        )

    def read_block(self, reader: CheckpointReader, spec: ModelSpec, index: int) -> Block:
        p = f"transformer.h.{index}."
        q, k, v = reader.get(p + "attn.c_attn.weight").t().chunk(3, dim=0)
        q_bias, k_bias, v_bias = reader.get(p + "attn.c_attn.bias").chunk(3)
        return Block(
            attn_norm=read_norm(reader, p + "ln_1"),
            attn=Attention(
                q,
                k,
                v,
                o=reader.get(p + "attn.c_proj.weight").t(),
                q_bias=q_bias,
                k_bias=k_bias,
                v_bias=v_bias,
                o_bias=reader.get(p + "attn.c_proj.bias"),
            ),
            mlp_norm=read_norm(reader, p + "ln_2"),
            mlp=MLP(
                up=reader.get(p + "mlp.c_fc.weight").t(),
                up_bias=reader.get(p + "mlp.c_fc.bias"),
                down=reader.get(p + "mlp.c_proj.weight").t(),
                down_bias=reader.get(p + "mlp.c_proj.bias"),
            ),
        )

    def read_head(self, reader: CheckpointReader, spec: ModelSpec) -> Head:
        norm = read_norm(reader, "transformer.ln_f")
        return Head(norm=norm, weight=reader.get(self.head_key(reader, spec)))

    def tie_keys(self, reader: CheckpointReader) -> tuple[str, str]:
        return "lm_head.weight", "transformer.wte.weight"

    def embeddings_tensors(self, emb: Embeddings, spec: ModelSpec) -> dict[str, torch.Tensor]:
        return {"transformer.wte.weight": emb.tokens, "transformer.wpe.weight": emb.positions}

    def block_tensors(self, block: Block, spec: ModelSpec, index: int) -> dict[str, torch.Tensor]:
        p = f"transformer.h.{index}."
        a, m = block.attn, block.mlp
        return {
            p + "ln_1.weight": block.attn_norm.weight,
            p + "ln_1.bias": block.attn_norm.bias,
            p + "attn.c_attn.weight": torch.cat([a.q, a.k, a.v], dim=0).t(),
            p + "attn.c_attn.bias": torch.cat([a.q_bias, a.k_bias, a.v_bias]),
            p + "attn.c_proj.weight": a.o.t(),
            p + "attn.c_proj.bias": a.o_bias,
            p + "ln_2.weight": block.mlp_norm.weight,
            p + "ln_2.bias": block.mlp_norm.bias,
            p + "mlp.c_fc.weight": m.up.t(),
            p + "mlp.c_fc.bias": m.up_bias,
            p + "mlp.c_proj.weight": m.down.t(),
            p + "mlp.c_proj.bias": m.down_bias,
        }

    def head_tensors(self, head: Head, spec: ModelSpec) -> dict[str, torch.Tensor]:
        tensors = {
            "transformer.ln_f.weight": head.norm.weight,
            "transformer.ln_f.bias": head.norm.bias,
        }
        if not spec.tied_embeddings:
            tensors["lm_head.weight"] = head.weight
        return tensors
