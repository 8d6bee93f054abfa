"""The ``model.layers.N.*`` family: Llama, Mistral, Qwen2, and the modern families that are
small deltas on it (Qwen3, Gemma, Gemma 2, Gemma 3, Phi-3, OLMo 2; see :mod:`.modern`).

An adapter of this family is data: which norms a block has and under which names, whether the
queries and keys are normalised, which projections are stored fused, and the offset its norm
gains are stored with. Reading and writing both go through that one description, so they
cannot drift apart.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import PretrainedConfig

from lmc_mergekit.models.adapters.base import (
    Adapter,
    first_present,
    rope_theta,
    rope_type,
    rotary_dims,
)
from lmc_mergekit.models.checkpoint import CheckpointReader
from lmc_mergekit.models.view import MLP, Attention, Block, Embeddings, Head, ModelSpec, Norm

#: The canonical norm slots of a block (see :class:`~lmc_mergekit.models.view.Block`).
NORM_SLOTS = ("attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm")


class LlamaAdapter(Adapter):
    """The ``model.layers.N.self_attn.*_proj`` layout shared by Llama, Mistral and Qwen2."""

    model_types = ("llama", "mistral", "qwen2")
    eps_key = "rms_norm_eps"
    head_dim_from_hidden: ClassVar[bool] = False
    size_keys: ClassVar[dict[str, str]] = {
        "hidden_size": "hidden_size",
        "num_hidden_layers": "num_layers",
        "num_attention_heads": "num_heads",
        "num_key_value_heads": "num_kv_heads",
        "head_dim": "head_dim",
        "intermediate_size": "intermediate_size",
    }
    #: Canonical norm slot → the norm's module name in a block; slots not named are absent.
    block_norms: ClassVar[dict[str, str]] = {
        "attn_norm": "input_layernorm",
        "mlp_norm": "post_attention_layernorm",
    }
    #: Module names of the query and key norms (``ModelSpec.qk_norm`` says over what).
    qk_norm_names: ClassVar[tuple[str, str]] = ("self_attn.q_norm", "self_attn.k_norm")
    qk_norm: ClassVar[str] = "none"
    #: Where q, k and v are stored as one projection, rows ``[Q | K | V]`` (Phi-3).
    fused_qkv: ClassVar[str | None] = None
    #: Where the MLP's gate and up projections are stored as one, rows ``[gate | up]``.
    fused_gate_up: ClassVar[str | None] = None
    #: Added to every stored norm parameter to give its gain (Gemma: ``1 + w``).
    norm_offset: ClassVar[float] = 0.0
    #: Where the text model's tensors sit: the prefix written, then any other prefix read (a
    #: multimodal family nests the text model, and tools save it under different names).
    text_prefixes: ClassVar[tuple[str, ...]] = ("model.",)
    #: The LM head's key: the name written, then any other name read.
    head_keys: ClassVar[tuple[str, ...]] = ("lm_head.weight",)

    @property
    def block_modules(self) -> dict[str, str]:  # type: ignore[override]
        """The block's modules size conversion watches (the MLP itself where it reads the
        stream without a norm)."""
        mlp_reads = self.block_norms.get("mlp_norm", "mlp")
        return {
            "block": "model.layers.0",
            "attn_out": "model.layers.0.self_attn.o_proj",
            "mlp_out": "model.layers.0.mlp.down_proj",
            "mlp_norm": f"model.layers.0.{mlp_reads}",
        }

    def spec_from_config(self, config: PretrainedConfig) -> ModelSpec:
        # The outer model ties (or not) its head to the text model's embeddings.
        tied = bool(config.tie_word_embeddings)
        architecture, config = config.model_type, self.text_config(config)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return ModelSpec(
            architecture=architecture,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rotary_dims=rotary_dims(config, head_dim),
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            norm="rmsnorm",
            norm_eps=getattr(config, self.eps_key),
            parallel_residual=False,
            gated_mlp=True,
            activation=getattr(config, "hidden_activation", None) or config.hidden_act,
            tied_embeddings=tied,
            rope_theta=rope_theta(config),
            norm_offset=self.norm_offset,
            pre_norms="attn_norm" in self.block_norms,
            post_norms="attn_post_norm" in self.block_norms,
            qk_norm=self.qk_norm,
            embedding_multiplier=self.embedding_multiplier(config.hidden_size),
            query_pre_attn_scalar=getattr(config, "query_pre_attn_scalar", None),
            attn_softcap=getattr(config, "attn_logit_softcapping", None),
            final_softcap=getattr(config, "final_logit_softcapping", None),
            layer_types=tuple(getattr(config, "layer_types", None) or ()),
            rope_type=rope_type(config),
        )

    def module_key(self, key: str) -> str:
        """Checkpoint keys under the written text prefix (and the head) as the stock module of
        the text config names them."""
        prefix = self.text_prefixes[0]
        if key.startswith(prefix):
            return "model." + key[len(prefix) :]
        return "lm_head.weight" if key == self.head_keys[0] else super().module_key(key)

    # ---- reading ------------------------------------------------------------------------

    def _prefix(self, reader: CheckpointReader) -> str:
        """The prefix ``reader``'s checkpoint stores the text model under."""
        stored = (p for p in self.text_prefixes if reader.has(p + "embed_tokens.weight"))
        return next(stored, self.text_prefixes[0])

    def read_embeddings(self, reader: CheckpointReader, spec: ModelSpec) -> Embeddings:
        return Embeddings(tokens=reader.get(self._prefix(reader) + "embed_tokens.weight"))

    def _norm(self, reader: CheckpointReader, name: str) -> Norm:
        return Norm(reader.get(name + ".weight"), offset=self.norm_offset)

    def read_block(self, reader: CheckpointReader, spec: ModelSpec, index: int) -> Block:
        p = f"{self._prefix(reader)}layers.{index}."

        def linear(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
            return reader.get(p + name + ".weight"), reader.get(p + name + ".bias", optional=True)

        if self.fused_qkv is None:
            (q, q_bias), (k, k_bias), (v, v_bias) = (linear(f"self_attn.{x}_proj") for x in "qkv")
        else:
            sizes = _qkv_sizes(spec)
            (q, q_bias), (k, k_bias), (v, v_bias) = _split(*linear(self.fused_qkv), sizes)
        if self.fused_gate_up is None:
            (gate, gate_bias), (up, up_bias) = linear("mlp.gate_proj"), linear("mlp.up_proj")
        else:
            half = [spec.intermediate_size] * 2
            (gate, gate_bias), (up, up_bias) = _split(*linear(self.fused_gate_up), half)
        o, o_bias = linear("self_attn.o_proj")
        down, down_bias = linear("mlp.down_proj")
        q_norm = k_norm = None
        if self.qk_norm != "none":
            q_norm, k_norm = (self._norm(reader, p + name) for name in self.qk_norm_names)
        norms = {slot: self._norm(reader, p + name) for slot, name in self.block_norms.items()}
        return Block(
            attn_norm=norms.get("attn_norm"),
            attn=Attention(q, k, v, o, q_bias, k_bias, v_bias, o_bias, q_norm, k_norm),
            mlp_norm=norms.get("mlp_norm"),
            mlp=MLP(
                up=up,
                down=down,
                gate=gate,
                up_bias=up_bias,
                gate_bias=gate_bias,
                down_bias=down_bias,
            ),
            attn_post_norm=norms.get("attn_post_norm"),
            mlp_post_norm=norms.get("mlp_post_norm"),
        )

    def tie_keys(self, reader: CheckpointReader) -> tuple[str, str]:
        return first_present(reader, self.head_keys), self._prefix(reader) + "embed_tokens.weight"

    def read_head(self, reader: CheckpointReader, spec: ModelSpec) -> Head:
        norm = self._norm(reader, self._prefix(reader) + "norm")
        return Head(norm=norm, weight=reader.get(self.head_key(reader, spec)))

    # ---- writing ------------------------------------------------------------------------

    def embeddings_tensors(self, emb: Embeddings, spec: ModelSpec) -> dict[str, torch.Tensor]:
        return {self.text_prefixes[0] + "embed_tokens.weight": emb.tokens}

    def block_tensors(self, block: Block, spec: ModelSpec, index: int) -> dict[str, torch.Tensor]:
        p = f"{self.text_prefixes[0]}layers.{index}."
        a, m = block.attn, block.mlp
        named = {}
        if self.fused_qkv is None:
            for x, weight, bias in (
                ("q", a.q, a.q_bias),
                ("k", a.k, a.k_bias),
                ("v", a.v, a.v_bias),
            ):
                named[f"self_attn.{x}_proj.weight"], named[f"self_attn.{x}_proj.bias"] = (
                    weight,
                    bias,
                )
        else:
            named.update(
                _fused(self.fused_qkv, [(a.q, a.q_bias), (a.k, a.k_bias), (a.v, a.v_bias)])
            )
        if self.fused_gate_up is None:
            named.update(
                {
                    "mlp.gate_proj.weight": m.gate,
                    "mlp.gate_proj.bias": m.gate_bias,
                    "mlp.up_proj.weight": m.up,
                    "mlp.up_proj.bias": m.up_bias,
                }
            )
        else:
            named.update(_fused(self.fused_gate_up, [(m.gate, m.gate_bias), (m.up, m.up_bias)]))
        named.update(
            {
                "self_attn.o_proj.weight": a.o,
                "self_attn.o_proj.bias": a.o_bias,
                "mlp.down_proj.weight": m.down,
                "mlp.down_proj.bias": m.down_bias,
            }
        )
        if self.qk_norm != "none":
            for name, norm in zip(self.qk_norm_names, (a.q_norm, a.k_norm), strict=True):
                named[name + ".weight"] = norm.weight
        for slot, name in self.block_norms.items():
            named[name + ".weight"] = getattr(block, slot).weight
        return {p + k: t for k, t in named.items() if t is not None}

    def head_tensors(self, head: Head, spec: ModelSpec) -> dict[str, torch.Tensor]:
        tensors = {self.text_prefixes[0] + "norm.weight": head.norm.weight}
        if not spec.tied_embeddings:
            tensors[self.head_keys[0]] = head.weight
        return tensors


def _qkv_sizes(spec: ModelSpec) -> list[int]:
    kv = spec.num_kv_heads * spec.head_dim
    return [spec.num_heads * spec.head_dim, kv, kv]


def _split(
    weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """A fused projection's rows (and bias) split into the parts of ``sizes``."""
    weights = weight.split(sizes)
    biases = [None] * len(sizes) if bias is None else bias.split(sizes)
    return list(zip(weights, biases, strict=True))


def _fused(name: str, parts: list[tuple[torch.Tensor, torch.Tensor | None]]) -> dict:
    """The inverse of :func:`_split`: the parts' rows (and biases) stacked in order."""
    tensors = {name + ".weight": torch.cat([weight for weight, _ in parts])}
    if parts[0][1] is not None:
        tensors[name + ".bias"] = torch.cat([bias for _, bias in parts])
    return tensors
