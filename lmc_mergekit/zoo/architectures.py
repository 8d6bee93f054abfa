"""Configs of the zoo's small models: Pythia-like GPT-NeoX, a small Llama with GQA, and small
models of the modern families (Qwen3, Gemma 2, Gemma 3, Phi-3, OLMo 2) built like the Llama.

All use 32-dimensional heads, so the head count follows from the width, and untied
embeddings by default, so the embedding and the unembedding are separate matrices to align and
merge (``tied`` ties them, as small Llama 3.2, Qwen3 and every Gemma do).
"""

from __future__ import annotations

from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    GPTNeoXConfig,
    LlamaConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    Qwen3Config,
)

from lmc_mergekit.errors import LmcError

HEAD_DIM = 32
# The Llama-shaped families: config class and what each sets beyond the shared sizes. Windows
# are half the zoo's sequence length (set in zoo_config), so that they matter.
LLAMA_LIKE: dict[str, tuple[type, dict]] = {
    "llama": (LlamaConfig, {}),
    "qwen3": (Qwen3Config, {}),
    "gemma2": (Gemma2Config, {"query_pre_attn_scalar": HEAD_DIM}),
    "gemma3": (Gemma3TextConfig, {"query_pre_attn_scalar": HEAD_DIM}),
    "phi3": (Phi3Config, {"partial_rotary_factor": 0.5}),
    "olmo2": (Olmo2Config, {}),
}
ZOO_ARCHITECTURES = ("gpt_neox", *LLAMA_LIKE)


def zoo_config(
    arch: str,
    hidden: int,
    layers: int,
    vocab_size: int,
    seq_len: int,
    special_token_id: int = 0,
    tied: bool = False,
) -> PretrainedConfig:
    """The config of a zoo model; ``special_token_id`` is the tokenizer's ``<|endoftext|>``,
    used as bos, eos and pad; ``tied`` ties the head to the token embeddings."""
    check_architecture(arch, hidden, layers)
    heads = hidden // HEAD_DIM
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=tied,
        bos_token_id=special_token_id,
        eos_token_id=special_token_id,
        pad_token_id=special_token_id,
    )
    if arch == "gpt_neox":
        return GPTNeoXConfig(
            intermediate_size=4 * hidden,
            rotary_pct=0.25,
            use_parallel_residual=True,
            **common,
        )
    config_class, extra = LLAMA_LIKE[arch]
    if arch in ("gemma2", "gemma3"):  # alternating local (windowed) and global layers
        kinds = ("sliding_attention", "full_attention")
        extra = {**extra, "sliding_window": seq_len // 2}
        extra["layer_types"] = [kinds[i % 2] for i in range(layers)]
    return config_class(
        head_dim=HEAD_DIM,
        num_key_value_heads=kv_heads(heads),
        # SwiGLU has three matrices instead of two: 8/3 keeps the MLP's size at that of a 4x MLP.
        intermediate_size=max(HEAD_DIM, round(8 * hidden / 3 / 32) * 32),
        **common,
        **extra,
    )


def check_architecture(arch: str, hidden: int, layers: int) -> None:
    """Refuse an unknown architecture, a width that is not whole heads, or no layers."""
    if arch not in ZOO_ARCHITECTURES:
        raise LmcError(
            f"unknown zoo architecture {arch!r}; choose one of {', '.join(ZOO_ARCHITECTURES)}"
        )
    if hidden <= 0 or hidden % HEAD_DIM:
        raise LmcError(
            f"hidden size {hidden} is not a positive multiple of {HEAD_DIM} (the zoo's head "
            f"size); use e.g. {max(HEAD_DIM, round(hidden / HEAD_DIM) * HEAD_DIM)}"
        )
    if layers <= 0:
        raise LmcError(f"number of layers must be at least 1, not {layers}")


def kv_heads(heads: int) -> int:
    """Key/value heads of the zoo's Llama: half the query heads (the largest proper divisor
    for odd counts), so that grouped-query attention is exercised whenever it can be."""
    if heads < 2:
        return heads
    return max(d for d in range(1, heads // 2 + 1) if heads % d == 0)
