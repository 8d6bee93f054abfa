"""Stand-ins for what the shipped recipes (``recipes/*.yml``) name, so that tests can run every
recipe as a user runs it: each local path gets a random model of the named family, width and
depth with a small real tokenizer (the recipe's shapes, not its training), each Hub id a
snapshot in a Hugging Face cache laid out as huggingface_hub lays it out, and each long
setting a short value."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
import yaml
from hub_cache import commit_id, publish
from tokenizer_helpers import make_tokenizer
from transformers import AutoModelForCausalLM

from lmc_mergekit.plugin.methods import plugin_method
from lmc_mergekit.zoo.architectures import zoo_config
from lmc_mergekit.zoo.tokenizer import SPECIAL_TOKEN

RECIPES = Path(__file__).parents[1] / "recipes"
# A zoo folder name: <family>-d<width>-l<depth>-...-seed<seed>...
ZOO_NAME = re.compile(r"(?P<arch>[a-z0-9_]+)-d(?P<hidden>\d+)-l(?P<layers>\d+)-.*seed(?P<seed>\d+)")
# The tiny models examples/make_tiny_models.py writes.
EXAMPLES = {
    "examples/tiny/gpt-neox-a": "gpt_neox-d64-l2-seed0",
    "examples/tiny/gpt-neox-b": "gpt_neox-d64-l2-seed1",
}
# The Hub models the recipes name, as the families the zoo builds.
HUB_STANDINS = {"EleutherAI/pythia-160m-seed1": 1, "EleutherAI/pythia-160m-seed2": 2}
# Settings that make a recipe long, and the short values tests use: training steps and
# calibration as the recipe sets them, the measurement always.
SHORT = {"steps": 3, "calibration_sequences": 8}
MEASUREMENT = {"eval_sequences": 8, "points": 3}


def plugin_recipes() -> list[Path]:
    """The shipped recipes whose method is a plugin method."""
    return [
        path
        for path in sorted(RECIPES.glob("*.yml"))
        if plugin_method(yaml.safe_load(path.read_text())["merge_method"]) is not None
    ]


def short_recipe(path: Path) -> str:
    """The recipe's text with its long settings shortened."""
    recipe = yaml.safe_load(path.read_text())
    method = plugin_method(recipe["merge_method"])
    section = recipe.get(method.section) or {}
    for key, short in SHORT.items():
        if key in section:
            section[key] = min(section[key], short)
    for key, short in MEASUREMENT.items():
        if key in method.settings.model_fields:
            section[key] = min(section.get(key, short), short)
    recipe[method.section] = section
    return yaml.safe_dump(recipe, sort_keys=False)


def standin_workspace(root: Path) -> tuple[Path, Path]:
    """``(workdir, hub_cache)``: a working folder holding every local model the plugin
    recipes name (at the relative path they name it by) and their shortened recipes as
    ``<name>.yml``, and a Hugging Face cache holding the Hub models they name."""
    workdir, models, hub = root / "work", root / "models", root / "hub"
    workdir.mkdir(parents=True)

    def standin(arch: str, hidden: int, layers: int, seed: int) -> Path:
        folder = models / f"{arch}-d{hidden}-l{layers}-seed{seed}"
        if not folder.is_dir():
            tokenizer = make_tokenizer()
            special = tokenizer.convert_tokens_to_ids(SPECIAL_TOKEN)
            config = zoo_config(arch, hidden, layers, len(tokenizer), 128, special)
            torch.manual_seed(seed)
            AutoModelForCausalLM.from_config(config).save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        return folder

    used: set[Path] = set()
    for path in plugin_recipes():
        recipe = yaml.safe_load(path.read_text())
        (workdir / path.name).write_text(short_recipe(path))
        for name in _named_models(recipe):
            if name in HUB_STANDINS or (workdir / name).exists():
                continue
            found = ZOO_NAME.search(EXAMPLES.get(name, Path(name).name))
            shape = found["arch"], int(found["hidden"]), int(found["layers"])
            seed = int(found["seed"])
            while (model := standin(*shape, seed)) in used:  # two names, two models
                seed += 10
            used.add(model)
            (workdir / name).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(model, workdir / name)
    main_commit = {}
    for hub_id, seed in HUB_STANDINS.items():
        main_commit[hub_id] = commit_id(seed)
        publish(hub, hub_id, standin("gpt_neox", 64, 2, seed), commit_id(seed), "main")
    # A revision the hub recipe names: a branch pointing at the same snapshot.
    for hub_id, commit in main_commit.items():
        (hub / ("models--" + hub_id.replace("/", "--")) / "refs" / "step143000").write_text(commit)
    return workdir, hub


def _named_models(recipe: dict) -> list[str]:
    """Every model path the recipe names (revisions stripped), and a target config's folder."""
    refs = [entry["model"] for entry in recipe.get("models") or []]
    if recipe.get("base_model"):
        refs.append(recipe["base_model"])
    target = (recipe.get("subclone") or {}).get("target_config")
    if target:
        refs.append(str(Path(target).parent))
    return [ref.split("@")[0] for ref in refs]


def untimed(record):
    """A JSON record without its ``seconds`` entries, at any depth."""
    if isinstance(record, dict):
        return {key: untimed(value) for key, value in record.items() if key != "seconds"}
    if isinstance(record, list):
        return [untimed(value) for value in record]
    return record
