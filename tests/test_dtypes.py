"""Checkpoints stored as users hold them: bf16 and fp16, and with tensors of several dtypes (bf16
weights, float32 norms). Every pass writes each tensor in its input's dtype, and the self-check
holds them to the exact transform rounded once, not to a fraction of the logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_models import logits, probe_ids
from tokenizer_helpers import model_with_tokenizer
from transformers import AutoModelForCausalLM

from lmc_mergekit.cli import main
from lmc_mergekit.plugin.cli import mergekit_yaml_main


def stored_dtypes(folder: Path) -> dict[str, str]:
    """Each stored tensor's dtype as safetensors names it (``BF16``, ``F32``)."""
    dtypes = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as fp:
            for name in fp.keys():
                dtypes[name] = fp.get_slice(name).get_dtype()
    return dtypes


def in_dtype(source: Path, folder: Path, dtype: torch.dtype, norms: torch.dtype | None = None):
    """``source`` saved in ``dtype``; with ``norms``, its 1-d tensors (norm gains, biases) in
    that dtype instead (a mixed-dtype checkpoint)."""
    AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype).save_pretrained(folder)
    for tokenizer_file in source.glob("tokenizer*"):
        shutil.copy(tokenizer_file, folder / tokenizer_file.name)
    if norms is not None:
        (shard,) = folder.glob("*.safetensors")
        tensors = load_file(shard)
        tensors = {k: t.to(norms) if t.ndim == 1 else t for k, t in tensors.items()}
        save_file(tensors, shard, metadata={"format": "pt"})
    return folder


def same_dtypes(source: Path, out: Path) -> None:
    """Every tensor ``out`` shares with ``source`` has its dtype; a head written where the
    source tied it has the embedding's."""
    before, after = stored_dtypes(source), stored_dtypes(out)
    for name, dtype in after.items():
        expected = before.get(name)
        if expected is None:  # an untied head
            expected = next(d for n, d in before.items() if "embed" in n or "wte" in n)
        assert dtype == expected, (name, dtype, expected)


@pytest.mark.parametrize(
    ("variant", "dtype", "norms"),
    [
        ("llama_gqa_tied", torch.bfloat16, None),
        ("gpt_neox_partial_rotary_parallel", torch.float16, None),
        ("gemma2_softcap_windows", torch.bfloat16, torch.float32),
        ("qwen3_qk_norm_gqa", torch.bfloat16, torch.float32),
    ],
)
def test_scramble_and_transform_keep_each_tensors_dtype(
    model_dirs, tmp_path, variant, dtype, norms
):
    source = in_dtype(model_dirs[variant], tmp_path / "source", dtype, norms)
    saved = tmp_path / "t.safetensors"
    result = CliRunner().invoke(
        main, ["scramble", str(source), str(tmp_path / "s"), "--save-transform", str(saved)]
    )
    assert result.exit_code == 0, result.output
    error = float(result.output.split("to ")[-1].split(" ")[0])
    assert error < 1e-4  # the function check runs the exact transform in float32
    same_dtypes(source, tmp_path / "s")
    back = CliRunner().invoke(
        main, ["transform", str(tmp_path / "s"), str(saved), str(tmp_path / "b"), "--inverse"]
    )
    assert back.exit_code == 0, back.output
    same_dtypes(source, tmp_path / "b")
    ids = probe_ids()
    expected = logits(source, ids)
    # Two roundings to the storage dtype apart from the source: close, not equal.
    scale = float(expected.abs().max())
    assert float((logits(tmp_path / "b", ids) - expected).abs().max()) < 0.1 * scale


def run_yaml(recipe: dict, tmp_path: Path, out: Path):
    path = tmp_path / f"recipe-{len(list(tmp_path.glob('recipe-*')))}.yml"
    path.write_text(yaml.safe_dump(recipe))
    return CliRunner().invoke(mergekit_yaml_main, [str(path), str(out), "--quiet"])


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory) -> tuple[Path, Path]:
    """Two tied Llama models with a tokenizer, in bf16 with float32 norms."""
    root = tmp_path_factory.mktemp("bf16-pair")
    return tuple(
        in_dtype(
            model_with_tokenizer(root / f"f32-{seed}", "llama_gqa_tied", seed=seed),
            root / f"bf16-{seed}",
            torch.bfloat16,
            torch.float32,
        )
        for seed in (1, 2)
    )


def test_lmc_dm_prepares_bf16_inputs_in_their_dtypes(bf16_pair, tmp_path):
    recipe = {
        "merge_method": "lmc_dm",
        "models": [{"model": str(p), "parameters": {"weight": 0.5}} for p in bf16_pair],
        "dtype": "bfloat16",
        "alignment": {"steps": 2, "batch_size": 2, "seq_len": 32, "eval_sequences": 4},
    }
    out = tmp_path / "merged"
    result = run_yaml(recipe, tmp_path, out)
    assert result.exit_code == 0, result.output
    cache = Path(next(iter((tmp_path / "lmc-cache" / "lmc_dm").glob("*/model-0"))))
    same_dtypes(bf16_pair[0], cache)
    assert stored_dtypes(cache)["model.norm.weight"] == "F32"
    assert stored_dtypes(cache)["model.layers.0.mlp.up_proj.weight"] == "BF16"
    assert set(stored_dtypes(out).values()) == {"BF16"}  # the recipe's dtype
    AutoModelForCausalLM.from_pretrained(str(out))


@pytest.mark.parametrize("variant", ["llama", "gemma3_text"])  # Gemma: norms stored as gain - 1
def test_subclone_keeps_a_fp16_donors_dtype(tmp_path, variant):
    f32 = model_with_tokenizer(tmp_path / "f32", variant)
    donor = in_dtype(f32, tmp_path / "fp16", torch.float16)
    recipe = {
        "merge_method": "subclone_compensate",
        "models": [{"model": str(donor)}],
        "subclone": {"hidden_size": 32, "num_attention_heads": 4, "evaluate": False},
    }
    result = run_yaml(recipe, tmp_path, tmp_path / "small")
    assert result.exit_code == 0, result.output
    cache = next(iter((tmp_path / "lmc-cache" / "subclone_compensate").glob("*/model-0")))
    same_dtypes(donor, Path(cache))


def test_ls_merge_prepares_mixed_dtype_inputs_in_their_dtypes(bf16_pair, tmp_path):
    recipe = {
        "merge_method": "ls_merge",
        "models": [{"model": str(p), "parameters": {"weight": 0.5}} for p in bf16_pair],
        "latent": {"steps": 20, "width": 32, "evaluate": False, "noise_floor": False},
    }
    out = tmp_path / "merged"
    result = run_yaml(recipe, tmp_path, out)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "ls_report.json").read_text())
    for source, entry in zip(bf16_pair, report["inputs"], strict=True):
        same_dtypes(source, Path(entry["prepared"]))
    same_dtypes(bf16_pair[0], out)  # no dtype in the recipe: each tensor keeps its own
