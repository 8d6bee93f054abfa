"""Structured pruning by another tool, at the shape ``subclone_compensate`` converts to.

torch-pruning (``pip install torch-pruning==1.6.1``, or ``pip install -e '.[bench]'``) with the
settings of its LLM example (``examples/LLMs/prune_llm.py``): ``BasePruner``, one pruning ratio
for the hidden size and the MLP, query heads pruned per key/value group, the head dimension
kept, the LM head ignored (its input channels follow the stream). On transformers 5 it needs
eager attention (SDPA runs grouped-query attention without ``repeat_kv``, so the graph does not
couple queries with keys and values: its step fails) and ``use_cache=False`` (the cache in the
output breaks its tracing). It never removes key/value heads: SmolLM2's 9/3 heads become 6/3
at d=384 (groups of two), not the family's 6/2.

The importance is Taylor's (weight × gradient, summed over a group), from gradients on the
same calibration text a conversion reads (the bundled corpus's train split, its texts in equal
shares); L2 magnitude did far worse in a trial on SmolLM2 (11.9 against 8.1 nats on Austen,
zero-shot at d=384).
"""

from __future__ import annotations

import importlib.metadata
import time
from pathlib import Path

import torch

from lmc_mergekit.data import DataConfig, load_tokenizer, sample_split
from lmc_mergekit.models.checkpoint import copy_tagalong_files, stored_dtype

#: Calibration sequences for the gradients, and per backward pass.
CALIBRATION = 64
BATCH = 8


def version() -> str | None:
    """torch-pruning's installed version (its distribution's: 1.6.1's ``__version__`` still
    says 1.6.0), or None when it is not installed."""
    try:
        return importlib.metadata.version("torch-pruning")
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_pruning(source: Path, out: Path, hidden_size: int, num_attention_heads: int) -> dict:
    """``source`` (a Llama-family checkpoint) pruned by torch-pruning to ``hidden_size`` and
    ``num_attention_heads`` (the MLP by the hidden size's ratio) and saved to ``out`` in its
    dtype with its tokenizer; the shape reached, parameters and seconds."""
    import torch_pruning as tp
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.float32, attn_implementation="eager"
    )
    config = model.config
    config.use_cache = False
    ratio = 1 - hidden_size / config.hidden_size
    heads = {}
    for layer in model.model.layers:
        attention = layer.self_attn
        heads[attention.q_proj] = config.num_attention_heads
        heads[attention.k_proj] = heads[attention.v_proj] = config.num_key_value_heads
    tokenizer = load_tokenizer([source])
    calibration, _ = sample_split(DataConfig(), tokenizer, "train", CALIBRATION)
    pruner = tp.pruner.BasePruner(
        model,
        example_inputs=calibration[:1, :16],
        importance=tp.importance.GroupTaylorImportance(),
        global_pruning=False,
        pruning_ratio=ratio,
        ignored_layers=[model.lm_head],
        num_heads=heads,
        prune_num_heads=True,
        prune_head_dims=False,
        # Four decimals: at 1 - 6/9 = 0.33333333333333337 it prunes no head at all.
        head_pruning_ratio=round(1 - num_attention_heads / config.num_attention_heads, 4),
        round_to=4,
    )
    model.zero_grad()
    for batch in calibration.split(BATCH):
        (model(input_ids=batch, labels=batch).loss * len(batch) / len(calibration)).backward()
    for group in pruner.step(interactive=True):
        group.prune()
    model.zero_grad(set_to_none=True)
    if config.tie_word_embeddings:  # pruned alike, but as two tensors: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    first = model.model.layers[0]
    attention = first.self_attn
    # Heads first: the config checks that the width is a multiple of them on every change.
    config.num_attention_heads = attention.q_proj.out_features // attention.head_dim
    config.num_key_value_heads = attention.k_proj.out_features // attention.head_dim
    config.hidden_size = model.model.embed_tokens.weight.shape[1]
    config.intermediate_size = first.mlp.gate_proj.out_features
    config.use_cache = True
    model.to(stored_dtype(source)).save_pretrained(out)
    copy_tagalong_files(source, out)
    return {
        "shape": f"d{config.hidden_size}, {config.num_attention_heads}/"
        f"{config.num_key_value_heads} heads, MLP {config.intermediate_size}",
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.perf_counter() - started, 1),
    }
