"""``lmc-mergekit-yaml`` as a drop-in for ``mergekit-yaml``: built-in recipes (modelled on
mergekit's own examples) give bit-identical outputs, relative paths work wherever a recipe
names a model, the card carries the recipe as written, and mergekit's own merge refuses the
plugin's methods on inputs their pre-merge pass did not prepare, in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from mergekit.scripts.run_yaml import main as mergekit_yaml
from tiny_models import stored_tensors
from tokenizer_helpers import model_with_tokenizer

from lmc_mergekit.plugin.cli import mergekit_yaml_main

# mergekit's examples/ (linear, ties, gradient slerp, passthrough), with local models named
# relative to the working directory, plus the places besides `models:` that name a model.
RECIPES = {
    "linear": {
        "models": [
            {"model": "a", "parameters": {"weight": 1.0}},
            {"model": "./b", "parameters": {"weight": 0.3}},
            {"model": "models/c", "parameters": {"weight": 0.5}},
        ],
        "merge_method": "linear",
        "dtype": "float16",
    },
    "ties": {
        "models": [
            {"model": "a", "parameters": {"density": [0.8, 0.3], "weight": [1.0, 0.5]}},
            {"model": "./b", "parameters": {"density": 0.5, "weight": 0.7}},
        ],
        "merge_method": "ties",
        "base_model": "models/c",
        "parameters": {"normalize": True},
        "dtype": "float32",
    },
    "gradient_slerp": {
        "slices": [
            {
                "sources": [
                    {"model": "a", "layer_range": [0, 2]},
                    {"model": "./b", "layer_range": [0, 2]},
                ]
            }
        ],
        "merge_method": "slerp",
        "base_model": "a",
        "parameters": {
            "t": [
                {"filter": "self_attn", "value": [0, 0.5, 1]},
                {"filter": "mlp", "value": [1, 0.5, 0]},
                {"value": 0.5},
            ]
        },
        "dtype": "float32",
    },
    "passthrough": {
        "slices": [
            {"sources": [{"model": "a", "layer_range": [0, 2]}]},
            {"sources": [{"model": "./b", "layer_range": [1, 2]}]},
        ],
        "merge_method": "passthrough",
        "dtype": "float32",
    },
    "tokenizer_and_modules": {
        "modules": {
            "default": {
                "models": [
                    {"model": "a", "parameters": {"weight": 0.6}},
                    {"model": "./b", "parameters": {"weight": 0.4}},
                ]
            }
        },
        "merge_method": "linear",
        "tokenizer": {
            "source": "./b",
            "tokens": {
                "e": {"source": "a"},
                "<|endoftext|>": {
                    "source": {"kind": "model_token", "model": "./b", "token": "<|endoftext|>"}
                },
            },
        },
        "dtype": "float32",
    },
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder with three tiny Llama models (one tokenizer) under relative names."""
    root = tmp_path_factory.mktemp("compat")
    for seed, name in enumerate(("a", "b", "models/c")):
        model_with_tokenizer(root / name, "llama", seed=seed)
    return root


def write(folder: Path, name: str, recipe: dict) -> Path:
    path = folder / f"{name}.yml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_builtin_recipes_are_bit_identical_to_mergekit_yaml(workdir, name, monkeypatch):
    monkeypatch.chdir(workdir)
    recipe = write(workdir, name, RECIPES[name])
    # mergekit's card writer asks the Hub about relative paths (offline it fails): its side
    # writes no card; the comparison is every tensor and config.json.
    theirs = CliRunner().invoke(
        mergekit_yaml, [recipe.name, f"theirs-{name}", "--quiet", "--no-write-model-card"]
    )
    assert theirs.exit_code == 0, theirs.output
    ours = CliRunner().invoke(mergekit_yaml_main, [recipe.name, f"ours-{name}", "--quiet"])
    assert ours.exit_code == 0, ours.output
    a, b = workdir / f"theirs-{name}", workdir / f"ours-{name}"
    mine, reference = stored_tensors(b), stored_tensors(a)
    assert mine.keys() == reference.keys() and mine
    for key, tensor in reference.items():
        assert mine[key].dtype == tensor.dtype and mine[key].equal(tensor), key
    assert json.loads((b / "config.json").read_text()) == json.loads(
        (a / "config.json").read_text()
    )
    # The card: titled after the output, models as the recipe writes them, no Hub ids.
    card = (b / "README.md").read_text()
    assert card.splitlines()[card.splitlines().index("---", 1) + 1] == f"# ours-{name}"
    assert ".partial-" not in card and str(workdir) not in card
    assert "* ./b" in card or "./b as a base" in card or name == "passthrough"
    assert yaml.safe_load(card.split("---")[1])["base_model"] == []
    assert (b / "mergekit_config.yml").read_text() == recipe.read_text()


