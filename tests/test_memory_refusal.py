"""Memory known before the work: a pass whose estimated peak does not fit in the memory
available stops in seconds with a one-line error naming what it needs and what would fit, and
writes nothing. The models are real checkpoints of Llama-3.1-405B's shape whose weights are
sparse files (zeros the disk does not store): every header, name and shape is there, and no
weight is read before the refusal."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from tokenizer_helpers import save_tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig

from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.runtime.memory import available_memory

SHAPE = dict(
    hidden_size=16384,
    num_hidden_layers=126,
    num_attention_heads=128,
    num_key_value_heads=8,
    intermediate_size=53248,
    vocab_size=300,  # the tests' tokenizer's
)


#: Bytes of a shard, as checkpoints of this size are shipped.
SHARD = 5 * 10**9


def sparse_checkpoint(folder: Path) -> Path:
    """A bf16 Llama checkpoint of :data:`SHAPE` in shards of :data:`SHARD` bytes that hold
    every tensor of the model as zeros in sparse files, with an index and the tests'
    tokenizer."""
    config = LlamaConfig(**SHAPE, torch_dtype="bfloat16", architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        shapes = {
            n: t.shape for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()
        }
    shards: list[dict] = [{}]
    for name, shape in shapes.items():
        if sum(2 * math.prod(s) for s in shards[-1].values()) + 2 * math.prod(shape) > SHARD:
            shards.append({})
        shards[-1][name] = shape
    folder.mkdir(parents=True)
    weight_map = {}
    for index, shard in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in shard.items():
            size = 2 * math.prod(shape)
            header[name] = {
                "dtype": "BF16",
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
            weight_map[name] = file
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with (folder / file).open("wb") as stream:
            stream.write(struct.pack("<Q", len(text)) + text)
            stream.truncate(8 + len(text) + offset)  # a hole: nothing stored
    total = sum(2 * math.prod(shape) for shape in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config.save_pretrained(folder)
    save_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def huge(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sparse")
    pair = sparse_checkpoint(root / "a"), sparse_checkpoint(root / "b")
    if available_memory() > 4 * 2 * open_model(pair[0]).spec.parameters:
        pytest.skip("this machine has the memory for a 405B pair: nothing to refuse")
    return pair


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_a_merge_larger_than_memory_is_refused_before_any_weight_is_read(huge, tmp_path):
    recipe = {
        "merge_method": "lmc_dm",
        "models": [{"model": str(model), "parameters": {"weight": 0.5}} for model in huge],
        "dtype": "bfloat16",
        "alignment": {"matching": "weights", "steps": 0, "evaluate": False},
    }
    (tmp_path / "recipe.yml").write_text(yaml.safe_dump(recipe))
    script = str(Path(sys.executable).parent / "lmc-mergekit-yaml")
    done = run([script, "recipe.yml", "out", "--lmc-cache", "cache"], tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "matching needs about" in last and "GiB is available" in last, done.stderr[-2000:]
    assert "more memory" in last and not (tmp_path / "out").exists()


def test_a_heal_larger_than_memory_is_refused_with_what_would_help(huge, tmp_path, text):
    """A student whose float32 training state alone exceeds the memory is refused with that,
    not with options that cannot make it fit (checkpointing, a smaller batch)."""
    script = str(Path(sys.executable).parent / "lmc-mergekit")
    command = [script, "heal", str(huge[0]), "out", "--steps", "2", "--data", str(text)]
    done = run([*command, "--seq-len", "32", "--no-teacher", "--batch-size", "1"], tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "healing needs about" in last and "training state alone" in last, last
    assert "smaller model" in last and "--batch-size" not in last
    assert not (tmp_path / "out").exists()
