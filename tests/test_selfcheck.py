"""The self-check every written checkpoint passes: block by block, it computes what
``transformers`` computes, and it refuses a wrong function or a layout transformers would not
load."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import VARIANTS, logits, probe_ids

from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.selfcheck import check_same_function, checkpoint_logits


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_blockwise_logits_are_the_transformers_logits(model_dirs, variant):
    folder = model_dirs[variant]
    ids = probe_ids()
    expected = logits(folder, ids)
    actual = checkpoint_logits(folder, ids)
    assert torch.allclose(actual, expected, atol=1e-5, rtol=1e-5)


def _copy_with(source, target, change):
    shutil.copytree(source, target)
    (shard,) = target.glob("*.safetensors")
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return target


def test_a_changed_weight_is_refused(model_dirs, tmp_path):
    source = model_dirs["llama_gqa_tied"]

    def perturb(tensors):
        name = next(n for n in sorted(tensors) if n.endswith("mlp.down_proj.weight"))
        tensors[name] = tensors[name] * 1.01

    candidate = _copy_with(source, tmp_path / "changed", perturb)
    assert check_same_function(source, source) == 0.0
    with pytest.raises(LmcError, match="self-check failed: the transformed model's logits"):
        check_same_function(source, candidate)


def test_a_layout_transformers_would_not_load_is_refused(model_dirs, tmp_path):
    """A tensor our reader never asks for still fails the check: transformers would refuse it."""
    source = model_dirs["qwen3_qk_norm_gqa"]

    def add(tensors):
        tensors["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(4, 4)

    candidate = _copy_with(source, tmp_path / "extra", add)
    with pytest.raises(LmcError, match=r"unexpected keys in extra.*extra_proj"):
        check_same_function(source, candidate)