def test_card_links_hub_ids_and_keeps_local_paths_as_written(workdir, monkeypatch):
    from lmc_mergekit.plugin.card import recipe_card
    from lmc_mergekit.plugin.recipe import parse_recipe

    monkeypatch.chdir(workdir)
    text = yaml.safe_dump(
        {
            "models": [{"model": "a"}, {"model": "someone/hub-model"}],
            "merge_method": "linear",
            "base_model": "models/c",
        }
    )
    card = recipe_card(parse_recipe(text), "merged")
    assert yaml.safe_load(card.split("---")[1])["base_model"] == ["someone/hub-model"]
    assert (
        "* a\n" in card and "[someone/hub-model](https://huggingface.co/someone/hub-model)" in card
    )
    assert "using models/c as a base" in card  # local, though shaped like a Hub id


def test_builtin_methods_ignore_a_launcher_environment(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    recipe = write(workdir, "launcher", RECIPES["linear"])
    result = CliRunner().invoke(mergekit_yaml_main, [recipe.name, "launched", "--quiet"])
    assert result.exit_code == 0, result.output
    # A plugin method would need the process group: one line says what is missing.
    plugin = dict(RECIPES["linear"], merge_method="lmc_dm", alignment={"evaluate": False})
    plugin["models"] = plugin["models"][:2]
    result = CliRunner().invoke(
        mergekit_yaml_main, [write(workdir, "dm", plugin).name, "dm-out", "--quiet"]
    )
    assert result.exit_code == 1 and "MASTER_ADDR" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (workdir / "dm-out").exists()


def plugin_recipe(workdir: Path, tmp_path: Path, method: str) -> Path:
    recipe = {
        "models": [{"model": str(workdir / "a")}, {"model": str(workdir / "b")}],
        "merge_method": method,
        "dtype": "float32",
    }
    return write(tmp_path, "plugin", recipe)


@pytest.mark.parametrize("method", ["lmc_dm", "subclone_compensate", "ls_merge"])
def test_mergekit_alone_refuses_unprepared_inputs_of_a_plugin_method(workdir, tmp_path, method):
    """mergekit's own run_merge, under the routing that gives plugin recipes their pre-merge
    pass, refuses raw inputs in one line before it writes anything."""
    import inspect

    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    from lmc_mergekit.plugin.merge_methods import PluginOnly

    out = tmp_path / "out"
    config = MergeConfiguration.model_validate(
        yaml.safe_load(plugin_recipe(workdir, tmp_path, method).read_text())
    )
    with pytest.raises(PluginOnly) as error:
        inspect.unwrap(run_merge)(config, str(out), MergeOptions(quiet=True))
    message = error.value.format_message()
    assert f"{method}'s pre-merge pass" in message and "\n" not in message
    assert not (out / "config.json").exists() and not list(out.glob("*.safetensors"))


def test_plugin_recipes_take_relative_paths_wherever_a_model_is_named(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    recipe = {
        "models": [
            {"model": "a", "parameters": {"weight": 0.3}},
            {"model": "./b", "parameters": {"weight": 0.7}},
        ],
        "merge_method": "lmc_dm",
        "tokenizer": {"source": "./b", "tokens": {"e": {"source": "a"}}},
        "dtype": "float32",
        "alignment": {"matching": "none", "evaluate": False},
    }
    path = write(workdir, "plugin-relative", recipe)
    result = CliRunner().invoke(mergekit_yaml_main, [path.name, "dm-relative", "--quiet"])
    assert result.exit_code == 0, result.output
    # Unaligned, lmc_dm is mergekit's linear merge of the same models and tokenizer.
    linear = dict(recipe, merge_method="linear")
    del linear["alignment"]
    path = write(workdir, "linear-relative", linear)
    result = CliRunner().invoke(mergekit_yaml_main, [path.name, "linear-relative", "--quiet"])
    assert result.exit_code == 0, result.output
    dm, lin = stored_tensors(workdir / "dm-relative"), stored_tensors(workdir / "linear-relative")
    assert dm.keys() == lin.keys() and all(dm[k].equal(lin[k]) for k in dm)
    card = (workdir / "dm-relative" / "README.md").read_text()
    assert "* a\n* ./b\n" in card and "| `./b` | `lmc_dm/" in card


def test_home_relative_model_paths_are_expanded(workdir, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(workdir))
    recipe = dict(RECIPES["linear"])
    recipe["models"] = [{"model": "~/a", "parameters": {"weight": 1.0}}, {"model": "~/b"}]
    recipe["models"][1]["parameters"] = {"weight": 1.0}
    path = write(tmp_path, "home", recipe)
    result = CliRunner().invoke(mergekit_yaml_main, [str(path), str(tmp_path / "out"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "* ~/a\n* ~/b\n" in (tmp_path / "out" / "README.md").read_text()
