"""Write small random checkpoints to try the recipes in ``recipes/`` without any download.

    python examples/make_tiny_models.py examples/tiny

creates ``llama-a``, ``llama-b``, ``gpt-neox-a`` and ``gpt-neox-b`` (two seeds of each) there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM


def main(root: Path) -> None:
    families = {
        "llama": lambda: LlamaForCausalLM(
            LlamaConfig(
                vocab_size=512,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=128,
            )
        ),
        "gpt-neox": lambda: GPTNeoXForCausalLM(
            GPTNeoXConfig(
                vocab_size=512,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=256,
                rotary_pct=0.25,
            )
        ),
    }
    for name, build in families.items():
        for seed, tag in ((0, "a"), (1, "b")):
            torch.manual_seed(seed)
            build().save_pretrained(root / f"{name}-{tag}")
            print(f"wrote {root / f'{name}-{tag}'}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/tiny"))
