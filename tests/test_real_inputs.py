"""Models as mergekit's users name them: Hub ids (with and without a revision) read from a
Hugging Face cache laid out as huggingface_hub lays it out, offline; LoRA adapters merged as
mergekit merges them; and the device a plugin pass runs on when the user names none."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from hub_cache import commit_id, publish
from mergekit.options import MergeOptions
from safetensors.torch import load_file
from tokenizer_helpers import model_with_tokenizer

from lmc_mergekit.errors import LmcError
from lmc_mergekit.passes.device import pass_device, with_default_device
from lmc_mergekit.plugin.cli import mergekit_yaml_main
from lmc_mergekit.plugin.pipeline import run_recipe

ALIGN = {"steps": 0, "eval_sequences": 8, "points": 3}


def hub_recipe(a: str, b: str, **alignment) -> dict:
    return {
        "merge_method": "lmc_dm",
        "models": [
            {"model": a, "parameters": {"weight": 0.5}},
            {"model": b, "parameters": {"weight": 0.5}},
        ],
        "dtype": "float32",
        "alignment": {**ALIGN, **alignment},
    }


def write(tmp_path: Path, recipe: dict) -> Path:
    path = tmp_path / f"recipe-{len(list(tmp_path.glob('recipe-*')))}.yml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    """A Hugging Face cache holding org/model-a at main (commit 1) and org/model-b only as
    commit 2 (no branch points at it)."""
    root = tmp_path_factory.mktemp("hub-models")
    cache = root / "hub"
    publish(cache, "org/model-a", model_with_tokenizer(root / "a", seed=1), commit_id(1))
    publish(cache, "org/model-b", model_with_tokenizer(root / "b", seed=2), commit_id(2), None)
    return cache


def test_hub_ids_resolve_from_the_cache_offline_and_the_card_names_them(hub, tmp_path):
    """--transformers-cache names the cache; the pass's inputs are the commits' snapshots."""
    recipe = hub_recipe("org/model-a", f"org/model-b@{commit_id(2)}")
    options = MergeOptions(quiet=True, transformers_cache=str(hub))
    out = run_recipe(write(tmp_path, recipe), tmp_path / "out", options, tmp_path / "c")
    report = yaml.safe_load((out / "lmc_report.json").read_text())
    snapshots = [Path(path) for path in report["inputs"]]
    assert [p.name for p in snapshots] == [commit_id(1), commit_id(2)]
    assert all(p.parent.name == "snapshots" for p in snapshots)
    assert report["pairs"][0]["raw"]["barrier"] > 0  # evaluated through the models' tokenizer
    card = (out / "README.md").read_text()
    assert "[org/model-a](https://huggingface.co/org/model-a)" in card
    assert f"`org/model-b@{commit_id(2)}`" in card  # the pre-merge table, as written
    metadata = yaml.safe_load(card.split("---")[1])
    assert metadata["base_model"] == ["org/model-a", "org/model-b"]
    assert str(hub) not in card.split("## Pre-merge pass")[0]


@pytest.mark.slow
def test_prepared_inputs_are_keyed_by_the_resolved_commit(hub, tmp_path):
    """Moving ``main`` to a new commit prepares the inputs again; the same commit reuses them."""
    cache = tmp_path / "hub"
    shutil.copytree(hub, cache, symlinks=True)
    options = MergeOptions(quiet=True, transformers_cache=str(cache))
    recipe = write(tmp_path, hub_recipe("org/model-a", f"org/model-b@{commit_id(2)}"))
    lmc = tmp_path / "lmc"
    run_recipe(recipe, tmp_path / "one", options, lmc)
    run_recipe(recipe, tmp_path / "two", options, lmc)
    assert len(list((lmc / "lmc_dm").glob("*/preparation.json"))) == 1
    new = model_with_tokenizer(tmp_path / "a3", seed=3)
    publish(cache, "org/model-a", new, commit_id(3))
    run_recipe(recipe, tmp_path / "three", options, lmc)
    entries = list((lmc / "lmc_dm").glob("*/preparation.json"))
    assert len(entries) == 2
    report = yaml.safe_load((tmp_path / "three" / "lmc_report.json").read_text())
    assert Path(report["inputs"][0]).name == commit_id(3)


def test_a_model_missing_from_the_cache_offline_is_one_line(hub, tmp_path):
    recipe = write(tmp_path, hub_recipe("org/model-a", "org/not-downloaded"))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        mergekit_yaml_main, [str(recipe), str(out), "--transformers-cache", str(hub), "--quiet"]
    )
    assert result.exit_code == 1
    (message,) = result.output.strip().splitlines()
    assert "'org/not-downloaded' is not in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE" in message and not out.exists()
    # Offline, a revision the cache lacks is the same: nothing to resolve it with.
    with pytest.raises(LmcError, match=r"model-b@no-such-branch' is not in the Hugging Face"):
        run_recipe(
            write(tmp_path, hub_recipe("org/model-a", "org/model-b@no-such-branch")),
            tmp_path / "o2",
            MergeOptions(quiet=True, transformers_cache=str(hub)),
            tmp_path / "c",
        )


@pytest.mark.slow
@pytest.mark.parametrize("command", ["lmc-mergekit-yaml", "mergekit-yaml"])
def test_the_console_script_reads_the_default_cache_from_the_environment(hub, tmp_path, command):
    """The real ``lmc-mergekit-yaml`` and plain ``mergekit-yaml`` processes with HF_HUB_CACHE
    and HF_HUB_OFFLINE set, as a user with an offline machine runs the README's first recipe."""
    script = Path(sys.executable).with_name(command)
    recipe = write(tmp_path, hub_recipe("org/model-a", f"org/model-b@{commit_id(2)}"))
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    env["LMC_MERGEKIT_CACHE"] = str(tmp_path / "lmc")
    done = subprocess.run(
        [str(script), str(recipe), str(tmp_path / "out"), "--quiet"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "lmc_report.json").is_file()


def lora_adapter(base: Path, folder: Path) -> Path:
    """A peft LoRA adapter of ``base`` whose update is not zero."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(folder)
    return folder


def test_lora_inputs_are_merged_as_mergekit_merges_them(tmp_path):
    """``model+adapter`` in a plugin recipe: the pass reads the adapter merged into the model
    (peft's merge_and_unload, as mergekit does it), kept in --lora-merge-cache."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = model_with_tokenizer(tmp_path / "base", seed=1)
    other = model_with_tokenizer(tmp_path / "other", seed=2)
    adapter = lora_adapter(base, tmp_path / "adapter")
    recipe = {
        "merge_method": "lmc_dm",
        "models": [
            {"model": f"{base}+{adapter}", "parameters": {"weight": 1.0}},
            {"model": str(other), "parameters": {"weight": 0.0}},
        ],
        "dtype": "float32",
        "alignment": {"matching": "none", "evaluate": False},
    }
    lora_cache = tmp_path / "lora-cache"
    options = MergeOptions(quiet=True, lora_merge_cache=str(lora_cache))
    out = run_recipe(write(tmp_path, recipe), tmp_path / "out", options, tmp_path / "c")
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    expected = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().state_dict()
    merged = load_file(out / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(expected[name], load_file(base / "model.safetensors")[name])
    for key, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[key], atol=1e-6, rtol=0)
    (kept,) = lora_cache.iterdir()
    assert (kept / "tokenizer.json").is_file()  # the merged model travels with its tokenizer
    card = (out / "README.md").read_text()
    assert f"`{base}+{adapter}`" in card


def test_the_gpu_is_the_default_unless_a_device_is_given():
    """mergekit's validator turns an absent --device into "cpu"; the plugin's passes take the
    GPU when there is one unless the command line chose a device."""
    options = MergeOptions()
    assert options.device == "cpu"
    chosen = with_default_device(options, device_given=False, gpu_available=True)
    assert chosen.device == "cuda"
    assert with_default_device(options, device_given=True, gpu_available=True).device == "cpu"
    assert with_default_device(options, device_given=False, gpu_available=False).device == "cpu"
    assert pass_device(with_default_device(options, False)).type == (
        "cuda" if torch.cuda.is_available() else "cpu"
    )


def test_an_explicit_device_on_the_command_line_is_honoured(hub, tmp_path):
    """``--device cuda`` on a machine without one is refused, where no --device runs."""
    recipe = write(tmp_path, hub_recipe("org/model-a", f"org/model-b@{commit_id(2)}"))
    args = [str(recipe), "--transformers-cache", str(hub), "--quiet"]
    args += ["--lmc-cache", str(tmp_path / "c")]
    asked = CliRunner().invoke(mergekit_yaml_main, [args[0], str(tmp_path / "o1"), *args[1:]])
    assert asked.exit_code == 0, asked.output
    if not torch.cuda.is_available():
        cuda = ["--device", "cuda"]
        result = CliRunner().invoke(
            mergekit_yaml_main, [args[0], str(tmp_path / "o2"), *args[1:], *cuda]
        )
        assert result.exit_code == 1 and "CUDA is not available" in result.output


def test_a_target_config_may_be_a_hub_id(hub, tmp_path):
    """``subclone: target_config:`` names a smaller sibling as users do, by its Hub id; only
    its config.json is read."""
    import json

    donor = model_with_tokenizer(tmp_path / "donor", seed=1)
    config = json.loads((donor / "config.json").read_text())
    small = tmp_path / "small"
    small.mkdir()
    config.update(hidden_size=24, intermediate_size=40, num_attention_heads=2, head_dim=12)
    config["num_key_value_heads"] = 2
    (small / "config.json").write_text(json.dumps(config))
    cache = tmp_path / "hub"
    publish(cache, "org/small", small, commit_id(7))
    recipe = {
        "merge_method": "subclone_compensate",
        "models": [{"model": str(donor)}],
        "subclone": {"target_config": "org/small", "evaluate": False, "seq_len": 32},
    }
    options = MergeOptions(quiet=True, transformers_cache=str(cache))
    out = run_recipe(write(tmp_path, recipe), tmp_path / "out", options, tmp_path / "c")
    written = json.loads((out / "config.json").read_text())
    assert written["hidden_size"] == 24 and written["intermediate_size"] == 40
    assert "target_config: org/small" in (out / "README.md").read_text()
