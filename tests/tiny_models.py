"""Tiny random checkpoints of every supported architecture, built in code for the tests."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 96

# name -> (model class, config class, config kwargs); sizes stay tiny so each case takes < 1 s.
VARIANTS = {
    "gpt_neox_partial_rotary_parallel": (
        GPTNeoXForCausalLM,
        GPTNeoXConfig,
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=96,
            rotary_pct=0.25,
            use_parallel_residual=True,
        ),
    ),
    "gpt_neox_sequential_full_rotary": (
        GPTNeoXForCausalLM,
        GPTNeoXConfig,
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=96,
            rotary_pct=1.0,
            use_parallel_residual=False,
        ),
    ),
    "llama": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=80,
        ),
    ),
    "llama_gqa_tied": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            intermediate_size=80,
            tie_word_embeddings=True,
        ),
    ),
    "mistral_gqa": (
        MistralForCausalLM,
        MistralConfig,
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=80,
            sliding_window=None,
        ),
    ),
    "qwen2_gqa_bias_tied": (
        Qwen2ForCausalLM,
        Qwen2Config,
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=80,
            tie_word_embeddings=True,
        ),
    ),
    "gpt2_tied": (
        GPT2LMHeadModel,
        GPT2Config,
        dict(n_embd=48, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0),
    ),
    # The modern families: QK-norm with GQA and a head size that is not hidden / heads, ...
    "qwen3_qk_norm_gqa": (
        Qwen3ForCausalLM,
        Qwen3Config,
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=80,
        ),
    ),
    # ... offset gains, the sqrt(d) embedding multiplier and tied embeddings, ...
    "gemma": (
        GemmaForCausalLM,
        GemmaConfig,
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=80,
        ),
    ),
    # ... sandwich norms, soft-caps that bite and alternating windows shorter than the probe, ...
    "gemma2_softcap_windows": (
        Gemma2ForCausalLM,
        Gemma2Config,
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=80,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=3.0,
            sliding_window=8,
        ),
    ),
    "gemma3_text": (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=80,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    # ... fused projections with partial rotary (Phi-4-mini), and post-norms only.
    "phi3_partial_rotary": (
        Phi3ForCausalLM,
        Phi3Config,
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=80,
            partial_rotary_factor=0.5,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
    "olmo2": (
        Olmo2ForCausalLM,
        Olmo2Config,
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=80,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
}


def build_model(variant: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random model of ``variant`` into ``folder``.

    Norm gains and biases are randomised too (a fresh model has gains 1 and biases 0, which
    would hide any mistake in norm absorption), and weights are larger than the default init so
    that logits are far from uniform.
    """
    model_cls, config_cls, kwargs = VARIANTS[variant]
    torch.manual_seed(seed)
    config = config_cls(**{"vocab_size": VOCAB, **kwargs, **overrides})
    model = model_cls(config).eval()
    randomise_weights(model)
    model.save_pretrained(folder)
    return folder


def stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in ``folder``, across its shards."""
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """float32 logits of a saved checkpoint, loaded through transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def probe_ids(seed: int = 0, shape: tuple[int, int] = (2, 24)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


# A multimodal Gemma 3 (Gemma3ForConditionalGeneration): the gemma3_text variant's text model,
# a one-layer SigLIP tower on 32×32 images in 8×8 patches (16 patches pooled into 4 image
# tokens), the vision head kept (real Gemma 3 drops it: its tensors test the carrying).
GEMMA3_IMAGE_TOKEN = VOCAB - 1
GEMMA3_IMAGE_TOKENS = 4
GEMMA3_IMAGE_SIZE = 32


def build_gemma3_multimodal(folder: Path, seed: int = 0, **text_overrides) -> Path:
    """Save a tiny random multimodal Gemma 3 into ``folder`` (weights randomised as
    :func:`build_model` does: gains and biases too)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    _, _, text = VARIANTS["gemma3_text"]
    config = Gemma3Config(
        text_config={"vocab_size": VOCAB, **text, **text_overrides},
        vision_config=dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=GEMMA3_IMAGE_SIZE,
            patch_size=8,
        ),
        mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
        image_token_index=GEMMA3_IMAGE_TOKEN,
        boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2,
    )
    model = Gemma3ForConditionalGeneration(config).eval()
    randomise_weights(model)
    model.save_pretrained(folder)
    return folder


def randomise_weights(model: torch.nn.Module) -> None:
    """Biases ~0.1, norm gains ~1 ± 0.3 and matrices ~0.15, from torch's global generator."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
            elif param.ndim == 1:  # norm gains
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))


def gemma3_image_inputs(seed: int = 0, length: int = 16) -> dict[str, torch.Tensor]:
    """Two sequences of ``length`` token ids, each holding one image (its tokens placed after
    the first quarter), with its pixel values and token types."""
    ids = probe_ids(seed, (2, length)) % (GEMMA3_IMAGE_TOKEN - 3)  # no special ids by chance
    start = length // 4
    ids[:, start : start + GEMMA3_IMAGE_TOKENS] = GEMMA3_IMAGE_TOKEN
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(2, 3, GEMMA3_IMAGE_SIZE, GEMMA3_IMAGE_SIZE, generator=generator)
    return {
        "input_ids": ids,
        "pixel_values": pixels,
        "token_type_ids": (ids == GEMMA3_IMAGE_TOKEN).long(),
    }
